#!/usr/bin/env bash
# A Slurm cluster on localhost for tests: munge, slurmctld and one slurmd per node; no systemd, no
# cgroups, no accounting (a small squeue-backed `sacct` stands in, since submitit polls sacct for job
# states). It declares two nodes, harness-n1 and harness-n2, both this machine (each slurmd on its own
# port), so that a job of two nodes is a real multi-node Slurm job: srun starts one task per node, with
# that node's SLURM_NODEID and the job's two-host SLURM_JOB_NODELIST.
# Needs root and Debian's packages (installed if missing). Facts behind each setting:
# ../shared/research/slurm-local.md.
#
#   bash scripts/slurm_local.sh start    # idempotent; waits until the node is idle
#   bash scripts/slurm_local.sh stop
#
# Knobs: SLURM_LOCAL_DIR (state, logs; default /var/lib/harness-slurm), SLURM_LOCAL_CPUS (CPUs
# advertised per node, above the real count so 8-rank jobs fit; default 16), SLURM_LOCAL_NODES (default 2).
set -euo pipefail

DIR=${SLURM_LOCAL_DIR:-/var/lib/harness-slurm}
CONF=/etc/slurm/slurm.conf
NODE=$(hostname -s 2>/dev/null || uname -n)
CPUS=${SLURM_LOCAL_CPUS:-16}
NODES=${SLURM_LOCAL_NODES:-2}
NAMES=$(seq -f "harness-n%g" 1 "$NODES" | paste -sd, -)
MARK="# managed by harness scripts/slurm_local.sh"
SHIM=/usr/local/bin/sacct

log() { echo "[slurm-local] $*" >&2; }

running() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
  [ "$(id -u)" = 0 ] || { log "must run as root"; exit 1; }
  if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    log "installing slurmctld slurmd slurm-client munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
  fi
  if [ ! -s /etc/munge/munge.key ]; then
    install -d -m 0700 -o munge -g munge /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
  install -d -m 0755 -o munge -g munge /run/munge /var/lib/munge
  install -d -m 0700 -o munge -g munge /var/log/munge
  mkdir -p "$DIR"/{ctld,d,log,run}
  if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    rm -f /run/munge/munged.pid /run/munge/munge.socket.2*
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  fi
  # torch.distributed's MASTER_ADDR under Slurm is the node's name: it must resolve.
  getent hosts "$NODE" >/dev/null || echo "127.0.0.1 $NODE $MARK" >> /etc/hosts
  for name in ${NAMES//,/ }; do  # the job's first node is MASTER_ADDR of a multi-node point
    getent hosts "$name" >/dev/null || echo "127.0.0.1 $name $MARK" >> /etc/hosts
  done
  mkdir -p "$(dirname "$CONF")"
  cat > "$CONF" <<CONF
$MARK
ClusterName=harness
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/d/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ReturnToService=2
SlurmdParameters=config_overrides
EnforcePartLimits=ALL
KillWait=5
MinJobAge=3600
InactiveLimit=0
$(for i in $(seq 1 "$NODES"); do
  # Several slurmd on one host: each its own port; NodeHostname is the real host, so slurmd -N finds it.
  echo "NodeName=harness-n$i NodeHostname=$NODE NodeAddr=127.0.0.1 Port=$((17000 + i)) CPUs=$CPUS RealMemory=$(awk '/^MemTotal:/ {print int($2/1024)}' /proc/meminfo) State=UNKNOWN"
done)
PartitionName=debug Nodes=$NAMES Default=YES MaxTime=INFINITE OverSubscribe=NO State=UP
CONF
  if [ ! -e "$SHIM" ] || grep -qF "$MARK" "$SHIM"; then
    cat > "$SHIM" <<'SHIM'
#!/bin/bash
# managed by harness scripts/slurm_local.sh
# sacct for a cluster without accounting: the subset submitit asks for
# (sacct -o JobID,State,NodeList --parsable2 -j ID ...), answered by squeue from slurmctld's memory.
fields="JobID,State"; jobs=()
while [ $# -gt 0 ]; do
  case "$1" in
    -o|--format) fields="$2"; shift ;;
    --format=*) fields="${1#*=}" ;;
    -j|--jobs) jobs+=("$2"); shift ;;
    --jobs=*) jobs+=("${1#*=}") ;;
  esac
  shift
done
IFS=, read -ra F <<<"$fields"; fmt=""; hdr=""
for f in "${F[@]}"; do
  case "${f,,}" in jobid|jobidraw) c="%i" ;; state) c="%T" ;; nodelist) c="%N" ;; *) c="%i" ;; esac
  fmt+="${fmt:+|}$c"; hdr+="${hdr:+|}$f"
done
echo "$hdr"
[ ${#jobs[@]} -eq 0 ] && exit 0
squeue -h -r --states=all -j "$(IFS=,; echo "${jobs[*]}")" -o "$fmt" 2>/dev/null
exit 0
SHIM
    chmod 0755 "$SHIM"
  fi
  running "$DIR/run/slurmctld.pid" || slurmctld -f "$CONF"
  for name in ${NAMES//,/ }; do
    mkdir -p "$DIR/d/$name"
    running "$DIR/run/slurmd-$name.pid" || slurmd -f "$CONF" -N "$name"
  done
  for _ in $(seq 600); do
    [ "$(sinfo -h -N -o %t 2>/dev/null | grep -cx idle)" = "$NODES" ] && {
      log "up: $(sinfo -h -o '%P %t %D %N')"
      return 0
    }
    sleep 0.1
  done
  log "the node did not become idle; logs in $DIR/log"; exit 1
}

stop() {
  for pid in "$DIR"/run/slurmd-*.pid "$DIR/run/slurmctld.pid"; do
    running "$pid" && kill "$(cat "$pid")" || true
  done
  for _ in $(seq 100); do
    up=0
    for pid in "$DIR"/run/slurmd-*.pid "$DIR/run/slurmctld.pid"; do running "$pid" && up=1; done
    [ "$up" = 0 ] && break
    sleep 0.1
  done
  log "stopped"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
