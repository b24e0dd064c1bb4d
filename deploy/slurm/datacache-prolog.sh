#!/bin/bash
# Slurm Prolog: on each node of a job, warm the dataset the job names before it starts.
#
#   slurm.conf:   Prolog=/etc/slurm/prolog.d/datacache-prolog.sh
#                 PrologFlags=Alloc          # run at allocation, on every node of the job
#   the job:      sbatch --comment="datacache=s3://bucket/imagenet-wds/" train.sbatch
#                 sbatch --comment="datacache=imagenet,seed=17,ranks_per_node=8" train.sbatch
#
# With the job's seed and ranks per node (and shuffle=, shuffle_buffer=, drop_last= where its loader
# is given them), it prestages in the order the job will read: first the shards this node's ranks
# read first in epoch 0 (`datacache warm --order-for`: world_size is the job's nodes times
# ranks_per_node, node_rank this node's place in its node list), then the rest as far as the cache
# holds, so the first batch is local when the job starts. Without them, it warms the whole dataset.
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

job=$(scontrol show job "${SLURM_JOB_ID:-}" 2>/dev/null)
comment=$(sed -n 's/.*Comment=\(datacache=[^ ]*\).*/\1/p' <<<"$job")
spec=${comment#datacache=}
dataset=${spec%%,*}
if [ -z "$comment" ] || [ -z "$dataset" ]; then
    exit 0  # the job names no dataset
fi

order=()
if [ "$spec" != "$dataset" ]; then
    settings=${spec#*,}
    per=$(tr ',' '\n' <<<"$settings" | sed -n 's/^ranks_per_node=\([0-9][0-9]*\)$/\1/p')
    nodes=$(sed -n 's/^[[:space:]]*NodeList=\([^ ]*\).*/\1/p' <<<"$job" | head -n 1)
    hosts=$(scontrol show hostnames "$nodes" 2>/dev/null)
    index=$(grep -nxF -- "${SLURMD_NODENAME:-$(hostname -s)}" <<<"$hosts" | cut -d: -f1)
    if [ -n "$per" ] && [ -n "$index" ]; then
        count=$(grep -c . <<<"$hosts")
        order=(--order-for "$settings,world_size=$((count * per)),node_rank=$((index - 1))")
    else
        log "cannot place this node in the job (ranks_per_node=${per:-?}, node ${SLURMD_NODENAME:-?} in ${nodes:-?}): warming in manifest order"
    fi
fi

runner=()
if [ "$(id -u)" = 0 ] && id "$DATACACHE_USER" >/dev/null 2>&1; then
    runner=(runuser -u "$DATACACHE_USER" --)  # files owned by the cache's user, not root
fi

log "warming $dataset ${order[*]} (at most ${DATACACHE_PROLOG_SECONDS}s)"
started=$(date +%s)
errors=$(mktemp)
trap 'rm -f "$errors"' EXIT
if timeout --signal=TERM --kill-after=30 "$DATACACHE_PROLOG_SECONDS" \
        "${runner[@]}" "$DATACACHE_BIN" warm "$dataset" --tier local --quiet "${order[@]}" 2>"$errors"; then
    log "warmed $dataset in $(( $(date +%s) - started ))s"
else
    status=$?
    log "warm of $dataset incomplete (status $status: $(tail -n 1 "$errors")); the loader stages the rest on demand"
fi
exit 0
