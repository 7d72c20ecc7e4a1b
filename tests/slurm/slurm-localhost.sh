#!/usr/bin/env bash
# Copied from shared/research/slurm-localhost.sh (the tested recipe in shared/research/slurm-localhost.md,
# written by an earlier gpuledger research session) so that the repository owns its test harness.
# Changes here: SLH_LUA_SCRIPT (install a given job_submit.lua), SLH_WEIGHT_FAIRSHARE, SLH_MAX_JOBS.
#
# slurm-localhost.sh -- bring up a REAL single-node Slurm cluster on loopback
# (munged + MariaDB + slurmdbd + slurmctld + slurmd), all state in one scratch
# directory, no systemd.  Tested on Debian 12 (bookworm) with the distro
# packages slurm-wlm/slurmdbd 22.05.8, munge 0.5.15, mariadb-server 10.11.
#
# Needs root (slurmd must be able to switch to the job users).
# Prerequisite (not done here):
#   apt-get install -y slurm-wlm slurmdbd munge mariadb-server
#
# Usage as a command:
#   ./slurm-localhost.sh up       [DIR]   # start everything, wait until node idle
#   ./slurm-localhost.sh down     [DIR]   # cancel jobs, stop every daemon we started
#   ./slurm-localhost.sh purge    [DIR]   # down + rm -rf DIR (+ userdel if SLH_DELETE_USERS=1)
#   ./slurm-localhost.sh status   [DIR]
#   ./slurm-localhost.sh restart-ctld [DIR]  # forces a priority recalculation now
#   ./slurm-localhost.sh selftest [DIR]   # up, exercise jobs/sacct/sprio/sshare, down
#   DIR defaults to /tmp/slurm-localhost.
#
# Usage as a library (e.g. from a pytest fixture via bash -c):
#   source slurm-localhost.sh
#   slh_up /tmp/xyz && source /tmp/xyz/env.sh     # exports SLURM_CONF
#   slh_sbatch_as alice --gres=gpu:1 --wrap 'sleep 5'
#   slh_down /tmp/xyz
#
# Clients find the cluster only through SLURM_CONF=DIR/etc/slurm.conf (written
# to DIR/env.sh).  Nothing under /etc is touched unless SLH_LINK_ETC=1 (then
# /etc/slurm/slurm.conf becomes a symlink to DIR/etc/slurm.conf while up).
#
# Knobs (environment variables, defaults in brackets):
#   SLH_CLUSTER [testcluster]   SLH_PARTITION [gpu]
#   SLH_NODE [$(hostname -s)]   SLH_CPUS [8]   SLH_MEM_MB [8000]
#   SLH_GPUS [4]   SLH_GPU_TYPE [h200]   (fake /dev nodes are made in DIR/dev)
#   SLH_USERS ["alice:proj_a bob:proj_a carol:proj_b"]  user:account pairs;
#              users are created with useradd if missing
#   SLH_CTLD_PORT [6817] SLH_SLURMD_PORT [6818] SLH_DBD_PORT [6819]
#   SLH_MYSQL_PORT [13306] (MariaDB listens on 127.0.0.1 only)
#   SLH_CGROUP [0]   1 = proctrack/cgroup + task/cgroup (needs a writable
#                    cgroup fs); 0 = proctrack/linuxproc + task/none
#   SLH_LUA [1]      1 = JobSubmitPlugins=lua with DIR/etc/job_submit.lua,
#                    which adds a site factor read from DIR/etc/site_factor.map
#                    ("user value" lines) at submit time
#   SLH_LUA_SCRIPT [unset]  path of a job_submit.lua to install instead of the
#                    site_factor.map demo (needs SLH_LUA=1)
#   SLH_WEIGHT_FAIRSHARE [10000]  PriorityWeightFairshare (0 when an outside
#                    site factor replaces Slurm's own fair share)
#   SLH_MAX_JOBS [10000]  MaxJobCount (jobs slurmctld holds, finished ones
#                    included until MinJobAge) and MaxArraySize (+1); raise
#                    it to submit 10,000 jobs and more
#   SLH_DECAY_HALFLIFE [0-00:05:00]  PriorityDecayHalfLife
#   SLH_TRES_BILLING [unset]  e.g. "CPU=1.0,GRES/gpu=10.0": partition
#                    TRESBillingWeights, i.e. what fair-share usage counts
#                    (unset = allocated CPUs only)
#   SLH_LINK_ETC [0]   SLH_DELETE_USERS [0] (purge only)
#   SLH_TIMEOUT [60]  seconds to wait for each daemon

# ----------------------------------------------------------------- helpers
_slh_now() { local t=${EPOCHREALTIME/,/.}; echo "${t:-$(date +%s.%N)}"; }
_slh_since() { awk -v a="$1" -v b="$(_slh_now)" 'BEGIN{printf "%.2f", b-a}'; }
_slh_t0=$(_slh_now)
_slh_log() { printf '[slh %6ss] %s\n' "$(_slh_since "$_slh_t0")" "$*" >&2; }
_slh_die() { _slh_log "ERROR: $*"; return 1; }

_slh_vars() {
    SLH_DIR=${1:-${SLH_DIR:-/tmp/slurm-localhost}}
    SLH_DIR=${SLH_DIR%/}
    SLH_CLUSTER=${SLH_CLUSTER:-testcluster}
    SLH_PARTITION=${SLH_PARTITION:-gpu}
    SLH_NODE=${SLH_NODE:-$(hostname -s)}
    SLH_CTLD_HOST=$(hostname -s)
    SLH_CPUS=${SLH_CPUS:-8}
    SLH_MEM_MB=${SLH_MEM_MB:-8000}
    SLH_GPUS=${SLH_GPUS:-4}
    SLH_GPU_TYPE=${SLH_GPU_TYPE:-h200}
    SLH_USERS=${SLH_USERS:-alice:proj_a bob:proj_a carol:proj_b}
    SLH_CTLD_PORT=${SLH_CTLD_PORT:-6817}
    SLH_SLURMD_PORT=${SLH_SLURMD_PORT:-6818}
    SLH_DBD_PORT=${SLH_DBD_PORT:-6819}
    SLH_MYSQL_PORT=${SLH_MYSQL_PORT:-13306}
    SLH_CGROUP=${SLH_CGROUP:-0}
    SLH_LUA=${SLH_LUA:-1}
    SLH_DECAY_HALFLIFE=${SLH_DECAY_HALFLIFE:-0-00:05:00}
    SLH_LUA_SCRIPT=${SLH_LUA_SCRIPT:-}
    SLH_WEIGHT_FAIRSHARE=${SLH_WEIGHT_FAIRSHARE:-10000}
    SLH_MAX_JOBS=${SLH_MAX_JOBS:-10000}
    SLH_LINK_ETC=${SLH_LINK_ETC:-0}
    SLH_TIMEOUT=${SLH_TIMEOUT:-60}
    SLH_DB_PASS=slurmdbpass
    SLH_MUNGE_SOCK=$SLH_DIR/munge/run/munge.sock
    SLH_MYSQL_SOCK=$SLH_DIR/mysql/run/mysqld.sock
    export SLURM_CONF=$SLH_DIR/etc/slurm.conf
}

# wait until "$@" succeeds (silently), polling every 0.1 s
_slh_wait() {
    local what=$1 timeout=$2; shift 2
    local end=$(( $(date +%s) + timeout ))
    until "$@" >/dev/null 2>&1; do
        if (( $(date +%s) >= end )); then _slh_die "timeout ($timeout s) waiting for $what"; return 1; fi
        sleep 0.1
    done
    _slh_log "$what ready"
}

_slh_port_free() { ! ss -Hltn "sport = :$1" 2>/dev/null | grep -q .; }

# start a daemon in its own session, in the foreground mode, remember its PID
_slh_spawn() {   # name logfile cmd...
    local name=$1 out=$2; shift 2
    setsid "$@" </dev/null >>"$out" 2>&1 &
    echo $! >"$SLH_DIR/run/$name.pid"
    _slh_log "started $name pid $!"
}

# true if PID exists and is not a zombie (PID 1 may reap orphans late)
_slh_running() { local st; st=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) && [[ -n $st && $st != Z ]]; }

_slh_pid_alive() {   # name expected-comm-regex -> prints pid if it is ours and alive
    local f=$SLH_DIR/run/$1.pid pid comm
    [[ -s $f ]] || return 1
    pid=$(<"$f")
    _slh_running "$pid" || return 1
    comm=$(cat /proc/$pid/comm 2>/dev/null) || return 1
    [[ $comm =~ $2 ]] || return 1
    echo "$pid"
}

_slh_stop() {   # name comm-regex
    local pid i
    pid=$(_slh_pid_alive "$1" "$2") || { rm -f "$SLH_DIR/run/$1.pid"; return 0; }
    kill -TERM "$pid" 2>/dev/null
    for i in $(seq 1 150); do _slh_running "$pid" || break; sleep 0.1; done
    if _slh_running "$pid"; then _slh_log "$1 ($pid) ignored SIGTERM, SIGKILL"; kill -KILL "$pid"; sleep 0.2; fi
    rm -f "$SLH_DIR/run/$1.pid"
    _slh_log "stopped $1 ($pid)"
}

# PIDs of slurmstepd processes and job processes that belong to THIS cluster:
# slurmstepd inherits slurmd's environment (SLURM_CONF=ours); job processes carry
# SLURM_CONF=ours (sbatch exports the submitter's env) AND SLURM_JOB_ID.
# The caller's own shell (which may also export SLURM_CONF) never has SLURM_JOB_ID.
_slh_marked_pids() {
    local p pid env exe
    for p in /proc/[0-9]*; do
        pid=${p#/proc/}
        [[ $pid == "$$" || $pid == "$BASHPID" || $pid == "$PPID" ]] && continue
        env=$( { tr '\0' '\n' <"$p/environ"; } 2>/dev/null ) || continue
        grep -qx "SLURM_CONF=$SLURM_CONF" <<<"$env" || continue
        exe=$(readlink "$p/exe" 2>/dev/null)
        if [[ $exe == */slurmstepd* ]] || grep -q '^SLURM_JOB_ID=' <<<"$env"; then echo "$pid"; fi
    done
}

# ----------------------------------------------------------------- pieces
_slh_users() {
    local pair u a
    for pair in $SLH_USERS; do
        u=${pair%%:*}
        id "$u" >/dev/null 2>&1 || { useradd -m -s /bin/bash "$u" || return 1; _slh_log "useradd $u"; }
    done
}

_slh_munge() {
    local d=$SLH_DIR/munge
    mkdir -p "$d/etc" "$d/run" "$d/lib"
    chown -R munge:munge "$d"
    chmod 755 "$d" "$d/run"          # socket dir must be world-traversable
    chmod 700 "$d/etc" "$d/lib"      # key dir must not be
    if [[ ! -s $d/etc/munge.key ]]; then
        if command -v mungekey >/dev/null; then
            runuser -u munge -- mungekey --create --keyfile="$d/etc/munge.key" || return 1
        else
            dd if=/dev/urandom bs=1 count=1024 of="$d/etc/munge.key" 2>/dev/null
            chown munge:munge "$d/etc/munge.key"; chmod 400 "$d/etc/munge.key"
        fi
    fi
    # setpriv exec()s (runuser would stay as parent), so the PID we record is munged's
    _slh_spawn munged "$d/lib/munged.log" setpriv --reuid=munge --regid=munge --init-groups \
        /usr/sbin/munged -F \
        --key-file="$d/etc/munge.key" --socket="$SLH_MUNGE_SOCK" \
        --pid-file="$d/run/munged.pid" --seed-file="$d/lib/munged.seed" \
        --log-file="$d/lib/munged.log"
    _slh_wait munged 20 bash -c "munge -S '$SLH_MUNGE_SOCK' -n | unmunge -S '$SLH_MUNGE_SOCK'"
}

_slh_mysql() {
    local d=$SLH_DIR/mysql
    mkdir -p "$d/data" "$d/run"
    chown -R mysql:mysql "$d"
    if [[ ! -d $d/data/mysql ]]; then
        mariadb-install-db --no-defaults --datadir="$d/data" --user=mysql \
            --skip-test-db --auth-root-authentication-method=normal \
            --innodb-log-file-size=64M >"$d/install.log" 2>&1 \
            || { cat "$d/install.log" >&2; _slh_die "mariadb-install-db failed"; return 1; }
        _slh_log "mariadb datadir initialised"
    fi
    # runs as user mysql (mariadbd setuid()s itself); TCP on 127.0.0.1 only
    _slh_spawn mariadbd "$d/mysqld.out" /usr/sbin/mariadbd --no-defaults \
        --datadir="$d/data" --socket="$SLH_MYSQL_SOCK" --pid-file="$d/run/mysqld.pid" \
        --port="$SLH_MYSQL_PORT" --bind-address=127.0.0.1 --skip-name-resolve \
        --user=mysql --log-error="$d/mysqld.err" \
        --innodb-buffer-pool-size=128M --innodb-log-file-size=64M \
        --innodb-lock-wait-timeout=900 --max-connections=50 \
        --performance-schema=OFF
    _slh_wait mariadbd "$SLH_TIMEOUT" mariadb-admin --no-defaults -S "$SLH_MYSQL_SOCK" -uroot ping
    mariadb --no-defaults -S "$SLH_MYSQL_SOCK" -uroot <<EOF || return 1
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$SLH_DB_PASS';
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$SLH_DB_PASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
FLUSH PRIVILEGES;
EOF
}

_slh_configs() {
    local e=$SLH_DIR/etc i last=$((SLH_GPUS - 1)) proctrack task jobacct
    mkdir -p "$e" "$SLH_DIR/state/ctld" "$SLH_DIR/state/d" "$SLH_DIR/log" "$SLH_DIR/dev" "$SLH_DIR/jobs"
    chmod 1777 "$SLH_DIR/jobs"
    # Fake GPU device nodes.  gres/gpu drops GPUs that have no File= ("Removing
    # file-less GPU gpu:h200 from final GRES list") and logs an error for plain
    # files ("is not a valid character or block device"), so make char devices
    # with the NVIDIA major (195).  Opening them fails with ENXIO: harmless.
    for ((i = 0; i < SLH_GPUS; i++)); do
        [[ -c $SLH_DIR/dev/nvidia$i ]] || mknod "$SLH_DIR/dev/nvidia$i" c 195 "$i" 2>/dev/null \
            || touch "$SLH_DIR/dev/nvidia$i"
    done
    if [[ $SLH_CGROUP == 1 ]]; then
        proctrack=proctrack/cgroup task=task/cgroup jobacct=jobacct_gather/cgroup
    else
        proctrack=proctrack/linuxproc task=task/none jobacct=jobacct_gather/linux
    fi
    cat >"$e/slurm.conf" <<EOF
# generated by slurm-localhost.sh
ClusterName=$SLH_CLUSTER
SlurmctldHost=$SLH_CTLD_HOST(127.0.0.1)
SlurmctldPort=$SLH_CTLD_PORT
SlurmdPort=$SLH_SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# munge socket for slurmctld/slurmd/client<->slurmctld traffic
AuthInfo=socket=$SLH_MUNGE_SOCK
StateSaveLocation=$SLH_DIR/state/ctld
SlurmdSpoolDir=$SLH_DIR/state/d
SlurmctldPidFile=$SLH_DIR/run/slurmctld.daemon.pid
SlurmdPidFile=$SLH_DIR/run/slurmd.daemon.pid
SlurmctldLogFile=$SLH_DIR/log/slurmctld.log
SlurmdLogFile=$SLH_DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig=$e/plugstack.conf
MailProg=/bin/true
MpiDefault=none
ProctrackType=$proctrack
TaskPlugin=$task
JobAcctGatherType=$jobacct
JobAcctGatherFrequency=30
ReturnToService=2
# accept the declared CPUs/RealMemory even though the box has fewer
SlurmdParameters=config_overrides
# bind slurmctld/slurmd to the configured address (127.0.0.1), not 0.0.0.0
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
SchedulerType=sched/backfill
# default batch_sched_delay=3 s delays the start of batch jobs; 0 = start within ~1 s
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
DefMemPerCPU=1000
GresTypes=gpu
InactiveLimit=0
KillWait=5
MinJobAge=300
MaxJobCount=$SLH_MAX_JOBS
MaxArraySize=$((SLH_MAX_JOBS + 1))
# accounting via slurmdbd
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$SLH_DBD_PORT
# for accounting_storage/slurmdbd this is the munge socket used to talk to slurmdbd
# (AuthInfo is NOT used for that connection)
AccountingStoragePass=$SLH_MUNGE_SOCK
AccountingStorageEnforce=associations,limits,qos
AccountingStorageTRES=gres/gpu,gres/gpu:$SLH_GPU_TYPE
AccountingStoreFlags=job_comment
JobCompType=jobcomp/none
# priority
PriorityType=priority/multifactor
PriorityDecayHalfLife=$SLH_DECAY_HALFLIFE
PriorityCalcPeriod=1
PriorityUsageResetPeriod=NONE
PriorityMaxAge=1-0
PriorityWeightAge=1000
PriorityWeightFairshare=$SLH_WEIGHT_FAIRSHARE
PriorityWeightAssoc=1000
PriorityWeightQOS=1000
PriorityWeightJobSize=0
PriorityWeightPartition=0
$( [[ $SLH_LUA == 1 ]] && echo "JobSubmitPlugins=lua" )
NodeName=$SLH_NODE NodeAddr=127.0.0.1 NodeHostname=$SLH_NODE CPUs=$SLH_CPUS RealMemory=$SLH_MEM_MB Gres=gpu:$SLH_GPU_TYPE:$SLH_GPUS State=UNKNOWN
PartitionName=$SLH_PARTITION Nodes=$SLH_NODE Default=YES MaxTime=INFINITE State=UP${SLH_TRES_BILLING:+ TRESBillingWeights=$SLH_TRES_BILLING}
EOF
    cat >"$e/gres.conf" <<EOF
AutoDetect=off
NodeName=$SLH_NODE Name=gpu Type=$SLH_GPU_TYPE File=$SLH_DIR/dev/nvidia[0-$last]
EOF
    : >"$e/plugstack.conf"
    cat >"$e/cgroup.conf" <<EOF
CgroupPlugin=autodetect
ConstrainCores=no
ConstrainDevices=yes
ConstrainRAMSpace=yes
EOF
    if [[ -n $SLH_LUA_SCRIPT ]]; then
        cp "$SLH_LUA_SCRIPT" "$e/job_submit.lua" || return 1
    else
    cat >"$e/job_submit.lua" <<EOF
-- site factor from DIR/etc/site_factor.map ("user value" per line), read at submit
local MAP = "$e/site_factor.map"
function slurm_job_submit(job_desc, part_list, submit_uid)
   local f = io.open(MAP, "r")
   if f then
      local user = job_desc.user_name
      for line in f:lines() do
         local u, v = line:match("^%s*(%S+)%s+(-?%d+)")
         if u and (u == user or u == "*") then job_desc.site_factor = tonumber(v) end
      end
      f:close()
   end
   return slurm.SUCCESS
end
function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
   return slurm.SUCCESS
end
return slurm.SUCCESS
EOF
    fi
    umask 077
    cat >"$e/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$SLH_MUNGE_SOCK
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$SLH_DBD_PORT
# bind slurmdbd to DbdAddr (127.0.0.1), not 0.0.0.0
CommunicationParameters=NoInAddrAny
SlurmUser=root
DebugLevel=info
LogFile=$SLH_DIR/log/slurmdbd.log
PidFile=$SLH_DIR/run/slurmdbd.daemon.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$SLH_MYSQL_PORT
StorageUser=slurm
StoragePass=$SLH_DB_PASS
StorageLoc=slurm_acct_db
EOF
    umask 022
    chmod 600 "$e/slurmdbd.conf"
    cat >"$SLH_DIR/env.sh" <<EOF
export SLURM_CONF=$SLURM_CONF
EOF
}

_slh_sacctmgr_setup() {
    # one "sacctmgr load" creates cluster, accounts and users (idempotent, ~1.5 s)
    local pair a f=$SLH_DIR/etc/associations.cfg
    {
        echo "Cluster - '$SLH_CLUSTER'"
        echo "Parent - 'root'"
        echo "User - 'root':DefaultAccount='root':AdminLevel='Administrator'"
        for a in $(for pair in $SLH_USERS; do echo "${pair#*:}"; done | sort -u); do
            echo "Account - '$a':Description='$a':Organization='test'"
        done
        for a in $(for pair in $SLH_USERS; do echo "${pair#*:}"; done | sort -u); do
            echo "Parent - '$a'"
            for pair in $SLH_USERS; do
                [[ ${pair#*:} == "$a" ]] && echo "User - '${pair%%:*}':DefaultAccount='$a'"
            done
        done
    } >"$f"
    sacctmgr -i load file="$f" >"$SLH_DIR/log/sacctmgr-load.log" 2>&1 \
        || { cat "$SLH_DIR/log/sacctmgr-load.log" >&2; return 1; }
    _slh_log "accounts/users registered (sacctmgr load $f)"
}

_slh_node_idle() { [[ $(sinfo -h -n "$SLH_NODE" -o %T 2>/dev/null) == idle ]]; }
_slh_node_responding() {
    local st; st=$(sinfo -h -n "$SLH_NODE" -o %T 2>/dev/null)
    [[ -n $st && $st != *unknown* && $st != *'*'* && $st != down* ]]
}

# ----------------------------------------------------------------- public
slh_up() {
    _slh_vars "$@"
    _slh_t0=$(_slh_now)
    [[ $(id -u) == 0 ]] || { _slh_die "must run as root"; return 1; }
    local b p
    for b in munged mariadbd mariadb-install-db slurmdbd slurmctld slurmd sacctmgr sbatch; do
        command -v "$b" >/dev/null || { _slh_die "$b not found (apt-get install slurm-wlm slurmdbd munge mariadb-server)"; return 1; }
    done
    if _slh_pid_alive slurmctld 'slurmctld' >/dev/null 2>&1; then _slh_die "already up in $SLH_DIR"; return 1; fi
    for p in "$SLH_CTLD_PORT" "$SLH_SLURMD_PORT" "$SLH_DBD_PORT" "$SLH_MYSQL_PORT"; do
        _slh_port_free "$p" || { _slh_die "port $p already in use"; return 1; }
    done
    mkdir -p "$SLH_DIR/run" "$SLH_DIR/log"
    chmod 755 "$SLH_DIR"        # munge/mysql/job users must traverse it
    _slh_log "bring-up in $SLH_DIR (cluster $SLH_CLUSTER, node $SLH_NODE)"
    _slh_users                 || return 1
    _slh_munge                 || { slh_down "$SLH_DIR"; return 1; }
    _slh_mysql                 || { slh_down "$SLH_DIR"; return 1; }
    _slh_configs               || { slh_down "$SLH_DIR"; return 1; }
    _slh_spawn slurmdbd "$SLH_DIR/log/slurmdbd.out" /usr/sbin/slurmdbd -D
    _slh_wait slurmdbd "$SLH_TIMEOUT" sacctmgr -n show cluster || { slh_down "$SLH_DIR"; return 1; }
    _slh_sacctmgr_setup        || { _slh_die "sacctmgr setup failed"; slh_down "$SLH_DIR"; return 1; }
    _slh_spawn slurmctld "$SLH_DIR/log/slurmctld.out" /usr/sbin/slurmctld -D -f "$SLURM_CONF"
    _slh_wait slurmctld "$SLH_TIMEOUT" bash -c 'scontrol ping | grep -q UP' || { slh_down "$SLH_DIR"; return 1; }
    _slh_spawn slurmd "$SLH_DIR/log/slurmd.out" /usr/sbin/slurmd -D -f "$SLURM_CONF" -N "$SLH_NODE"
    _slh_wait "slurmd (node $SLH_NODE idle)" "$SLH_TIMEOUT" _slh_node_idle || {
        sinfo -N -o '%N %T %E' >&2; slh_down "$SLH_DIR"; return 1; }
    if [[ $SLH_LINK_ETC == 1 ]]; then
        mkdir -p /etc/slurm
        [[ -e /etc/slurm/slurm.conf && ! -L /etc/slurm/slurm.conf ]] && mv /etc/slurm/slurm.conf /etc/slurm/slurm.conf.slh-saved
        ln -sfn "$SLURM_CONF" /etc/slurm/slurm.conf
    fi
    _slh_log "UP: export SLURM_CONF=$SLURM_CONF   (or: source $SLH_DIR/env.sh)"
}

slh_down() {
    _slh_vars "$@"
    [[ -d $SLH_DIR/run ]] || return 0
    local ids i p
    if _slh_pid_alive slurmctld slurmctld >/dev/null; then
        ids=$(squeue -h -o %A 2>/dev/null | paste -sd' ')
        if [[ -n $ids ]]; then
            _slh_log "cancelling jobs: $ids"
            scancel $ids 2>/dev/null
            for i in $(seq 1 150); do [[ -z $(squeue -h -t R,CG,PD -o %A 2>/dev/null) ]] && break; sleep 0.1; done
        fi
    fi
    _slh_stop slurmd    'slurmd'
    # proctrack/cgroup leaves empty /sys/fs/cgroup/<ctrl>/slurm_<node> dirs behind
    if grep -q '^ProctrackType=proctrack/cgroup' "$SLURM_CONF" 2>/dev/null; then
        find /sys/fs/cgroup/*/"slurm_$SLH_NODE" -depth -type d -exec rmdir {} \; 2>/dev/null
    fi
    _slh_stop slurmctld 'slurmctld'
    _slh_stop slurmdbd  'slurmdbd'
    _slh_stop mariadbd  'mariadbd|mysqld'
    _slh_stop munged    'munged'
    # stragglers: slurmstepd / job processes that inherited our SLURM_CONF
    for p in $(_slh_marked_pids); do
        _slh_log "killing leftover pid $p ($(cat /proc/$p/comm 2>/dev/null))"
        kill -KILL "$p" 2>/dev/null
    done
    if [[ -L /etc/slurm/slurm.conf && $(readlink /etc/slurm/slurm.conf) == "$SLURM_CONF" ]]; then
        rm -f /etc/slurm/slurm.conf
        [[ -e /etc/slurm/slurm.conf.slh-saved ]] && mv /etc/slurm/slurm.conf.slh-saved /etc/slurm/slurm.conf
    fi
    _slh_log "DOWN ($SLH_DIR)"
}

slh_purge() {
    slh_down "$@"
    _slh_vars "$@"
    local pair
    [[ $SLH_DIR == /tmp/* ]] && rm -rf "$SLH_DIR"
    if [[ ${SLH_DELETE_USERS:-0} == 1 ]]; then
        for pair in $SLH_USERS; do userdel -r "${pair%%:*}" 2>/dev/null; done
    fi
    _slh_log "purged"
}

slh_status() {
    _slh_vars "$@"
    local n
    for n in munged:munged mariadbd:'mariadbd|mysqld' slurmdbd:slurmdbd slurmctld:slurmctld slurmd:slurmd; do
        if p=$(_slh_pid_alive "${n%%:*}" "${n#*:}"); then
            echo "${n%%:*} pid $p rss $(awk '/VmRSS/{print $2" "$3}' /proc/$p/status)"
        else echo "${n%%:*} not running"; fi
    done
    sinfo -N -o '%N %c %m %G %T %E' 2>/dev/null
}

# Restart slurmctld only (~2.5 s).  Jobs survive (state in DIR/state/ctld), and the
# multifactor plugin recalculates fair-share/assoc factors at start-up, so a test
# need not wait for the next PriorityCalcPeriod tick (minimum 1 minute).
slh_restart_ctld() {
    _slh_vars "$@"
    _slh_stop slurmctld slurmctld
    _slh_spawn slurmctld "$SLH_DIR/log/slurmctld.out" /usr/sbin/slurmctld -D -f "$SLURM_CONF"
    _slh_wait slurmctld "$SLH_TIMEOUT" bash -c 'scontrol ping | grep -q UP' || return 1
    # the node shows "unknown" until slurmd re-registers (~4 s); reconfigure makes it immediate
    scontrol reconfigure
    _slh_wait "node $SLH_NODE responding" "$SLH_TIMEOUT" _slh_node_responding
}

# submit as another user: slh_sbatch_as USER [sbatch args...]  (prints the job id)
slh_sbatch_as() {
    local u=$1; shift
    runuser -u "$u" -- env SLURM_CONF="$SLURM_CONF" sbatch --parsable --chdir="${SLH_DIR:-/tmp}/jobs" "$@"
}

# ----------------------------------------------------------------- self test
slh_selftest() {
    _slh_vars "$@"
    local t_start j1 j2 j3 jb jx ja jbob jc rc=0
    t_start=$(_slh_now)
    slh_up "$SLH_DIR" || return 1
    local t_up; t_up=$(_slh_since "$t_start")
    echo "== 1. one GPU job per user, environment of a job"
    j1=$(slh_sbatch_as alice --gres=gpu:1 -o "$SLH_DIR/jobs/%j.out" --wrap \
        'env | grep -E "^(SLURM_JOB_ID|SLURM_JOB_ACCOUNT|SLURM_JOB_GPUS|CUDA_VISIBLE_DEVICES|GPU_DEVICE_ORDINAL|SLURM_JOB_USER)=" | sort; echo cgroup:; cat /proc/self/cgroup; sleep 2')
    j2=$(slh_sbatch_as bob   --gres=gpu:h200:2 -o /dev/null --wrap 'sleep 2')
    j3=$(slh_sbatch_as carol --gres=gpu:1 -o /dev/null --wrap 'sleep 1; exit 3')
    echo "submitted $j1 $j2 $j3"
    _slh_wait "jobs $j1 $j2 $j3 in sacct as ended" 60 bash -c \
        "[[ \$(sacct -n -X -P -j $j1,$j2,$j3 -o State | grep -cE 'COMPLETED|FAILED') == 3 ]]" || rc=1
    local t_job; t_job=$(_slh_since "$t_start")
    cat "$SLH_DIR/jobs/$j1.out"
    echo "== 2. sacct -P"
    sacct -a -P -j "$j1,$j2,$j3" --format=JobID,User,Account,Partition,Start,End,Elapsed,AllocTRES,State,ExitCode
    echo "== 3. sacct --json (summary via python3)"
    sacct -a --json -j "$j1,$j2,$j3" | python3 -c '
import json,sys
d=json.load(sys.stdin)
print("plugin:", d["meta"]["plugin"]["type"], "errors:", d["errors"])
for j in d["jobs"]:
    t=j["time"]; tres={(x["type"]+("/"+x["name"] if x["name"] else "")):x["count"] for x in j["tres"]["allocated"]}
    print(j["job_id"], j["user"], j["account"], j["partition"], j["state"]["current"],
          "exit", j["exit_code"]["return_code"], "start", t["start"], "end", t["end"], "elapsed", t["elapsed"],
          "prio", j["priority"], "tres", tres)
    print("   exit_code", j["exit_code"], "derived", j["derived_exit_code"],
          "steps", [(st["step"]["name"], st["exit_code"]) for st in j["steps"]])' || rc=1
    echo "== 4. priority: busy node, pending jobs, SiteFactor from outside"
    jb=$(slh_sbatch_as carol --gres=gpu:$SLH_GPUS -o /dev/null --wrap 'sleep 300')
    _slh_wait "blocker $jb running" 30 bash -c "[[ \$(squeue -h -j $jb -o %T) == RUNNING ]]" || rc=1
    ja=$(slh_sbatch_as alice --gres=gpu:$SLH_GPUS -o /dev/null --wrap 'sleep 1')
    jbob=$(slh_sbatch_as bob --gres=gpu:$SLH_GPUS -o /dev/null --wrap 'sleep 1')
    jc=$(slh_sbatch_as carol --gres=gpu:$SLH_GPUS -o /dev/null --wrap 'sleep 1')
    sleep 1
    echo "-- before:"; sprio -l
    scontrol update jobid="$jc" SiteFactor=50000 || rc=1
    scontrol update jobid="$ja" SiteFactor=-2000 || rc=1
    echo "-- right after scontrol update SiteFactor (carol +50000, alice -2000):"
    sprio -o '%.8i %.8u %.10Y %.10S %.10F %.10A %.10B %.10Q'
    echo "-- non-root attempt:"
    runuser -u alice -- env SLURM_CONF="$SLURM_CONF" scontrol update jobid="$ja" SiteFactor=99999 2>&1
    echo "-- sacctmgr modify user bob set priority=100 (assoc factor) fairshare=10 (raw shares)"
    sacctmgr -i modify user where name=bob set priority=100 fairshare=10 >/dev/null || rc=1
    if [[ $SLH_LUA == 1 ]]; then
        echo "-- job_submit.lua site factor (site_factor.map: 'alice 777')"
        echo "alice 777" >"$SLH_DIR/etc/site_factor.map"
        jx=$(slh_sbatch_as alice --gres=gpu:$SLH_GPUS -o /dev/null --wrap 'sleep 1')
        rm -f "$SLH_DIR/etc/site_factor.map"
        sprio -j "$jx" -o '%.8i %.8u %.10Y %.10S'
        [[ $(sprio -h -j "$jx" -o %S | tr -d ' ') == 777 ]] || { echo "lua site factor NOT applied"; rc=1; }
    fi
    echo "== 5. after the next PriorityCalcPeriod run (waiting for it, <= 70 s)"
    local t_wait; t_wait=$(_slh_now)
    _slh_wait "priority recalculation (bob's ASSOC factor > 0)" 75 bash -c \
        "[[ \$(sprio -h -j $jbob -o %B | tr -d ' ') != 0 ]]" || rc=1
    echo "(waited $(_slh_since "$t_wait") s)"
    sprio -o '%.8i %.8u %.10Y %.10S %.10F %.10A %.10B %.10Q'
    sprio -w
    sshare -a -l -o Account,User,RawShares,NormShares,RawUsage,NormUsage,EffectvUsage,FairShare,LevelFS
    echo "-- release blocker; start order must follow priority"
    scancel "$jb"
    _slh_wait "pending jobs done" 90 bash -c "[[ -z \$(squeue -h -u alice,bob,carol) ]]" || rc=1
    echo "JobID|User|Start|Priority(sacct: value at submit)|State"
    local order rows
    rows=$(sacct -n -a -P -X -j "$ja,$jbob,$jc${jx:+,$jx}" --format=JobID,User,Start,Priority,State | sort -t'|' -k3,3 -k1,1n)
    echo "$rows"
    order=$(cut -d'|' -f1 <<<"$rows" | paste -sd' ')
    [[ $order == "$jc $jbob ${jx:+$jx }$ja" ]] && echo "start order OK ($order)" || { echo "start order UNEXPECTED: $order"; rc=1; }
    echo "== 6. memory of daemons, listening sockets"; slh_status "$SLH_DIR"
    local socks; socks=$(ss -Hltn 2>/dev/null | awk -v p=":($SLH_CTLD_PORT|$SLH_SLURMD_PORT|$SLH_DBD_PORT|$SLH_MYSQL_PORT)\$" '$4 ~ p {print $4}')
    echo "$socks"
    grep -qv '^127\.0\.0\.1:' <<<"$socks" && { echo "NOT loopback-only"; rc=1; }
    echo "== 7. teardown with a job still running"
    local jl; jl=$(slh_sbatch_as alice -o /dev/null --wrap 'sleep 600')
    _slh_wait "long job $jl running" 30 bash -c "[[ \$(squeue -h -j $jl -o %T) == RUNNING ]]" || rc=1
    slh_down "$SLH_DIR"
    local left; left=$(_slh_marked_pids | wc -l)
    echo "left over processes with our SLURM_CONF: $left; alice's sleep processes: $(pgrep -u alice -x sleep | wc -l)"
    [[ $left == 0 ]] || rc=1
    echo "pid files left: $(ls "$SLH_DIR/run"/*.pid 2>/dev/null | wc -l)"
    echo "TIMING up=${t_up}s first-3-jobs-ended-in-sacct=${t_job}s (from nothing)"
    return $rc
}

# ----------------------------------------------------------------- main
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    cmd=${1:-}; shift || true
    case $cmd in
        up) slh_up "$@" ;;
        down) slh_down "$@" ;;
        purge) slh_purge "$@" ;;
        status) slh_status "$@" ;;
        restart-ctld) slh_restart_ctld "$@" ;;
        selftest) slh_selftest "$@" ;;
        *) sed -n '2,/^$/p' "$0"; exit 2 ;;
    esac
fi
