#!/usr/bin/env bash
# A Slurm cluster on localhost for tests: munge, slurmctld, one slurmd per node and real accounting
# (slurmdbd on a local MariaDB: submitit polls `sacct` for job states); no systemd, no cgroups. If the
# accounting daemons cannot start (or SLURM_LOCAL_ACCOUNTING=0), a small squeue-backed `sacct` stands
# in and the script says so. It declares two nodes, harness-n1 and harness-n2, both this machine (each
# slurmd on its own port), so that a job of two nodes is a real multi-node Slurm job: srun starts one
# task per node, with that node's SLURM_NODEID and the job's two-host SLURM_JOB_NODELIST.
# Needs root and Debian's packages (installed if missing). Facts behind each setting:
# ../shared/research/slurm-local.md.
#
#   bash scripts/slurm_local.sh start    # idempotent; waits until the node is idle
#   bash scripts/slurm_local.sh stop
#
# Knobs: SLURM_LOCAL_DIR (state, logs; default /var/lib/harness-slurm), SLURM_LOCAL_CPUS (CPUs
# advertised per node, above the real count so 8-rank jobs fit; default 16), SLURM_LOCAL_NODES
# (default 2), SLURM_LOCAL_ACCOUNTING (1: slurmdbd + MariaDB, the default; 0: the squeue-backed stand-in).
set -euo pipefail

DIR=${SLURM_LOCAL_DIR:-/var/lib/harness-slurm}
CONF=/etc/slurm/slurm.conf
NODE=$(hostname -s 2>/dev/null || uname -n)
CPUS=${SLURM_LOCAL_CPUS:-16}
NODES=${SLURM_LOCAL_NODES:-2}
NAMES=$(seq -f "harness-n%g" 1 "$NODES" | paste -sd, -)
MARK="# managed by harness scripts/slurm_local.sh"
SHIM=/usr/local/bin/sacct
ACCOUNTING=${SLURM_LOCAL_ACCOUNTING:-1}
DBD_CONF=/etc/slurm/slurmdbd.conf

log() { echo "[slurm-local] $*" >&2; }

running() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# slurm.conf, with the accounting storage lines given as $1.
write_conf() {
  local storage=$1
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
$storage
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
}

# MariaDB (its own socket and pid file under $DIR) and slurmdbd; returns non-zero if either fails.
start_accounting() {
  local sock="$DIR/mysql-run/mysqld.sock"
  install -d -o mysql -g mysql "$DIR/mysql-run"
  if ! mariadb --socket="$sock" -e "select 1" >/dev/null 2>&1; then
    [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >/dev/null 2>&1 || return 1
    mariadbd --user=mysql --datadir=/var/lib/mysql --socket="$sock" --pid-file="$DIR/mysql-run/mysqld.pid" \
      --bind-address=127.0.0.1 --log-error="$DIR/mysql-run/mariadb.log" >/dev/null 2>&1 &
    for _ in $(seq 100); do mariadb --socket="$sock" -e "select 1" >/dev/null 2>&1 && break; sleep 0.1; done
    mariadb --socket="$sock" -e "select 1" >/dev/null 2>&1 || { log "MariaDB did not start: $DIR/mysql-run/mariadb.log"; return 1; }
  fi
  if ! running "$DIR/run/slurmdbd.pid" && [ -z "$(ls -A "$DIR/ctld" 2>/dev/null)" ]; then
    # A fresh controller numbers jobs from 1 again: old accounting rows with the same ids would answer
    # submitit's sacct queries for the new jobs.
    mariadb --socket="$sock" -e "DROP DATABASE IF EXISTS slurm_acct_db" || return 1
  fi
  mariadb --socket="$sock" -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;" || return 1
  cat > "$DBD_CONF" <<DBD
$MARK
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=root
LogFile=$DIR/log/slurmdbd.log
PidFile=$DIR/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3306
StorageLoc=slurm_acct_db
StorageUser=slurm
StoragePass=slurm
DBD
  chmod 0600 "$DBD_CONF"
  running "$DIR/run/slurmdbd.pid" || slurmdbd || return 1
  for _ in $(seq 300); do  # slurmdbd creates its tables on the first start (~10 s)
    sacctmgr -n show cluster >/dev/null 2>&1 && break
    sleep 0.1
  done
  sacctmgr -n show cluster >/dev/null 2>&1 || { log "slurmdbd did not answer: $DIR/log/slurmdbd.log"; return 1; }
  sacctmgr -i add cluster harness >/dev/null 2>&1 || true  # slurmctld would register it too
}

start() {
  [ "$(id -u)" = 0 ] || { log "must run as root"; exit 1; }
  if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    log "installing slurmctld slurmd slurm-client munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
  fi
  if [ "$ACCOUNTING" = 1 ] && { ! command -v slurmdbd >/dev/null || ! command -v mariadbd >/dev/null; }; then
    log "installing slurmdbd mariadb-server (accounting: the real sacct)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurmdbd mariadb-server >/dev/null || ACCOUNTING=0
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
  # slurm.conf names the accounting storage, and sacctmgr reads it: written once for slurmdbd, and
  # again without accounting if slurmdbd cannot start.
  if [ "$ACCOUNTING" = 1 ]; then
    write_conf "AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1"
    start_accounting || ACCOUNTING=0
  fi
  if [ "$ACCOUNTING" != 1 ]; then
    log "no accounting daemon: a squeue-backed sacct stands in ($SHIM)"
    write_conf "AccountingStorageType=accounting_storage/none"
  fi
  if [ "$ACCOUNTING" = 1 ]; then
    if [ -e "$SHIM" ] && grep -qF "$MARK" "$SHIM"; then rm -f "$SHIM"; fi  # the real sacct answers
  elif [ ! -e "$SHIM" ] || grep -qF "$MARK" "$SHIM"; then
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
  case "${f,,}" in jobid) c="%i" ;; jobidraw) c="%A" ;; state) c="%T" ;; nodelist) c="%N" ;; *) c="%i" ;; esac
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
  # (slurmd.pid: the single slurmd of this script's earlier, one-node layout)
  pids=("$DIR"/run/slurmd-*.pid "$DIR/run/slurmd.pid" "$DIR/run/slurmctld.pid" "$DIR/run/slurmdbd.pid"
    "$DIR/mysql-run/mysqld.pid")
  for pid in "${pids[@]}"; do
    running "$pid" && kill "$(cat "$pid")" || true
  done
  for _ in $(seq 100); do
    up=0
    for pid in "${pids[@]}"; do running "$pid" && up=1; done
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
