#!/usr/bin/env bash
# A single-node Slurm cluster on this machine, for the tests (tests/slurm) and for trying docs/cluster.md.
#
#   scripts/slurm/localhost-cluster.sh start  [DIR]   # install if missing (apt, as root), configure, start
#   scripts/slurm/localhost-cluster.sh stop   [DIR]   # stop the daemons started from DIR (state and logs stay)
#   scripts/slurm/localhost-cluster.sh status [DIR]   # exit 0 if the cluster answers, and show sinfo
#   scripts/slurm/localhost-cluster.sh env    [DIR]   # the line to eval so that sinfo, sbatch, srun find it
#
# DIR (default $CONVERGE_SLURM_DIR, else /tmp/converge-slurm) holds everything: slurm.conf, the munge
# key and socket, spool, state, pid and log files. Nothing is written under /etc, and the system's own
# munge and slurm services (if any) are left alone: the Slurm commands find this cluster through
# SLURM_CONF=DIR/slurm.conf, and slurm.conf points them at this cluster's munge socket.
#
# Debian's slurm-wlm 22.05, run as root, needs: ProctrackType=proctrack/linuxproc and TaskPlugin=task/none
# (no cgroups here; 22.05 has no CgroupPlugin=disabled, so there is no cgroup.conf), a munge key, and
# the node's real CPUs and memory (from `slurmd -C`). Jobs are not confined to their cores or memory.
# `start` and `stop` are idempotent; `start` clears jobs left from a previous start (slurmctld -c).
# Ports: SLURMCTLD_PORT (6817) and SLURMD_PORT (6818) in the environment change them.
# Exit status: 0 done; 1 failed; 2 usage; 3 Slurm is missing and cannot be installed here (tests skip).
set -euo pipefail

action=${1:-}
dir=${2:-${CONVERGE_SLURM_DIR:-/tmp/converge-slurm}}
ctld_port=${SLURMCTLD_PORT:-6817}
slurmd_port=${SLURMD_PORT:-6818}
node=$(hostname -s)
conf=$dir/slurm.conf
export SLURM_CONF=$conf

say() { echo "localhost-cluster: $*" >&2; }
die() { say "$*"; exit 1; }
cannot_install() { say "$*"; exit 3; }

alive() {  # alive PIDFILE: the process named in PIDFILE runs
    [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

install_if_missing() {
    local missing=()
    for cmd in munged slurmctld slurmd sinfo sbatch; do
        command -v "$cmd" >/dev/null || missing+=("$cmd")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    local want="slurm-wlm munge (missing: ${missing[*]})"
    [ "$(id -u)" = 0 ] || cannot_install "not root: cannot apt-get install $want"
    command -v apt-get >/dev/null || cannot_install "no apt-get to install $want"
    say "installing slurm-wlm and munge with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq slurm-wlm munge >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq slurm-wlm munge >/dev/null; } \
        || cannot_install "apt-get install $want failed"
}

node_line() {  # this node as slurm.conf names it: the CPUs, sockets, cores and memory slurmd finds
    local found
    found=$(slurmd -C | head -n 1) || die "slurmd -C could not describe this node"
    case $found in NodeName=*) ;; *) die "slurmd -C printed no node line: $found" ;; esac
    echo "NodeName=$node NodeAddr=127.0.0.1 ${found#NodeName=* } State=UNKNOWN"
}

write_config() {
    mkdir -p "$dir"/{munge,spool/ctld,spool/d,log,run}
    chmod 700 "$dir/munge"
    if [ ! -s "$dir/munge/munge.key" ]; then
        dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
        chmod 400 "$dir/munge/munge.key"
    fi
    local tmp=$conf.tmp.$$
    cat >"$tmp" <<EOF
# Written by scripts/slurm/localhost-cluster.sh: one node, this machine, everything under $dir.
ClusterName=converge
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/spool/ctld
SlurmdSpoolDir=$dir/spool/d
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
ReturnToService=2
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
MinJobAge=600
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
$(node_line)
PartitionName=converge Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$tmp" "$conf"
}

answers() {  # the controller answers and the node is up (idle, mixed or allocated)
    sinfo --noheader --nodes="$node" --format=%t 2>/dev/null | grep -Eq '^(idle|mix|alloc)'
}

start() {
    install_if_missing
    if alive "$dir/run/munged.pid" && alive "$dir/run/slurmctld.pid" && alive "$dir/run/slurmd.pid"; then
        say "already running from $dir"
    else
        write_config
        if ! alive "$dir/run/munged.pid"; then
            munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
                --pid-file="$dir/run/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed" \
                || die "munged did not start (see $dir/log/munged.log)"
        fi
        if ! alive "$dir/run/slurmctld.pid"; then
            slurmctld -c -f "$conf" || die "slurmctld did not start (see $dir/log/slurmctld.log)"
        fi
        if ! alive "$dir/run/slurmd.pid"; then
            slurmd -f "$conf" -N "$node" || die "slurmd did not start (see $dir/log/slurmd.log)"
        fi
    fi
    for _ in $(seq 1 60); do
        if answers; then
            say "up: partition converge, node $node ($(sinfo --version)); eval \"\$($0 env $dir)\" to use it"
            return 0
        fi
        sleep 0.5
    done
    die "the node did not come up within 30 s (see $dir/log/slurmctld.log and $dir/log/slurmd.log)"
}

stop() {
    local name pidfile pid stopped=0
    for name in slurmd slurmctld munged; do  # the reverse of start
        pidfile=$dir/run/$name.pid
        alive "$pidfile" || continue
        pid=$(cat "$pidfile")
        kill "$pid"
        for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
        if kill -0 "$pid" 2>/dev/null; then
            say "$name ($pid) ignored SIGTERM for 10 s; killing it"
            kill -9 "$pid" 2>/dev/null || true
        fi
        rm -f "$pidfile"
        stopped=1
    done
    if [ $stopped = 1 ]; then say "stopped (state and logs kept in $dir)"; else say "not running from $dir"; fi
}

status() {
    [ -f "$conf" ] || { say "not configured in $dir"; return 1; }
    # without a controller, sinfo retries for MessageTimeout (10 s) before it fails
    alive "$dir/run/slurmctld.pid" || { say "not running from $dir"; return 1; }
    answers || { say "not answering (SLURM_CONF=$conf)"; return 1; }
    sinfo
}

case $action in
    start) start ;;
    stop) stop ;;
    status) status ;;
    env) echo "export SLURM_CONF=$conf" ;;
    *) echo "usage: $0 start|stop|status|env [DIR]" >&2; exit 2 ;;
esac
