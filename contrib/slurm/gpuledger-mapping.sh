# shellcheck shell=bash
# Shared by prolog.sh and epilog.sh: settings and the locked, atomic file update.
#
# Settings (environment, or the file named by GPULEDGER_MAPPING_CONF, default
# /etc/gpuledger/slurm-mapping.conf, which is sourced when it exists):
#   GPULEDGER_DCGM_DIR      dcgm-exporter format dir (files <gpu>, one job id a line);
#                           default /run/gpuledger/dcgm; empty: do not write this format
#   GPULEDGER_JOBSTATS_DIR  jobstats format dir (files <gpu>, "jobid uid" lines);
#                           default /run/gpuledger/jobstats; empty: do not write this format
# The two formats need two directories: both name their files by GPU index.

GPULEDGER_MAPPING_CONF="${GPULEDGER_MAPPING_CONF:-/etc/gpuledger/slurm-mapping.conf}"
if [ -r "$GPULEDGER_MAPPING_CONF" ]; then
    # shellcheck source=/dev/null
    . "$GPULEDGER_MAPPING_CONF"
fi
GPULEDGER_DCGM_DIR="${GPULEDGER_DCGM_DIR-/run/gpuledger/dcgm}"
GPULEDGER_JOBSTATS_DIR="${GPULEDGER_JOBSTATS_DIR-/run/gpuledger/jobstats}"

gl_log() {
    # slurmd keeps a prolog's stderr nowhere useful; syslog is where admins look.
    logger -t gpuledger-slurm -- "$*" 2>/dev/null || echo "gpuledger-slurm: $*" >&2
}

# The node's GPU indexes of the job: SLURM_JOB_GPUS (node numbering, as GRES IDX), never
# CUDA_VISIBLE_DEVICES, which Slurm renumbers inside a job under ConstrainDevices.
gl_gpu_indexes() {
    local ids="${SLURM_JOB_GPUS:-}" item
    ids="${ids//,/ }"
    for item in $ids; do
        case "$item" in
            *[!0-9]*|'') gl_log "job ${SLURM_JOB_ID:-?}: skipping GPU id '$item' (not an index)" ;;
            *) echo "$item" ;;
        esac
    done
}

# The job's name as sacct, the ledger and the slurm-cgroup mapper give it: an array task is
# <array job>_<task> (1234_7), not its own raw SLURM_JOB_ID (1236). slurmd sets both variables
# for a prolog and epilog of an array task.
gl_job_name() {
    case "${SLURM_ARRAY_JOB_ID:-}${SLURM_ARRAY_TASK_ID:-x}" in
        *[!0-9]*) echo "$SLURM_JOB_ID" ;;
        *) echo "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}" ;;
    esac
}

# gl_update DIR FILE MODE LINE: MODE "add" appends LINE unless present, "remove" drops every
# line whose first word is the job's name or raw id. Shared GPUs: several jobs' prologs and epilogs run at
# once on a node, so updates are serialised by a lock and written through a rename, so that
# a reader never sees half a file. A file left empty is removed.
gl_update() {
    local dir="$1" name="$2" mode="$3" line="$4" file tmp
    file="$dir/$name"
    tmp="$dir/.$name.$$.tmp"
    (
        flock -w 10 9 || { gl_log "lock timeout on $dir"; exit 1; }
        if [ -f "$file" ]; then
            awk -v job="$(gl_job_name)" -v raw="${SLURM_JOB_ID}" '$1 != job && $1 != raw' "$file" > "$tmp" || exit 1
        else
            : > "$tmp" || exit 1
        fi
        if [ "$mode" = add ]; then
            printf '%s\n' "$line" >> "$tmp" || exit 1
        fi
        if [ -s "$tmp" ]; then
            chmod 0644 "$tmp" && mv -f "$tmp" "$file"
        else
            rm -f "$tmp" "$file"
        fi
    ) 9>>"$dir/.lock"
}

# gl_names DIR MODE: the files to update. A prolog writes the job's GPUs; an epilog sweeps every
# file, so a job's lines go even if SLURM_JOB_GPUS is unset or the file was renamed by hand.
gl_names() {
    local dir="$1" mode="$2" f
    if [ "$mode" = add ]; then
        gl_gpu_indexes
        return
    fi
    for f in "$dir"/*; do
        [ -f "$f" ] && basename "$f"
    done
}

# gl_apply MODE: write (add) or remove this job's lines in every configured format.
gl_apply() {
    local mode="$1" name rc=0
    if [ -z "${SLURM_JOB_ID:-}" ]; then
        gl_log "SLURM_JOB_ID unset: nothing to do"
        return 0
    fi
    umask 022
    if [ -n "$GPULEDGER_DCGM_DIR" ] && mkdir -p "$GPULEDGER_DCGM_DIR" 2>/dev/null; then
        for name in $(gl_names "$GPULEDGER_DCGM_DIR" "$mode"); do
            gl_update "$GPULEDGER_DCGM_DIR" "$name" "$mode" "$(gl_job_name)" || rc=1
        done
    elif [ -n "$GPULEDGER_DCGM_DIR" ]; then
        gl_log "cannot create $GPULEDGER_DCGM_DIR"; rc=1
    fi
    if [ -n "$GPULEDGER_JOBSTATS_DIR" ] && [ "$mode" = add ] && [ -z "${SLURM_JOB_UID:-}" ]; then
        gl_log "job $SLURM_JOB_ID: SLURM_JOB_UID unset, jobstats format skipped"; rc=1
    elif [ -n "$GPULEDGER_JOBSTATS_DIR" ] && mkdir -p "$GPULEDGER_JOBSTATS_DIR" 2>/dev/null; then
        for name in $(gl_names "$GPULEDGER_JOBSTATS_DIR" "$mode"); do
            gl_update "$GPULEDGER_JOBSTATS_DIR" "$name" "$mode" "$(gl_job_name) ${SLURM_JOB_UID:-}" || rc=1
        done
    elif [ -n "$GPULEDGER_JOBSTATS_DIR" ]; then
        gl_log "cannot create $GPULEDGER_JOBSTATS_DIR"; rc=1
    fi
    [ "$rc" -eq 0 ] || gl_log "job $SLURM_JOB_ID: $mode incomplete (see above)"
    return 0
}
