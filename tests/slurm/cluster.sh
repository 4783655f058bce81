#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, for tests/test_slurm.py and CI (Debian/Ubuntu, run as root).
#
#   sudo bash tests/slurm/cluster.sh install   # apt-get slurm-wlm + munge (skipped when present)
#   sudo bash tests/slurm/cluster.sh start     # munged, slurm.conf, slurmctld, slurmd; waits for the node
#   sudo bash tests/slurm/cluster.sh status    # exit 0 when the node takes jobs
#   sudo bash tests/slurm/cluster.sh stop
#   DIFFRELAY_SLURM_TEST=1 make test
#
# Every command can be repeated. State, spool and logs live under $DIFFRELAY_SLURM_DIR.
set -euo pipefail

ROOT=${DIFFRELAY_SLURM_DIR:-/var/lib/diffrelay-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# written by diffrelay tests/slurm/cluster.sh"
WAIT_S=${DIFFRELAY_SLURM_WAIT_S:-60}
MEM_MARGIN_MB=1024   # left for the OS, so slurmd never finds less memory than the config promises
NODE=$(hostname)

say() { echo "cluster.sh: $*" >&2; }
die() { say "error: $*"; exit 1; }
need_root() { [ "$(id -u)" = 0 ] || die "run as root (sudo bash $0 $1)"; }

installed() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && command -v munged >/dev/null
}

cmd_install() {
  if installed; then
    say "slurm and munge already installed ($(slurmd -V))"
    return
  fi
  need_root install
  command -v apt-get >/dev/null || die "no apt-get; install slurm-wlm and munge with this system's package manager"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q
  apt-get install -y -q slurm-wlm munge
  installed || die "apt-get finished but slurmctld/slurmd/sbatch/munged are still missing from PATH"
}

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
  if munge_ok; then return; fi
  # munged refuses to run unless its folders belong to the munge user; /run/munge is missing on a fresh boot.
  mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
  if [ ! -s /etc/munge/munge.key ]; then
    if command -v mungekey >/dev/null; then mungekey --create --keyfile /etc/munge/munge.key
    else dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none; fi
    chmod 400 /etc/munge/munge.key
  fi
  chown -R munge:munge /run/munge /var/log/munge /var/lib/munge /etc/munge
  runuser -u munge -- munged
  touch "$ROOT/munged.ours"
  for _ in $(seq 1 20); do munge_ok && return; sleep 0.5; done
  die "munged started but 'munge -n | unmunge' fails; see /var/log/munge/munged.log"
}

write_conf() {
  local cpus mem tmp
  cpus=$(nproc)
  mem=$(free -m | awk '/^Mem:/ {print $2}')
  mem=$(( mem > 2 * MEM_MARGIN_MB ? mem - MEM_MARGIN_MB : mem / 2 ))
  if [ -e "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    die "$CONF exists and was not written by this script; refusing to replace a real cluster's config"
  fi
  mkdir -p /etc/slurm "$ROOT/state" "$ROOT/spool" "$ROOT/log"
  tmp=$(mktemp "$CONF.XXXXXX")
  cat >"$tmp" <<EOF
$MARK
ClusterName=diffrelay
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# No cgroups in containers: track processes by parent id and bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
StateSaveLocation=$ROOT/state
SlurmdSpoolDir=$ROOT/spool
SlurmctldPidFile=$ROOT/slurmctld.pid
SlurmdPidFile=$ROOT/slurmd.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
# No accounting database, so finished jobs are only visible to squeue; keep them an hour.
MinJobAge=3600
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
  chmod 644 "$tmp"
  CONF_CHANGED=0
  if [ -e "$CONF" ] && cmp -s "$tmp" "$CONF"; then rm -f "$tmp"; return; fi
  mv "$tmp" "$CONF"
  CONF_CHANGED=1
  say "wrote $CONF (node $NODE, $cpus CPUs, ${mem} MB)"
}

alive() {  # alive slurmctld|slurmd: its pid file names a live process
  local pid
  pid=$(cat "$ROOT/$1.pid" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

node_state() { sinfo -h -n "$NODE" -o %t 2>/dev/null | head -n 1 || true; }

show_logs() {
  say "slurm logs (last 30 lines each):"
  for f in "$ROOT"/log/slurmctld.log "$ROOT"/log/slurmd.log; do
    echo "==> $f" >&2
    tail -n 30 "$f" >&2 2>/dev/null || echo "(missing)" >&2
  done
}

cmd_start() {
  need_root start
  installed || die "slurm is not installed; run: sudo bash $0 install"
  mkdir -p "$ROOT"
  start_munge
  write_conf
  if [ "$CONF_CHANGED" = 1 ] && { alive slurmctld || alive slurmd; }; then
    say "config changed; restarting the daemons"
    cmd_stop_slurm
  fi
  alive slurmctld || slurmctld
  # slurmd registers with slurmctld; give the controller a moment to listen.
  for _ in $(seq 1 20); do scontrol ping >/dev/null 2>&1 && break; sleep 0.5; done
  alive slurmd || slurmd

  local state="" t0=$SECONDS
  while (( SECONDS - t0 < WAIT_S )); do
    state=$(node_state)
    case "$state" in
      idle|mix|alloc|comp) say "node $NODE is $state; sbatch works"; return 0 ;;
      down*|drain*|drng*|fail*) scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 1
  done
  show_logs
  die "node $NODE not ready after ${WAIT_S}s (sinfo state: '${state:-none}'); see the logs above"
}

cmd_stop_slurm() {
  local d pid
  for d in slurmd slurmctld; do
    if alive "$d"; then
      pid=$(cat "$ROOT/$d.pid")
      kill "$pid"
      for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
      kill -0 "$pid" 2>/dev/null && die "$d (pid $pid) did not stop"
      say "stopped $d"
    fi
  done
}

cmd_stop() {
  need_root stop
  cmd_stop_slurm
  # Stop munged only when this script started it; another service may rely on it otherwise.
  if [ -e "$ROOT/munged.ours" ] && [ -s /run/munge/munged.pid ]; then
    kill "$(cat /run/munge/munged.pid)" 2>/dev/null && say "stopped munged"
    rm -f "$ROOT/munged.ours"
  fi
}

cmd_status() {
  local ok=0
  munge_ok && echo "munge: ok" || { echo "munge: not running"; ok=1; }
  for d in slurmctld slurmd; do
    alive "$d" && echo "$d: running (pid $(cat "$ROOT/$d.pid"))" || { echo "$d: not running"; ok=1; }
  done
  local state
  state=$(node_state)
  echo "node $NODE: ${state:-unknown}"
  case "$state" in idle|mix|alloc|comp) ;; *) ok=1 ;; esac
  return $ok
}

case "${1:-}" in
  install) cmd_install ;;
  start) cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  *) echo "usage: $0 install|start|stop|status" >&2; exit 2 ;;
esac
