#!/bin/bash
# Set up (or, with --check, only check) a Slurm/systemd node for datacache:
#   the datacache system user, the datacache-users group (with the users named on the command
#   line), the venv in /opt/datacache, /etc/datacache/config.toml (deploy/config/slurm.toml), the
#   cache directories, the systemd unit and the Slurm prolog.
#
#   sudo deploy/slurm/install.sh [USER...]     # from a checkout of the repository
#   sudo deploy/slurm/install.sh --upgrade     # reinstall datacache into the existing venv
#   deploy/slurm/install.sh --check            # exit 1 naming each missing prerequisite
#
# Every name and path can be overridden by the variable named beside it; the config and the unit
# are installed with those values in place of the defaults they ship with (tests/test_deploy_slurm.py
# runs this script, the daemon as the unit says and a job as a user of the group).
# The one thing left to the operator: the datasets jobs may read, one line each under [datasets]
# in $DATACACHE_ETC/config.toml.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
: "${DATACACHE_USER:=datacache}"
: "${DATACACHE_GROUP:=datacache-users}"
: "${DATACACHE_PREFIX:=/opt/datacache}"
: "${DATACACHE_ETC:=/etc/datacache}"
: "${DATACACHE_LOCAL_DIR:=/mnt/nvme/datacache}"
: "${DATACACHE_SHARED_DIR:=/mnt/shared/datacache}"
: "${DATACACHE_UNIT_DIR:=/etc/systemd/system}"
: "${DATACACHE_PROLOG_DIR:=/etc/slurm/prolog.d}"
: "${DATACACHE_RUN_DIR:=/run/datacache}"      # the unit's RuntimeDirectory: the socket's directory
: "${PYTHON:=python3}"

check() {
    local missing=0
    id -u "$DATACACHE_USER" >/dev/null 2>&1 || { echo "missing: user $DATACACHE_USER"; missing=1; }
    getent group "$DATACACHE_GROUP" >/dev/null || { echo "missing: group $DATACACHE_GROUP"; missing=1; }
    [ -x "$DATACACHE_PREFIX/bin/datacache" ] || { echo "missing: $DATACACHE_PREFIX/bin/datacache (the venv)"; missing=1; }
    [ -f "$DATACACHE_ETC/config.toml" ] || { echo "missing: $DATACACHE_ETC/config.toml"; missing=1; }
    for dir in "$DATACACHE_LOCAL_DIR" "$DATACACHE_SHARED_DIR"; do
        [ -d "$dir" ] || { echo "missing: directory $dir"; missing=1; }
    done
    [ -f "$DATACACHE_UNIT_DIR/datacache.service" ] || { echo "missing: $DATACACHE_UNIT_DIR/datacache.service"; missing=1; }
    if [ "$missing" = 0 ]; then as_daemon_account || missing=1; fi
    if [ "$missing" = 0 ]; then echo "datacache: node ready"; fi
    return "$missing"
}

# What the daemon itself will meet, checked as its account (root can run what it cannot): the venv
# runs, and the config's local_capacity fits the disk under local_dir (a warning, not a failure).
as_daemon_account() {
    if [ "$(id -u)" != 0 ]; then
        echo "note: not root, so the venv was not run as $DATACACHE_USER"
        return 0
    fi
    if ! (cd / && runuser -u "$DATACACHE_USER" -- "$DATACACHE_PREFIX/bin/datacache" --version) >/dev/null 2>&1; then
        echo "missing: $DATACACHE_PREFIX/bin/datacache cannot be run by $DATACACHE_USER (its directories and files must be readable and executable by that account)"
        return 1
    fi
    [ -x "$DATACACHE_PREFIX/bin/python" ] || return 0
    (cd / && runuser -u "$DATACACHE_USER" -- "$DATACACHE_PREFIX/bin/python" -c '
import sys
from datacache._capacity import capacity_beyond_disk
from datacache.config import load_settings
settings = load_settings({"DATACACHE_CONFIG": sys.argv[1]})
beyond = capacity_beyond_disk(settings.local_dir, settings.local_capacity)
if beyond:
    print("warning: " + beyond)
' "$DATACACHE_ETC/config.toml") || echo "warning: could not weigh local_capacity against the disk as $DATACACHE_USER (see above)"
}

if [ "${1:-}" = "--check" ]; then
    check
    exit
fi
upgrade=0
if [ "${1:-}" = "--upgrade" ]; then
    upgrade=1
    shift
fi
if [ "$(id -u)" != 0 ]; then
    echo "install.sh: run as root (it creates a system user, a group and directories), or pass --check" >&2
    exit 2
fi
# The NVMe and cluster filesystems are the operator's: mounted, not created here.
for mount in "$(dirname "$DATACACHE_LOCAL_DIR")" "$(dirname "$DATACACHE_SHARED_DIR")"; do
    [ -d "$mount" ] || { echo "install.sh: $mount does not exist (mount the filesystem first)" >&2; exit 1; }
done

getent group "$DATACACHE_GROUP" >/dev/null || groupadd --system "$DATACACHE_GROUP"
id -u "$DATACACHE_USER" >/dev/null 2>&1 ||
    useradd --system --gid "$DATACACHE_GROUP" --no-create-home --home-dir "$DATACACHE_LOCAL_DIR" \
        --shell /usr/sbin/nologin "$DATACACHE_USER"
for user in "$@"; do usermod --append --groups "$DATACACHE_GROUP" "$user"; done

if [ ! -x "$DATACACHE_PREFIX/bin/datacache" ] || [ "$upgrade" = 1 ]; then
    [ -x "$DATACACHE_PREFIX/bin/python" ] || "$PYTHON" -m venv "$DATACACHE_PREFIX"
    "$DATACACHE_PREFIX/bin/python" -m pip install --quiet -c "$repo/constraints.txt" "$repo"
fi

# The socket's directory, as the unit makes it: systemd's RuntimeDirectory (a name under /run), or,
# for a directory elsewhere, one made here and made writable for the daemon (ProtectSystem=strict).
case "$DATACACHE_RUN_DIR" in
    /run/?*) run_dir_unit=(-e "s|^RuntimeDirectory=datacache\$|RuntimeDirectory=${DATACACHE_RUN_DIR#/run/}|") ;;
    *) run_dir_unit=(-e "/^RuntimeDirectory/d" -e "s|^\(ReadWritePaths=.*\)\$|\1 $DATACACHE_RUN_DIR|") ;;
esac

# The shipped files name the default user, group and paths; install them with this node's.
render() {
    sed -e "s|/opt/datacache|$DATACACHE_PREFIX|g" \
        -e "s|/etc/datacache|$DATACACHE_ETC|g" \
        -e "s|/mnt/nvme/datacache|$DATACACHE_LOCAL_DIR|g" \
        -e "s|/mnt/shared/datacache|$DATACACHE_SHARED_DIR|g" \
        -e "s|/run/datacache|$DATACACHE_RUN_DIR|g" \
        -e "s|^daemon_uid = \"datacache\"|daemon_uid = \"$DATACACHE_USER\"|" \
        -e "s|^User=datacache\$|User=$DATACACHE_USER|" \
        -e "s|^Group=datacache-users\$|Group=$DATACACHE_GROUP|" \
        "${run_dir_unit[@]}" \
        "$1"
}

install -d -m 0755 "$DATACACHE_ETC"
if [ ! -f "$DATACACHE_ETC/config.toml" ]; then
    render "$repo/deploy/config/slurm.toml" > "$DATACACHE_ETC/config.toml.new"
    chmod 0644 "$DATACACHE_ETC/config.toml.new"
    mv "$DATACACHE_ETC/config.toml.new" "$DATACACHE_ETC/config.toml"
fi
# The node's cache: the daemon's, readable by the group whose jobs read through it.
install -d -m 0750 -o "$DATACACHE_USER" -g "$DATACACHE_GROUP" "$DATACACHE_LOCAL_DIR"
# The shared tier: a group resource (docs/SECURITY.md, "The shared tier"): 2770, setgid.
install -d -m 2770 -o "$DATACACHE_USER" -g "$DATACACHE_GROUP" "$DATACACHE_SHARED_DIR"
case "$DATACACHE_RUN_DIR" in
    /run/?*) ;;  # systemd makes it at each start
    *) install -d -m 0750 -o "$DATACACHE_USER" -g "$DATACACHE_GROUP" "$DATACACHE_RUN_DIR" ;;
esac
install -d -m 0755 "$DATACACHE_UNIT_DIR" "$DATACACHE_PROLOG_DIR"
render "$repo/deploy/slurm/datacache.service" > "$DATACACHE_UNIT_DIR/datacache.service"
chmod 0644 "$DATACACHE_UNIT_DIR/datacache.service"
install -m 0755 "$repo/deploy/slurm/datacache-prolog.sh" "$DATACACHE_PROLOG_DIR/datacache-prolog.sh"
check
echo "next: systemctl daemon-reload && systemctl enable --now datacache"
