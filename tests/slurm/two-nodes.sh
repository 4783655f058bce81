#!/usr/bin/env bash
# A real two-node SLURM cluster on this machine, for tests/test_slurm.py's multi-node tests and CI
# (Linux, run as root; slurm-wlm and munge installed: sudo bash tests/slurm/cluster.sh install).
#
#   sudo bash tests/slurm/two-nodes.sh start          # namespaces, bridge, slurmctld (n0), slurmd n1 and n2
#   sudo bash tests/slurm/two-nodes.sh status         # exit 0 when both nodes take jobs
#   sudo bash tests/slurm/two-nodes.sh exec CMD ...   # run a client (sbatch, squeue, snakemake) against it
#   sudo bash tests/slurm/two-nodes.sh stop           # stop the daemons, delete the namespaces
#   DIFFRELAY_SLURM_TWO_NODES=1 make test
#
# Each node is a network namespace with its own address and hostname, so `sbatch -N 2` runs one task
# per "node" and torchrun meets at a node by name, as on a real cluster. The addresses 10.200.0.10-12
# exist only inside the namespaces this script creates, joined by a bridge in the controller's
# namespace; nothing is routed anywhere else. The machine's /etc/slurm is not read or changed: every
# daemon gets its own mount view with this cluster's slurm.conf and hosts file bound over /etc.
# munged is shared with the one-node cluster (cluster.sh starts it).
set -euo pipefail

ROOT=${DIFFRELAY_SLURM2_DIR:-/var/lib/diffrelay-slurm2}
PREFIX=drslurm                       # namespace names: drslurm-n0 (controller), drslurm-n1, drslurm-n2
NODES=(n1 n2)
NET=10.200.0
WAIT_S=${DIFFRELAY_SLURM_WAIT_S:-60}
MEM_MARGIN_MB=1024
HERE=$(cd "$(dirname "$0")" && pwd)

say() { echo "two-nodes.sh: $*" >&2; }
die() { say "error: $*"; exit 1; }
need_root() { [ "$(id -u)" = 0 ] || die "run as root (sudo bash $0 $1)"; }
ns() { echo "$PREFIX-$1"; }
addr() { case "$1" in n0) echo "$NET.10" ;; n1) echo "$NET.11" ;; n2) echo "$NET.12" ;; esac; }

write_files() {
  local cpus mem
  cpus=$(nproc)
  mem=$(free -m | awk '/^Mem:/ {print $2}')
  mem=$(( mem > 2 * MEM_MARGIN_MB ? mem - MEM_MARGIN_MB : mem / 2 ))
  mkdir -p "$ROOT/etc" "$ROOT/state" "$ROOT/spool" "$ROOT/log" "$ROOT/run"
  cat >"$ROOT/etc/slurm.conf" <<EOF
# written by diffrelay tests/slurm/two-nodes.sh
ClusterName=diffrelay2
SlurmctldHost=n0($(addr n0))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
StateSaveLocation=$ROOT/state
# %n: each slurmd keeps its own spool, pid and log file.
SlurmdSpoolDir=$ROOT/spool/%n
SlurmctldPidFile=$ROOT/run/slurmctld.pid
SlurmdPidFile=$ROOT/run/slurmd-%n.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd-%n.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
MinJobAge=3600
NodeName=n1 NodeHostname=n1 NodeAddr=$(addr n1) CPUs=$cpus RealMemory=$mem State=UNKNOWN
NodeName=n2 NodeHostname=n2 NodeAddr=$(addr n2) CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF
  { echo "127.0.0.1 localhost"; for n in n0 "${NODES[@]}"; do echo "$(addr "$n") $n"; done; } >"$ROOT/etc/hosts"
  chmod 644 "$ROOT/etc/slurm.conf" "$ROOT/etc/hosts"
}

make_net() {
  local n
  for n in n0 "${NODES[@]}"; do
    [ -e "/run/netns/$(ns "$n")" ] || ip netns add "$(ns "$n")"
    ip -n "$(ns "$n")" link set lo up
  done
  local c; c=$(ns n0)
  if ! ip -n "$c" link show br0 >/dev/null 2>&1; then
    ip -n "$c" link add br0 type bridge
    ip -n "$c" addr add "$(addr n0)/24" dev br0
    ip -n "$c" link set br0 up
  fi
  local i=1
  for n in "${NODES[@]}"; do
    if ! ip -n "$c" link show "v$n" >/dev/null 2>&1; then
      ip -n "$c" link add "v$n" type veth peer name eth0 netns "$(ns "$n")"
      ip -n "$c" link set "v$n" master br0 up
      ip -n "$(ns "$n")" addr add "$(addr "$n")/24" dev eth0
      ip -n "$(ns "$n")" link set eth0 up
    fi
    i=$((i + 1))
  done
}

# Run a daemon in node $1's namespace with its own hostname and this cluster's /etc/slurm and /etc/hosts.
# Not `ip netns exec`: it remounts /sys, and slurmd then finds no cgroup file system.
in_node() {
  local n=$1; shift
  nsenter --net="/run/netns/$(ns "$n")" unshare --mount --uts --propagation private sh -c \
    "mount --bind '$ROOT/etc/hosts' /etc/hosts && mkdir -p /etc/slurm && mount --bind '$ROOT/etc' /etc/slurm \
     && hostname $n && exec \"\$@\"" sh "$@"
}

alive() {  # alive PIDFILE
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

client() { SLURM_CONF="$ROOT/etc/slurm.conf" ip netns exec "$(ns n0)" "$@"; }

up_nodes() { client sinfo -h -o '%n %t' 2>/dev/null | awk '$2 ~ /^(idle|mix|alloc|comp)/' | wc -l; }

cmd_start() {
  need_root start
  command -v slurmd >/dev/null || die "slurm is not installed; run: sudo bash $HERE/cluster.sh install"
  munge -n 2>/dev/null | unmunge >/dev/null 2>&1 \
    || die "munged is not running; start it with: sudo bash $HERE/cluster.sh start"
  mkdir -p "$ROOT"
  write_files
  make_net
  alive "$ROOT/run/slurmctld.pid" || in_node n0 slurmctld
  for _ in $(seq 1 20); do client scontrol ping >/dev/null 2>&1 && break; sleep 0.5; done
  local n
  for n in "${NODES[@]}"; do
    alive "$ROOT/run/slurmd-$n.pid" || in_node "$n" slurmd -N "$n"
  done
  local t0=$SECONDS
  while (( SECONDS - t0 < WAIT_S )); do
    [ "$(up_nodes)" = "${#NODES[@]}" ] && { say "nodes ${NODES[*]} take jobs"; return 0; }
    for n in "${NODES[@]}"; do
      case "$(client sinfo -h -n "$n" -o %t 2>/dev/null)" in
        down*|drain*|fail*) client scontrol update nodename="$n" state=resume >/dev/null 2>&1 || true ;;
      esac
    done
    sleep 1
  done
  for f in "$ROOT"/log/*.log; do echo "==> $f" >&2; tail -n 20 "$f" >&2; done
  die "nodes not ready after ${WAIT_S}s: $(client sinfo -h -o '%n %t' 2>&1 | tr '\n' ' ')"
}

cmd_stop() {
  need_root stop
  local f pid
  for f in "$ROOT"/run/slurmd-*.pid "$ROOT/run/slurmctld.pid"; do
    alive "$f" || continue
    pid=$(cat "$f")
    kill "$pid"
    for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    say "stopped $(basename "$f" .pid)"
  done
  local n
  for n in "${NODES[@]}" n0; do
    [ -e "/run/netns/$(ns "$n")" ] && ip netns del "$(ns "$n")" && say "deleted namespace $(ns "$n")"
  done
  return 0
}

cmd_status() {
  local ok=0 n
  alive "$ROOT/run/slurmctld.pid" && echo "slurmctld (n0): running" || { echo "slurmctld (n0): not running"; ok=1; }
  for n in "${NODES[@]}"; do
    alive "$ROOT/run/slurmd-$n.pid" && echo "slurmd ($n): running" || { echo "slurmd ($n): not running"; ok=1; }
  done
  client sinfo -h -o '%n %t' 2>/dev/null || ok=1
  [ "$(up_nodes 2>/dev/null)" = "${#NODES[@]}" ] || ok=1
  return $ok
}

case "${1:-}" in
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  exec) shift; client "$@" ;;
  *) echo "usage: $0 start|stop|status|exec CMD..." >&2; exit 2 ;;
esac
