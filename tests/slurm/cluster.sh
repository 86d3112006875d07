#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
#
# A real two-node Slurm cluster on this one machine, so that tests can `sbatch` the job scripts.
#
#   sudo tests/slurm/cluster.sh start     # install if missing, configure, start (no-op if already up)
#   sudo tests/slurm/cluster.sh stop      # stop exactly what start started, give back /etc/slurm's files
#   tests/slurm/cluster.sh status         # exit 0 iff the cluster is up; prints the mode first
#   sudo tests/slurm/cluster.sh install   # only install the Debian packages if missing
#
# The "nodes" node1 and node2 are two slurmd processes. Where network namespaces can be made (the
# default, SLURM_TEST_MODE=auto; =netns insists), each runs in its own network, UTS and mount namespace,
# as a real node: its own hostname, its own address $SLURM_TEST_SUBNET.1<i> (default 10.213.48) on a
# bridge that holds .1 for the controller (no route beyond it, no NAT: a job cannot reach the machine's
# 127.0.0.1), and its own node-local folder, $SLURM_TEST_DIR/scratch, backed by
# $SLURM_TEST_DIR/nodes/<node> (as node-local disk on a cluster; everything else is shared).
# SLURM_TEST_MODE=loopback: both on 127.0.0.1 with their own ports, sharing the machine's hostname.
# Each node has $SLURM_TEST_CPUS CPUs (default 8, more than the machine may have) and two fake GPUs:
# gres backed by dummy character devices, so jobs see CUDA_VISIBLE_DEVICES=0,1 while torch.cuda is unavailable.
# The config goes to /etc/slurm, so plain `sbatch` works: start moves a slurm.conf, gres.conf or cgroup.conf
# that is not ours aside, to <file>.before-slurm-test, and stop moves it back (or deletes ours where there
# was none). Logs, PID files and Slurm state go to $SLURM_TEST_DIR (default /tmp/slurm-test); the state is
# wiped on every start (job ids restart at 1).
set -euo pipefail

DIR=${SLURM_TEST_DIR:-/tmp/slurm-test}
CPUS=${SLURM_TEST_CPUS:-8}
MEM_MB=${SLURM_TEST_MEM_MB:-$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)}
NODES=(node1 node2)
MODE=${SLURM_TEST_MODE:-auto}
SUBNET=${SLURM_TEST_SUBNET:-10.213.48}
BRIDGE=slurmtest0
CTLD_PORT=6817  # the slurmd of node i listens on CTLD_PORT + i
ETC=/etc/slurm
CONFS=(slurm.conf gres.conf cgroup.conf)  # what start writes to $ETC
SAVED=before-slurm-test  # $ETC/<conf>.$SAVED: the file that was there before start
TAG="# slurm-test"  # marks the files and the /etc/hosts lines that we write
# Every process of the cluster carries this in its environment: the daemons get it from us,
# slurmstepd from slurmd, job tasks from the TaskProlog. `stop` uses it to find leftovers by PID.
MARK="TEST_SLURM_CLUSTER=$DIR"

log() { echo "cluster.sh: $*" >&2; }
die() {
  log "error: $*"
  tail -n 15 "$DIR"/log/*.log "$DIR"/log/daemons.out 2>/dev/null >&2 || true
  exit 1
}

have_slurm() {
  local b
  for b in munged slurmctld slurmd sbatch scontrol; do command -v "$b" >/dev/null || return 1; done
}

install() {
  if have_slurm; then return 0; fi
  command -v apt-get >/dev/null || die "Slurm is not installed and there is no apt-get"
  log "installing munge and Slurm with apt-get"
  # Keep the packages' postinst from starting daemons: we start them ourselves, with our config.
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
    chmod +x /usr/sbin/policy-rc.d
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq -o DPkg::Lock::Timeout=120 --no-install-recommends \
    munge slurmctld slurmd slurm-client >/dev/null
}

# The PID in a PID file, if that process is alive and still the expected program.
live_pid() {  # pidfile comm
  local pid
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] || return 1
  echo "$pid"
}

running() {  # pid...: true if any of them is alive and not a zombie
  { ps -o stat= -p "$(IFS=,; echo "$*")" || true; } | grep -qv '^Z'
}

terminate() {  # pid...: SIGTERM, up to 10 s to exit, then SIGKILL
  [ $# -gt 0 ] || return 0
  kill -TERM "$@" 2>/dev/null || true
  for _ in $(seq 100); do
    if ! running "$@"; then return 0; fi
    sleep 0.1
  done
  kill -KILL "$@" 2>/dev/null || true
}

# The processes carrying $MARK, plus all their descendants (one may have cleared its environment).
cluster_pids() {
  local marked
  marked=$(grep -lzx -- "$MARK" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 | tr '\n' ' ' || true)
  if [ -z "$marked" ]; then return 0; fi
  ps -e -o pid= -o ppid= | awk -v roots="$marked" '
    BEGIN { n = split(roots, r, " "); for (i = 1; i <= n; i++) keep[r[i]] = 1 }
    { parent[$1] = $2 }
    END {
      do {
        more = 0
        for (p in parent) if (!(p in keep) && (parent[p] in keep)) { keep[p] = 1; more = 1 }
      } while (more)
      for (p in keep) if (p in parent) print p
    }'
}

hosts_remove() {
  # Rewrite in place rather than replace the file: /etc/hosts may be a bind mount.
  if grep -q -- "$TAG" /etc/hosts; then
    local kept
    kept=$(grep -v -- "$TAG" /etc/hosts || true)
    printf '%s\n' "$kept" >/etc/hosts
  fi
}

recorded() { awk -v kind="$1" '$1 == kind {print $2}' "$DIR/run/net"; }  # what net_up made: ns, link

# The network namespaces, veths and bridge that net_up made, as recorded in $DIR/run/net.
net_down() {
  local ns link
  [ -f "$DIR/run/net" ] || return 0
  for ns in $(recorded ns); do
    # shellcheck disable=SC2046  # one PID per word
    terminate $(ip netns pids "$ns" 2>/dev/null)  # anything left running inside
  done
  # veths first: deleting a namespace removes its end only asynchronously
  for link in $(recorded link | tac); do ip link del "$link" 2>/dev/null || true; done
  for ns in $(recorded ns); do ip netns del "$ns" 2>/dev/null || true; done
  rm -f "$DIR/run/net"
}

# A bridge holding $SUBNET.1, and per node a namespace slurmtest-<node> whose eth0 is $SUBNET.1<i> on it.
net_up() {
  local i ns
  command -v ip >/dev/null && command -v nsenter >/dev/null && command -v unshare >/dev/null || return 1
  if ip -4 -o addr show | grep -q " inet $SUBNET\."; then log "$SUBNET.0/24 is in use on this machine"; return 1; fi
  ip link add "$BRIDGE" type bridge || return 1
  echo "link $BRIDGE" >>"$DIR/run/net"
  ip addr add "$SUBNET.1/24" dev "$BRIDGE" && ip link set "$BRIDGE" up || return 1
  for i in "${!NODES[@]}"; do
    ns=slurmtest-${NODES[i]}
    ip netns add "$ns" || return 1
    echo "ns $ns" >>"$DIR/run/net"
    ip link add "slurmtest$((i + 1))" type veth peer name eth0 netns "$ns" || return 1
    echo "link slurmtest$((i + 1))" >>"$DIR/run/net"
    ip link set "slurmtest$((i + 1))" master "$BRIDGE" up &&
      ip -n "$ns" addr add "$SUBNET.$((i + 11))/24" dev eth0 &&
      ip -n "$ns" link set eth0 up && ip -n "$ns" link set lo up || return 1
  done
}

up() {  # our daemons are alive and every node can run jobs
  local node states
  live_pid "$DIR/run/slurmctld.pid" slurmctld >/dev/null || return 1
  for node in "${NODES[@]}"; do live_pid "$DIR/run/slurmd-$node.pid" slurmd >/dev/null || return 1; done
  states=$(timeout 5 sinfo -h -N -o %t 2>/dev/null) || return 1
  [ "$(grep -cE '^(idle|mix|alloc|comp)$' <<<"$states")" = "${#NODES[@]}" ]
}

halt() {  # [keep-munged]: our processes and /etc/hosts line
  local pids=() f pid
  if live_pid "$DIR/run/slurmctld.pid" slurmctld >/dev/null; then
    # Cancel the jobs first: with proctrack/linuxproc their processes would outlive slurmd.
    scancel --partition=debug 2>/dev/null || true
    for _ in $(seq 75); do
      if [ -z "$(squeue -h -o %A 2>/dev/null)" ]; then break; fi
      sleep 0.2
    done
  fi
  for f in "$DIR"/run/slurmd-*.pid; do
    if pid=$(live_pid "$f" slurmd); then pids+=("$pid"); fi
  done
  if pid=$(live_pid "$DIR/run/slurmctld.pid" slurmctld); then pids+=("$pid"); fi
  terminate "${pids[@]}"
  # shellcheck disable=SC2046  # one PID per word
  terminate $(cluster_pids)  # slurmstepd and job processes left over
  if [ "${1:-}" != keep-munged ]; then
    if pid=$(live_pid "$DIR/run/munged.pid" munged); then terminate "$pid"; fi
    rm -f "$DIR/run/munged.pid"
  fi
  rm -f "$DIR"/run/slurm*.pid
  net_down
  hosts_remove
}

ours() { [ -f "$1" ] && grep -q -- "^$TAG" "$1"; }  # a file that start wrote
exists() { [ -e "$1" ] || [ -L "$1" ]; }  # a dangling symlink too

conf_write() {  # name text: into $ETC, the file that was there (a symlink stays one) moved aside, once
  local f=$ETC/$1
  if exists "$f" && ! ours "$f"; then
    if exists "$f.$SAVED"; then die "$f is not ours and $f.$SAVED exists: move one of them away"; fi
    mv "$f" "$f.$SAVED"
  fi
  printf '%s\n' "$2" >"$f"
}

conf_restore() {  # what conf_write moved aside goes back; where it found nothing, ours goes
  local name f
  for name in "${CONFS[@]}"; do
    f=$ETC/$name
    if exists "$f" && ! ours "$f"; then
      if exists "$f.$SAVED"; then log "left $f (not ours) and $f.$SAVED as they are"; fi
    elif exists "$f.$SAVED"; then
      mv -f "$f.$SAVED" "$f"
    else
      rm -f "$f"
    fi
  done
}

stop() {  # the command: everything start started, and /etc/slurm as it was
  halt
  conf_restore
}

slurm_conf() {  # mode: netns or loopback
  local host i addr=127.0.0.1
  host=$(hostname -s)
  if [ "$1" = netns ]; then addr=$SUBNET.1; fi
  cat <<EOF
$TAG: written by tests/slurm/cluster.sh on every start ($1 mode)
ClusterName=slurmtest
SlurmctldHost=$host($addr)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job is held back for the credential lifetime + 1 s (default 120 s; below 5 is refused): 10 s
# still covers a step's launch on this machine under load, and each requeue test waits 11 s, not 31.
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# Marks job processes so that stop can find leftovers.
TaskProlog=$DIR/task-prolog.sh
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SchedulerType=sched/backfill
# batch_sched_delay=0: else a job submitted < 3 s after the previous one may wait up to 3 s.
# sched_interval=1: a job whose begin time has come (a requeued one) starts within 1 s, not 60 s.
SchedulerParameters=batch_sched_delay=0,sched_interval=1
# Trust CPUs= below even where the machine has fewer cores.
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MailProg=/bin/true
JobRequeue=1
ReturnToService=2
# There is no accounting (sacct): a finished job stays visible to scontrol for this long.
MinJobAge=120
# A cancelled job gets this long between SIGTERM and SIGKILL (default 30 s): keeps stop quick.
KillWait=5
InactiveLimit=0
Waittime=0
SlurmctldTimeout=30
SlurmdTimeout=30
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
EOF
  for i in "${!NODES[@]}"; do
    if [ "$1" = netns ]; then addr="$SUBNET.$((i + 11)) NodeHostname=${NODES[i]}"; else addr="127.0.0.1 NodeHostname=$host"; fi
    echo "NodeName=${NODES[i]} NodeAddr=$addr Port=$((CTLD_PORT + i + 1)) CPUs=$CPUS RealMemory=$MEM_MB Gres=gpu:2 State=UNKNOWN"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
}

gres_conf() {
  # Slurm drops a GPU without File=, and wants a character device there (1,3 is /dev/null's).
  printf '%s\n' "$TAG" AutoDetect=off "NodeName=node[1-2] Name=gpu File=$DIR/dev/gpu[0-1]"
}

start_munged() {
  local pid
  if live_pid "$DIR/run/munged.pid" munged >/dev/null; then return 0; fi  # ours, from before
  rm -f "$DIR/run/munged.pid"
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi  # someone else's: use it
  if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
  fi
  # /run/munge normally comes from systemd's RuntimeDirectory=
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  rm -f /run/munge/munged.pid
  runuser -u munge -- munged 9>&- </dev/null >>"$DIR/log/daemons.out" 2>&1
  for _ in $(seq 50); do
    if pid=$(live_pid /run/munge/munged.pid munged); then break; fi
    sleep 0.1
  done
  [ -n "${pid:-}" ] || die "munged did not start"
  echo "$pid" >"$DIR/run/munged.pid"  # remembers that we started it
}

daemon() {  # command...: start a Slurm daemon, marked, without our lock fd or output pipes
  env "$MARK" "$@" 9>&- </dev/null >>"$DIR/log/daemons.out" 2>&1 || die "$1 failed to start"
}

start() {
  local conf gres f node port cycles mode=$MODE i
  install
  case $MODE in auto | netns | loopback) ;; *) die "SLURM_TEST_MODE=$MODE: use auto, netns or loopback" ;; esac
  if [ "$MODE" = auto ]; then mode=$(cat "$DIR/run/mode" 2>/dev/null || echo netns); fi  # what runs, if it runs
  conf=$(slurm_conf "$mode")
  gres=$(gres_conf)
  if up && [ "$conf" = "$(cat $ETC/slurm.conf)" ] && [ "$gres" = "$(cat $ETC/gres.conf)" ]; then
    return 0
  fi
  halt keep-munged  # anything partial, stale or differently configured of ours
  mkdir -p "$DIR"/{run,log,dev}
  mode=loopback
  if [ "$MODE" != loopback ]; then
    if net_up; then mode=netns; else
      net_down
      if [ "$MODE" = netns ]; then die "could not make the network namespaces (SLURM_TEST_MODE=netns)"; fi
      log "no network namespaces here: both nodes on 127.0.0.1 (loopback mode)"
    fi
  fi
  echo "$mode" >"$DIR/run/mode"
  conf=$(slurm_conf "$mode")
  rm -rf "$DIR/state" "$DIR/spool"  # old state can keep a node drained
  mkdir -p "$DIR/state"
  for node in "${NODES[@]}"; do mkdir -p "$DIR/spool/$node"; done
  for f in "$DIR"/log/*.log "$DIR"/log/*.out; do if [ -f "$f" ]; then mv -f "$f" "$f.prev"; fi; done
  for f in "$DIR"/dev/gpu{0,1}; do if [ ! -c "$f" ]; then rm -f "$f"; mknod "$f" c 1 3; fi; done
  printf '#!/bin/sh\necho export %s\n' "$MARK" >"$DIR/task-prolog.sh"
  chmod 0755 "$DIR/task-prolog.sh"

  mkdir -p $ETC
  conf_write slurm.conf "$conf"
  conf_write gres.conf "$gres"
  # Only matters on cgroup v2 hosts, where there may be no systemd to ask.
  conf_write cgroup.conf "$(printf '%s\n' "$TAG" CgroupPlugin=autodetect IgnoreSystemd=yes)"
  # so that MASTER_ADDR=node1 resolves, to the node's own address where it has one
  if [ "$mode" = netns ]; then
    for i in "${!NODES[@]}"; do echo "$SUBNET.$((i + 11)) ${NODES[i]} $TAG" >>/etc/hosts; done
  else
    echo "127.0.0.1 ${NODES[*]} $TAG" >>/etc/hosts
  fi

  start_munged
  for port in $(seq "$CTLD_PORT" $((CTLD_PORT + ${#NODES[@]}))); do
    if (: <"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then die "port $port is already in use"; fi
  done
  daemon slurmctld
  for _ in $(seq 100); do
    if scontrol ping >/dev/null 2>&1; then break; fi
    sleep 0.1
  done
  for node in "${NODES[@]}"; do
    if [ "$mode" = loopback ]; then daemon slurmd -N "$node"; continue; fi
    mkdir -p "$DIR/scratch" "$DIR/nodes/$node"
    # nsenter, not `ip netns exec`: that remounts /sys, hiding /sys/fs/cgroup from slurmd
    daemon nsenter --net="/run/netns/slurmtest-$node" unshare --uts --mount \
      sh -c "hostname $node && mount --bind $DIR/nodes/$node $DIR/scratch && exec slurmd -N $node"
  done
  for _ in $(seq 300); do
    if up; then break; fi
    sleep 0.1
  done
  up || die "the nodes did not become idle within 30 s: $(sinfo -N -o '%N %t %E' 2>&1 || true)"
  # slurmctld's first scheduling pass comes about 3 s after its start; before it, a job just waits.
  for _ in $(seq 100); do
    cycles=$(sdiag | awk '/^Main schedule/ {m = 1} m && /Total cycles:/ {print $3; exit}') || true
    if [ "${cycles:-0}" -gt 0 ]; then return 0; fi
    sleep 0.1
  done
  die "slurmctld did not schedule within 10 s"
}

case ${1:-} in
  status)
    if up; then echo "mode $(cat "$DIR/run/mode")"; sinfo -N -o '%N %t %c %m %G'; else echo "not running"; exit 1; fi
    exit 0 ;;
  start | stop | install) ;;
  *) echo "usage: $0 start|stop|status|install" >&2; exit 2 ;;
esac
[ "$(id -u)" = 0 ] || die "$1 needs root"
# One start/stop at a time (parallel test workers may all call start); daemons close this fd.
mkdir -p "$(dirname "$DIR")"
exec 9>"$DIR.lock"
flock -w 300 9 || die "timed out waiting for $DIR.lock"
"$1"
