#!/usr/bin/env bash
# A real one-node Slurm cluster on localhost, for rlcli's Slurm tests.
#
#   scripts/slurm-cluster.sh start    install what is missing, configure, start
#                                      what is not running, wait until usable
#   scripts/slurm-cluster.sh stop     stop the daemons this script started
#   scripts/slurm-cluster.sh status   say what runs (exit 0 only if all of it)
#
# Needs root, a Debian-like system (apt-get) and no systemd: every daemon is
# started directly.  `start` is idempotent: with everything up it only checks.
#
# Environment:
#   RLCLI_SLURM_DIR      state, spool, logs, private MariaDB (default
#                        /var/lib/rlcli-slurm); logs are $RLCLI_SLURM_DIR/log/*.log
#   RLCLI_SLURM_DB_PORT  TCP port of the private MariaDB on 127.0.0.1 (default
#                        3307, so that a system MariaDB on 3306 is left alone)
#   RLCLI_SLURM_TIMEOUT  seconds to wait for each daemon (default 60)
set -euo pipefail

DIR=${RLCLI_SLURM_DIR:-/var/lib/rlcli-slurm}
DB_PORT=${RLCLI_SLURM_DB_PORT:-3307}
TIMEOUT=${RLCLI_SLURM_TIMEOUT:-60}
CLUSTER=rlcli
# The client commands (sbatch, sacct, ...) read /etc/slurm/slurm.conf unless
# SLURM_CONF says otherwise; writing it there means callers need no setup.
SLURM_ETC=/etc/slurm
MUNGE_KEY=/etc/munge/munge.key
MUNGE_SOCKET_DIR=/run/munge
MARKER="# Written by rlcli scripts/slurm-cluster.sh; rewritten on every start."

LOG=$DIR/log
RUN=$DIR/run
MYCNF=$DIR/etc/my.cnf
DBSOCK=$RUN/mariadbd.sock

die() {
    echo "slurm-cluster: error: $*" >&2
    exit 1
}

note() {
    echo "slurm-cluster: $*" >&2
}

# die, after showing the end of a daemon's log, which is where the reason is.
die_with_log() {
    local daemon=$1 logfile=$2
    shift 2
    echo "slurm-cluster: error: $daemon: $* (log: $logfile)" >&2
    if [[ -r $logfile ]]; then
        echo "--- last lines of $logfile ---" >&2
        tail -n 15 "$logfile" >&2 || true
    fi
    exit 1
}

# Is the process in pidfile $1 alive and named $2?  The name check keeps a
# stale pid file whose pid was reused by something else from counting.
pid_alive() {
    local pidfile=$1 name=$2 pid
    [[ -r $pidfile ]] || return 1
    pid=$(<"$pidfile") || return 1
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    [[ -r /proc/$pid/comm ]] || return 1
    [[ $(</proc/"$pid"/comm) == "$name" ]]
}

# Poll command "$@" until it succeeds or $TIMEOUT seconds pass.
wait_for() {
    local deadline=$((SECONDS + TIMEOUT))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || return 1
        sleep 0.5
    done
}

# Send SIGTERM to the process in pidfile $1 (named $2), then SIGKILL if it has
# not gone after 30 s.
stop_pidfile() {
    local pidfile=$1 name=$2 pid i
    if ! pid_alive "$pidfile" "$name"; then
        rm -f "$pidfile"
        return 0
    fi
    pid=$(<"$pidfile")
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 60; i++)); do
        [[ -e /proc/$pid ]] || break
        sleep 0.5
    done
    if [[ -e /proc/$pid ]]; then
        note "$name (pid $pid) ignored SIGTERM for 30 s; killing it"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
    echo "stopped $name (pid $pid)"
}

# ---------------------------------------------------------------- install

ensure_packages() {
    local missing=() b
    for b in munged munge unmunge mungekey mariadbd mariadb-install-db mariadb \
        mariadb-admin slurmctld slurmd slurmdbd sbatch srun sacct sacctmgr \
        sinfo squeue scontrol; do
        command -v "$b" >/dev/null 2>&1 || missing+=("$b")
    done
    # slurmdbd needs the MySQL plugin; it is a dependency of the slurmdbd
    # package, but check the file since a half-removed install lacks it.
    if ! compgen -G '/usr/lib/*/slurm-wlm/accounting_storage_mysql.so' >/dev/null; then
        missing+=(accounting_storage_mysql.so)
    fi
    ((${#missing[@]} == 0)) && return 0
    command -v apt-get >/dev/null 2>&1 \
        || die "missing ${missing[*]} and no apt-get to install them"
    note "missing ${missing[*]}; installing slurm-wlm slurmdbd munge mariadb-server"
    apt-get update -q >/dev/null || die "apt-get update failed"
    # The packages' postinst scripts may try to start their daemons through
    # /etc/init.d; that is harmless, since ours use other paths/ports or
    # reuse a running munged.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        slurm-wlm slurmdbd munge mariadb-server >/dev/null \
        || die "apt-get install of slurm-wlm slurmdbd munge mariadb-server failed"
    for b in "${missing[@]}"; do
        [[ $b == *.so ]] && continue
        command -v "$b" >/dev/null 2>&1 || die "$b is still missing after apt-get install"
    done
}

# ---------------------------------------------------------------- configs

# Write $2 (content) to file $1 with mode $3 if it differs; return 0 when the
# file changed, so that a running daemon can be restarted to read it.
write_if_changed() {
    local path=$1 content=$2 mode=$3 tmp
    if [[ -f $path ]] && [[ "$(<"$path")" == "$content" ]]; then
        chmod "$mode" "$path"
        return 1
    fi
    if [[ -f $path ]] && ! grep -qxF "$MARKER" "$path" && [[ ! -e $path.rlcli-backup ]]; then
        cp -p "$path" "$path.rlcli-backup"
        note "kept the previous $path as $path.rlcli-backup"
    fi
    tmp=$(mktemp "$path.XXXXXX")
    printf '%s\n' "$content" >"$tmp"
    chmod "$mode" "$tmp"
    mv -f "$tmp" "$path"
    return 0
}

SLURM_CONF_CHANGED=0
SLURMDBD_CONF_CHANGED=0
NODE=

write_configs() {
    local hw cpus boards sockets cores threads mem realmem defmem pass
    NODE=$(hostname -s)
    [[ -n $NODE ]] || die "hostname -s printed nothing"
    mkdir -p "$DIR"/{etc,state,spool/slurmd,mysql} "$LOG" "$RUN" "$SLURM_ETC"
    chmod 755 "$DIR" "$LOG" "$RUN"
    chmod 700 "$DIR/etc"

    # The node's shape as slurmd sees it, so that slurmd's registration
    # matches the config (a mismatch would leave the node INVALID).
    hw=$(slurmd -C | head -n 1) || die "slurmd -C failed"
    field() { sed -n "s/.*[[:space:]]$1=\([0-9]*\).*/\1/p" <<<"$hw"; }
    cpus=$(field CPUs)
    boards=$(field Boards)
    sockets=$(field SocketsPerBoard)
    cores=$(field CoresPerSocket)
    threads=$(field ThreadsPerCore)
    mem=$(field RealMemory)
    [[ -n $cpus && -n $sockets && -n $cores && -n $threads && -n $mem ]] \
        || die "cannot read the node's shape from slurmd -C: $hw"
    # 95 % of what the kernel reports: slurmd drains a node whose configured
    # RealMemory exceeds what it finds, and the figure can shrink slightly.
    realmem=$((mem * 95 / 100))
    # With CR_Core_Memory a job that asks for no memory would get the whole
    # node's memory and so block every other job; give it its CPU share instead.
    defmem=$((realmem / cpus))

    write_if_changed "$SLURM_ETC/slurm.conf" "$MARKER
ClusterName=$CLUSTER
# The controller is this host; the address avoids depending on DNS.
SlurmctldHost=$NODE(127.0.0.1)
# Everything runs as root here (the tests run as root), so the state and log
# directories need no other owner.
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long a requeued job must wait before it may start
# again (default 120 s); a short value keeps requeue tests fast.
AuthInfo=cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/slurmd
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups (none inside containers, no systemd): track tasks through the
# process tree and bind them to nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
# Cores and memory are consumable, so --mem is checked against RealMemory at
# scheduling time (nothing enforces it at run time without cgroups).
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$defmem
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=6819
JobCompType=jobcomp/none
JobRequeue=1
# A node that was DOWN (e.g. slurmd restarted) becomes usable again as soon as
# its slurmd registers with a valid configuration.
ReturnToService=2
# Schedule within about a second instead of the defaults' 30-60 s.
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1,batch_sched_delay=0
# Finished jobs stay in squeue for 60 s (sacct keeps them for good).
MinJobAge=60
# SIGTERM -> SIGKILL grace for cancelled or timed-out jobs.
KillWait=10
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$cpus Boards=${boards:-1} SocketsPerBoard=$sockets CoresPerSocket=$cores ThreadsPerCore=$threads RealMemory=$realmem State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP" 644 \
        && SLURM_CONF_CHANGED=1

    # MariaDB password of the slurm database user: made once, then kept.
    if [[ ! -s $DIR/etc/db.pass ]]; then
        (umask 077 && head -c 24 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' >"$DIR/etc/db.pass")
    fi
    pass=$(<"$DIR/etc/db.pass")

    # slurmdbd refuses a config readable by others (it holds the password).
    write_if_changed "$SLURM_ETC/slurmdbd.conf" "$MARKER
AuthType=auth/munge
DbdHost=$NODE
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=root
LogFile=$LOG/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$pass
StorageLoc=slurm_acct_db" 600 \
        && SLURMDBD_CONF_CHANGED=1

    # A private MariaDB: its own data dir, socket and port, so that a system
    # MariaDB (its root password, its port) does not matter.  It runs as root
    # so that RLCLI_SLURM_DIR may lie anywhere root can write.
    write_if_changed "$MYCNF" "$MARKER
[mariadbd]
user=root
datadir=$DIR/mysql
socket=$DBSOCK
pid-file=$RUN/mariadbd.pid
log-error=$LOG/mariadb.log
bind-address=127.0.0.1
port=$DB_PORT
skip-log-bin
# Sizes slurmdbd asks for (it warns below them), kept small for a test box.
innodb_buffer_pool_size=128M
innodb_log_file_size=64M
innodb_lock_wait_timeout=900
[client]
socket=$DBSOCK" 600 || true
}

# ---------------------------------------------------------------- daemons

munge_works() {
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1
}

start_munge() {
    if [[ ! -s $MUNGE_KEY ]]; then
        mkdir -p "$(dirname "$MUNGE_KEY")"
        mungekey --create --keyfile="$MUNGE_KEY" || die "cannot create $MUNGE_KEY"
        note "created $MUNGE_KEY"
    fi
    chown munge:munge "$MUNGE_KEY" "$(dirname "$MUNGE_KEY")"
    chmod 600 "$MUNGE_KEY"
    # A munged started by someone else (e.g. the package's init script) is
    # just as good: Slurm only needs the socket to answer.
    munge_works && return 0
    # /run is emptied at boot; munged wants these owned by its user.
    install -d -o munge -g munge -m 755 "$MUNGE_SOCKET_DIR"
    install -d -o munge -g munge -m 711 /var/lib/munge
    touch "$LOG/munged.log"
    chown munge:munge "$LOG/munged.log"
    chmod 640 "$LOG/munged.log"
    runuser -u munge -- munged --log-file="$LOG/munged.log" \
        --pid-file="$MUNGE_SOCKET_DIR/munged.pid" >>"$LOG/munged.log" 2>&1 \
        || die_with_log munged "$LOG/munged.log" "munged failed to start"
    wait_for munge_works || die_with_log munged "$LOG/munged.log" "no answer on its socket after ${TIMEOUT}s"
    # Remember that this script started it, so that `stop` stops it.
    cp "$MUNGE_SOCKET_DIR/munged.pid" "$RUN/munged.pid"
    echo "started munged"
}

db_sql() {
    mariadb --defaults-file="$MYCNF" -u root -N -B -e "$1"
}

start_mariadb() {
    if ! pid_alive "$RUN/mariadbd.pid" mariadbd; then
        if [[ ! -d $DIR/mysql/mysql ]]; then
            # root@localhost authenticates through the socket as the OS root.
            mariadb-install-db --defaults-file="$MYCNF" --auth-root-authentication-method=socket \
                >>"$LOG/mariadb.log" 2>&1 \
                || die_with_log mariadbd "$LOG/mariadb.log" "mariadb-install-db failed"
        fi
        setsid mariadbd --defaults-file="$MYCNF" </dev/null >>"$LOG/mariadb.log" 2>&1 &
        wait_for mariadb-admin --defaults-file="$MYCNF" -u root ping \
            || die_with_log mariadbd "$LOG/mariadb.log" "not answering after ${TIMEOUT}s"
        echo "started mariadbd"
    fi
    local pass
    pass=$(<"$DIR/etc/db.pass")
    # Idempotent: the ALTER keeps the password in step with db.pass.
    db_sql "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$pass';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$pass';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" \
        || die_with_log mariadbd "$LOG/mariadb.log" "cannot create the slurm_acct_db database and user"
}

sacctmgr_works() {
    sacctmgr -n -P show cluster format=cluster
}

start_slurmdbd() {
    if pid_alive "$RUN/slurmdbd.pid" slurmdbd && ((SLURMDBD_CONF_CHANGED)); then
        note "slurmdbd.conf changed; restarting slurmdbd"
        stop_pidfile "$RUN/slurmdbd.pid" slurmdbd >/dev/null
    fi
    if ! pid_alive "$RUN/slurmdbd.pid" slurmdbd; then
        slurmdbd >>"$LOG/slurmdbd.log" 2>&1 \
            || die_with_log slurmdbd "$LOG/slurmdbd.log" "slurmdbd failed to start"
        # Its first start creates the tables, which takes a few seconds.
        wait_for sacctmgr_works \
            || die_with_log slurmdbd "$LOG/slurmdbd.log" "sacctmgr cannot reach it after ${TIMEOUT}s"
        echo "started slurmdbd"
    fi
    # slurmctld reports to accounting only for a cluster known there.
    if ! sacctmgr -n -P show cluster format=cluster | grep -qxF "$CLUSTER"; then
        sacctmgr -i add cluster "$CLUSTER" >/dev/null \
            || die_with_log slurmdbd "$LOG/slurmdbd.log" "sacctmgr add cluster $CLUSTER failed"
        echo "registered cluster $CLUSTER in accounting"
    fi
}

slurmctld_up() {
    scontrol ping | grep -q 'is UP'
}

start_slurmctld() {
    if pid_alive "$RUN/slurmctld.pid" slurmctld && ((SLURM_CONF_CHANGED)); then
        note "slurm.conf changed; restarting slurmctld"
        stop_pidfile "$RUN/slurmctld.pid" slurmctld >/dev/null
    fi
    if ! pid_alive "$RUN/slurmctld.pid" slurmctld; then
        slurmctld >>"$LOG/slurmctld.log" 2>&1 \
            || die_with_log slurmctld "$LOG/slurmctld.log" "slurmctld failed to start"
        wait_for slurmctld_up \
            || die_with_log slurmctld "$LOG/slurmctld.log" "scontrol ping does not see it UP after ${TIMEOUT}s"
        echo "started slurmctld"
    fi
}

node_state() {
    sinfo -h -N -n "$NODE" -o %T 2>/dev/null | head -n 1
}

node_idle() {
    [[ $(node_state) == idle ]]
}

start_slurmd() {
    if pid_alive "$RUN/slurmd.pid" slurmd && ((SLURM_CONF_CHANGED)); then
        note "slurm.conf changed; restarting slurmd"
        stop_pidfile "$RUN/slurmd.pid" slurmd >/dev/null
    fi
    if ! pid_alive "$RUN/slurmd.pid" slurmd; then
        slurmd -N "$NODE" >>"$LOG/slurmd.log" 2>&1 \
            || die_with_log slurmd "$LOG/slurmd.log" "slurmd failed to start"
        echo "started slurmd"
    fi
    # A node drained by an earlier run (e.g. "Kill task failed") would never
    # become idle by itself; resume it once.
    local state
    state=$(node_state)
    if [[ $state == drain* || $state == drained ]]; then
        note "node $NODE was $state; resuming it"
        scontrol update nodename="$NODE" state=resume || true
    fi
    # Busy (allocated/mixed/completing) counts as up: start is then a no-op.
    local deadline=$((SECONDS + TIMEOUT))
    while :; do
        state=$(node_state)
        case $state in
            idle | mixed | allocated | completing) break ;;
        esac
        ((SECONDS < deadline)) \
            || die_with_log slurmd "$LOG/slurmd.log" "node $NODE is '${state:-unknown}', not idle, after ${TIMEOUT}s (see also $LOG/slurmctld.log)"
        sleep 0.5
    done
}

# Accounting is usable once slurmctld has registered with slurmdbd (the
# cluster then has a control host) and sacct answers.
accounting_ready() {
    [[ -n $(sacctmgr -n -P show cluster "$CLUSTER" format=controlhost 2>/dev/null) ]] \
        && sacct -n -X -S now-1minutes >/dev/null
}

cmd_start() {
    ensure_packages
    write_configs
    start_munge
    start_mariadb
    start_slurmdbd
    start_slurmctld
    start_slurmd
    wait_for accounting_ready \
        || die_with_log slurmctld "$LOG/slurmctld.log" "sacct does not work after ${TIMEOUT}s (see also $LOG/slurmdbd.log)"
    echo "slurm cluster '$CLUSTER' ready: node $NODE $(node_state), partition debug; state in $DIR"
}

cmd_stop() {
    # Jobs first go with their node's slurmd gone? No: slurmstepd processes
    # outlive slurmd, so cancel what runs before stopping the controller.
    if pid_alive "$RUN/slurmctld.pid" slurmctld; then
        scancel --full --quiet --user=root 2>/dev/null || true
    fi
    stop_pidfile "$RUN/slurmd.pid" slurmd
    stop_pidfile "$RUN/slurmctld.pid" slurmctld
    stop_pidfile "$RUN/slurmdbd.pid" slurmdbd
    stop_pidfile "$RUN/mariadbd.pid" mariadbd
    # Only a munged this script started; one started by others stays.
    if [[ -e $RUN/munged.pid ]]; then
        stop_pidfile "$RUN/munged.pid" munged
    fi
}

cmd_status() {
    local all=0 name pidfile
    for name in munged mariadbd slurmdbd slurmctld slurmd; do
        pidfile=$RUN/$name.pid
        if pid_alive "$pidfile" "$name"; then
            echo "$name: running (pid $(<"$pidfile"))"
        elif [[ $name == munged ]] && munge_works; then
            echo "munged: running (not started by this script)"
        else
            echo "$name: not running"
            all=3
        fi
    done
    if pid_alive "$RUN/slurmctld.pid" slurmctld; then
        sinfo -N -o '%N %P %T %c CPUs %m MB' 2>/dev/null || true
    fi
    return "$all"
}

[[ $# -eq 1 ]] || die "usage: $0 start|stop|status"
[[ $(id -u) -eq 0 ]] || die "must run as root (it installs packages and starts daemons)"
case $1 in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) die "usage: $0 start|stop|status" ;;
esac
