#!/bin/bash
# gpuledger Slurm prolog: record which job holds which GPU in the job-mapping directories
# (dcgm-exporter and jobstats formats) that gpuledger's mapping-dir mapper reads.
# A failing prolog drains the node, so this script always exits 0 and logs problems instead.
set -u
. "$(dirname "$(readlink -f "$0")")/gpuledger-mapping.sh" || exit 0
gl_apply add
exit 0
