#!/bin/bash
# Slurm Prolog: on each node of a job, warm the dataset the job names before it starts.
#
#   slurm.conf:   Prolog=/etc/slurm/prolog.d/datacache-prolog.sh
#                 PrologFlags=Alloc          # run at allocation, on every node of the job
#   the job:      sbatch --comment="datacache=s3://bucket/imagenet-wds/" train.sbatch
#
# It warms into the node's cache (the same directory and catalog the per-node daemon,
# deploy/slurm/datacache.service, and the jobs' loaders use). A prolog that fails drains
# the node, so this one never fails: it warms for at most DATACACHE_PROLOG_SECONDS and
# leaves the rest to the loader, which stages what is missing as it reads.
set -u

: "${DATACACHE_BIN:=/opt/datacache/bin/datacache}"
: "${DATACACHE_CONFIG:=/etc/datacache/config.toml}"
: "${DATACACHE_PROLOG_SECONDS:=900}"
: "${DATACACHE_USER:=datacache}"
export DATACACHE_CONFIG

log() { logger -t datacache-prolog -- "job ${SLURM_JOB_ID:-?}: $*"; }

comment=$(scontrol show job "${SLURM_JOB_ID:-}" 2>/dev/null | sed -n 's/.*Comment=\(datacache=[^ ]*\).*/\1/p')
dataset=${comment#datacache=}
if [ -z "$comment" ] || [ -z "$dataset" ]; then
    exit 0  # the job names no dataset
fi

runner=()
if [ "$(id -u)" = 0 ] && id "$DATACACHE_USER" >/dev/null 2>&1; then
    runner=(runuser -u "$DATACACHE_USER" --)  # files owned by the cache's user, not root
fi

log "warming $dataset (at most ${DATACACHE_PROLOG_SECONDS}s)"
started=$(date +%s)
errors=$(mktemp)
trap 'rm -f "$errors"' EXIT
if timeout --signal=TERM --kill-after=30 "$DATACACHE_PROLOG_SECONDS" \
        "${runner[@]}" "$DATACACHE_BIN" warm "$dataset" --tier local --quiet 2>"$errors"; then
    log "warmed $dataset in $(( $(date +%s) - started ))s"
else
    status=$?
    log "warm of $dataset incomplete (status $status: $(tail -n 1 "$errors")); the loader stages the rest on demand"
fi
exit 0
