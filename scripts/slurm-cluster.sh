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

# Does process $1 run?  A zombie does not: a killed daemon is reparented to
# PID 1, which may take seconds to reap it (it does inside gVisor).
proc_running() {
    local stat
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ -n $stat && ${stat:0:1} != Z && ${stat:0:1} != X ]]
}

# Is the process in pidfile $1 alive and named $2?  The name check keeps a
# stale pid file whose pid was reused by something else from counting.
pid_alive() {
    local pidfile=$1 name=$2 pid
    [[ -r $pidfile ]] || return 1
    pid=$(<"$pidfile") || return 1
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]] || return 1
    proc_running "$pid"
}

# Poll command "$@" until it succeeds or $TIMEOUT seconds pass.
wait_for() {
    local deadline=$((SECONDS + TIMEOUT))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || return 1
        sleep 0.5
    done
}

# wait_up NAME PIDFILE LOGFILE WHAT CMD...: poll CMD until it succeeds; die
# at once if daemon NAME has exited (its pid file is there, or should be
# after 5 s, and names no live NAME), or after $TIMEOUT s saying WHAT failed.
# The caller removes any stale pid file before starting the daemon.
wait_up() {
    local name=$1 pidfile=$2 logfile=$3 what=$4
    shift 4
    local deadline=$((SECONDS + TIMEOUT)) grace=$((SECONDS + 5))
    until "$@" >/dev/null 2>&1; do
        if [[ -e $pidfile ]] || ((SECONDS >= grace)); then
            pid_alive "$pidfile" "$name" \
                || die_with_log "$name" "$logfile" "exited while starting"
        fi
        ((SECONDS < deadline)) || die_with_log "$name" "$logfile" "$what after ${TIMEOUT}s"
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
        proc_running "$pid" || break
        sleep 0.5
    done
    if proc_running "$pid"; then
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
    # Without a policy-rc.d the packages' postinst scripts start their
    # daemons through /etc/init.d (a system MariaDB on 3306, a munged...);
    # this script starts its own, so forbid that for the install's duration.
    local policy=/usr/sbin/policy-rc.d made_policy=0 rc=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\n# temporary, from rlcli scripts/slurm-cluster.sh\nexit 101\n' >"$policy"
        chmod 755 "$policy"
        made_policy=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        slurm-wlm slurmdbd munge mariadb-server >/dev/null || rc=$?
    ((made_policy)) && rm -f "$policy"
    ((rc == 0)) || die "apt-get install of slurm-wlm slurmdbd munge mariadb-server failed (exit $rc)"
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
MYCNF_CHANGED=0
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
# No mail on this box; the default /usr/bin/mail is absent and logs an error.
MailProg=/bin/true
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
innodb_buffer_pool_size=256M
innodb_log_file_size=64M
innodb_lock_wait_timeout=900
[client]
socket=$DBSOCK" 600 \
        && MYCNF_CHANGED=1
    return 0
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
    rm -f "$MUNGE_SOCKET_DIR/munged.pid"
    runuser -u munge -- munged --log-file="$LOG/munged.log" \
        --pid-file="$MUNGE_SOCKET_DIR/munged.pid" >>"$LOG/munged.log" 2>&1 \
        || die_with_log munged "$LOG/munged.log" "munged failed to start"
    wait_up munged "$MUNGE_SOCKET_DIR/munged.pid" "$LOG/munged.log" "no answer on its socket" munge_works
    # Remember that this script started it, so that `stop` stops it.
    cp "$MUNGE_SOCKET_DIR/munged.pid" "$RUN/munged.pid"
    echo "started munged"
}

db_sql() {
    mariadb --defaults-file="$MYCNF" -u root -N -B -e "$1"
}

start_mariadb() {
    if pid_alive "$RUN/mariadbd.pid" mariadbd && ((MYCNF_CHANGED)); then
        note "my.cnf changed; restarting mariadbd"
        stop_pidfile "$RUN/mariadbd.pid" mariadbd >/dev/null
    fi
    if ! pid_alive "$RUN/mariadbd.pid" mariadbd; then
        if [[ ! -d $DIR/mysql/mysql ]]; then
            # root@localhost authenticates through the socket as the OS root.
            mariadb-install-db --defaults-file="$MYCNF" --auth-root-authentication-method=socket \
                >>"$LOG/mariadb.log" 2>&1 \
                || die_with_log mariadbd "$LOG/mariadb.log" "mariadb-install-db failed"
        fi
        rm -f "$RUN/mariadbd.pid"
        setsid mariadbd --defaults-file="$MYCNF" </dev/null >>"$LOG/mariadb.log" 2>&1 &
        wait_up mariadbd "$RUN/mariadbd.pid" "$LOG/mariadb.log" "not answering a ping" \
            mariadb-admin --defaults-file="$MYCNF" -u root ping
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

# Run daemon $1 (the command line: $1 and its arguments), restarting it first when its config changed
# ($CHANGED is 1); its pid file and log are $RUN/$1.pid and $LOG/$1.log.
start_daemon() {
    local name=$1
    if pid_alive "$RUN/$name.pid" "$name" && ((CHANGED)); then
        note "the config of $name changed; restarting it"
        stop_pidfile "$RUN/$name.pid" "$name" >/dev/null
    fi
    if ! pid_alive "$RUN/$name.pid" "$name"; then
        rm -f "$RUN/$name.pid"
        "$@" >>"$LOG/$name.log" 2>&1 || die_with_log "$name" "$LOG/$name.log" "$name failed to start"
        echo "started $name"
    fi
}

start_slurmdbd() {
    CHANGED=$SLURMDBD_CONF_CHANGED start_daemon slurmdbd
    # Its first start creates the tables, which takes a few seconds.
    wait_up slurmdbd "$RUN/slurmdbd.pid" "$LOG/slurmdbd.log" "sacctmgr cannot reach it" sacctmgr_works
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
    CHANGED=$SLURM_CONF_CHANGED start_daemon slurmctld
    wait_up slurmctld "$RUN/slurmctld.pid" "$LOG/slurmctld.log" "scontrol ping does not see it UP" slurmctld_up
}

# The node's state as sinfo prints it (idle, mixed, drained...), or nothing
# while slurmctld does not answer; never fails, so callers may assign it.
node_state() {
    sinfo -h -N -n "$NODE" -o %T 2>/dev/null | head -n 1 || true
}

node_usable() {
    case $(node_state) in
        idle | mixed | allocated | completing) return 0 ;;
    esac
    return 1
}

start_slurmd() {
    CHANGED=$SLURM_CONF_CHANGED start_daemon slurmd -N "$NODE"
    # A node drained by an earlier run (e.g. "Kill task failed") would never
    # become idle by itself; resume it once.
    local state
    state=$(node_state)
    if [[ $state == drain* || $state == drained ]]; then
        note "node $NODE was $state; resuming it"
        scontrol update nodename="$NODE" state=resume || true
    fi
    # Busy (allocated/mixed/completing) counts as up: start is then a no-op.
    local deadline=$((SECONDS + TIMEOUT)) grace=$((SECONDS + 5))
    until node_usable; do
        if [[ -e $RUN/slurmd.pid ]] || ((SECONDS >= grace)); then
            pid_alive "$RUN/slurmd.pid" slurmd \
                || die_with_log slurmd "$LOG/slurmd.log" "exited while starting"
        fi
        ((SECONDS < deadline)) || die_with_log slurmd "$LOG/slurmd.log" \
            "node $NODE is '$(node_state)', not idle, after ${TIMEOUT}s (see also $LOG/slurmctld.log)"
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
    # A job's slurmstepd outlives slurmd, so cancel the jobs first, or their
    # processes would linger after the cluster is gone.
    local jobs i
    if pid_alive "$RUN/slurmctld.pid" slurmctld; then
        jobs=$(squeue -h -o %A 2>/dev/null || true)
        if [[ -n $jobs ]]; then
            # shellcheck disable=SC2086  # one job id per word
            scancel --quiet $jobs 2>/dev/null || true
            # Give them KillWait (10 s) and a little to end.
            for ((i = 0; i < 30; i++)); do
                [[ -z $(squeue -h -t RUNNING,COMPLETING -o %A 2>/dev/null) ]] && break
                sleep 0.5
            done
        fi
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
        sinfo -N -h -o 'node %N, partition %P: %T, %c CPUs, %m MB' 2>/dev/null || true
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
