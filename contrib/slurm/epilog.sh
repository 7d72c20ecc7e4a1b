#!/bin/bash
# gpuledger Slurm epilog: remove this job's lines from the job-mapping files; other jobs that
# share the GPU keep theirs. Always exits 0 (a failing epilog drains the node).
set -u
. "$(dirname "$(readlink -f "$0")")/gpuledger-mapping.sh" || exit 0
gl_apply remove
exit 0
