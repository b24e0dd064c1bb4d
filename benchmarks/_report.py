"""RESULTS.md, results.json and throughput.png from one run's numbers.

Hand-written analysis (profiles, causes, before/after) lives in
``benchmarks/analysis.md`` and is copied into RESULTS.md under the generated
tables, so a re-run refreshes the numbers without losing it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from benchmarks._section_tables import cold_start_lines, cold_start_ratio_16x, mixing_lines

REFERENCE = "datacache-inprocess"
WORKERS_REFERENCE = "datacache-workers"
DROPIN = "datacache-dropin"
DROPIN_LOADER = "datacache-dataloader"
DROPINS = (DROPIN_LOADER, DROPIN)
MODES = {
    DROPIN_LOADER: "drop-in, datacache.loaders.DataLoader",
    DROPIN: "drop-in, 2 workers",
    REFERENCE: "in-process",
    WORKERS_REFERENCE: "2 workers",
}
GOALS = {
    DROPIN_LOADER: {"best anchor warm": 2.0, "ceiling": 1.5, "best anchor cold": 1.2},
    DROPIN: {"best anchor warm": 2.0, "ceiling": 1.5, "best anchor cold": 1.2},
    REFERENCE: {"best anchor warm": 3.0, "ceiling": 1.0, "best anchor cold": 1.0},
    WORKERS_REFERENCE: {"best anchor warm": 3.0, "ceiling": 1.0, "best anchor cold": 1.0},
}
"""Per mode: the goals of the ratios to the anchors and the no-I/O ceiling (issue 5 for batch mode, 15 for drop-in)."""


def _median(entry: dict[str, Any] | None, phase: str, metric: str = "mb_per_s") -> float | None:
    if not entry or phase not in entry:
        return None
    value = entry[phase][metric]["median"]
    return float(value) if value is not None else None


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _spread(entry: dict[str, Any] | None, phase: str, metric: str = "mb_per_s") -> str:
    if not entry or phase not in entry:
        return "-"
    stats = entry[phase][metric]
    if stats["n"] <= 1:
        return _fmt(stats["median"])
    return f"{_fmt(stats['median'])} ({_fmt(stats['min'])}-{_fmt(stats['max'])})"


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}x"


def _limit(results: dict[str, Any], name: str) -> float | None:
    value = results.get("limits", {}).get(name, {}).get("median")
    return float(value) if value is not None else None


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of issue 5: the measured ratio, the goal, and whether it holds."""
    rows: list[dict[str, Any]] = []
    loaders = results.get("loaders", {})
    for key in (*DROPINS, REFERENCE, WORKERS_REFERENCE):
        entry = loaders.get(key)
        if entry is not None:
            _loader_targets(rows, results, key, entry)
    _cli_targets(rows, results)
    _small_file_targets(rows, results)
    _cold_start_targets(rows, results)
    _training_targets(rows, results)
    return rows


def _best_anchor(loaders: dict[str, Any], phase: str) -> tuple[str | None, float | None]:
    """The anchor loader fastest in ``phase`` and its median MB/s."""
    anchors = {k: v for k, v in loaders.items() if v.get("anchor")}
    return max(
        ((k, _median(v, phase)) for k, v in anchors.items() if _median(v, phase) is not None),
        key=lambda kv: kv[1] or 0.0,
        default=(None, None),
    )


def _loader_targets(rows: list[dict[str, Any]], results: dict[str, Any], key: str, entry: dict[str, Any]) -> None:
    """The targets of one datacache loader (drop-in or batch mode) against the limits and the anchors."""
    loaders = results.get("loaders", {})
    best_warm_anchor = _best_anchor(loaders, "warm")
    best_cold_anchor = _best_anchor(loaders, "cold")
    readinto = _limit(results, "readinto")
    get = _limit(results, "s3_get_ceiling")
    durable = _limit(results, "durable_write")
    ceiling = _median(loaders.get("dataloader-ceiling"), "warm")
    mode = MODES[key]
    goals = GOALS[key]
    warm = _median(entry, "warm")
    cold = _median(entry, "cold")

    def add(
        what: str, value: float | None, reference: float | None, goal: float, note: str = "", mode: str = mode
    ) -> None:
        ratio = value / reference if value is not None and reference else None
        rows.append(
            {
                "target": what,
                "mode": mode,
                "ratio": ratio,
                "goal": goal,
                "holds": ratio is not None and ratio >= goal,
                "note": note,
            }
        )

    if key not in DROPINS:
        add("warm epoch / plain read (readinto)", warm, readinto, 0.5)
    best = f"best anchor: {best_warm_anchor[0]}"
    add("warm epoch / best anchor warm", warm, best_warm_anchor[1], goals["best anchor warm"], best)
    add("warm epoch / no-I/O DataLoader ceiling", warm, ceiling, goals["ceiling"], "past the ceiling")
    _dropin_against_batch(add, key, loaders)
    if key not in DROPINS:
        add("cold epoch / S3 GET ceiling", cold, get, 0.8)
        if durable is not None and get:
            fill = "min(GET ceiling, durable write): every byte of a cold epoch is also written to the cache"
            add("cold epoch / cache-fill limit", cold, min(get, durable), 0.8, fill)
    best = f"best anchor: {best_cold_anchor[0]}"
    add("cold epoch / best anchor cold", cold, best_cold_anchor[1], goals["best anchor cold"], best)


def _cli_targets(rows: list[dict[str, Any]], results: dict[str, Any]) -> None:
    """`datacache warm` against the S3 GET ceiling and the cache-fill limit."""
    get = _limit(results, "s3_get_ceiling")
    durable = _limit(results, "durable_write")
    for name, mode in (("datacache_warm", "CLI"),):
        warm_cli = _limit(results, name)
        if warm_cli is not None and get:
            rows.append(
                {
                    "target": "`datacache warm` / S3 GET ceiling",
                    "mode": mode,
                    "ratio": warm_cli / get,
                    "goal": 0.8,
                    "holds": warm_cli / get >= 0.8,
                    "note": "wall clock of the whole command",
                }
            )
            if durable is not None:
                fill = min(get, durable)
                rows.append(
                    {
                        "target": "`datacache warm` / cache-fill limit",
                        "mode": mode,
                        "ratio": warm_cli / fill,
                        "goal": 0.8,
                        "holds": warm_cli / fill >= 0.8,
                        "note": "min(GET ceiling, durable write); wall clock of the whole command",
                    }
                )


def _small_file_targets(rows: list[dict[str, Any]], results: dict[str, Any]) -> None:
    small = results.get("small_files", {})
    raw = small.get("raw", {}).get("objects_per_s")
    for phase in ("cold", "warm"):
        sharded = small.get(phase, {}).get("samples_per_s", {}).get("median")
        if raw and sharded:
            rows.append(
                {
                    "target": f"small files: after `datacache shard` ({phase}) / raw one by one",
                    "mode": "in-process",
                    "ratio": sharded / raw,
                    "goal": 50.0,
                    "holds": sharded / raw >= 50.0,
                    "note": "samples/s over objects/s",
                }
            )


def _cold_start_targets(rows: list[dict[str, Any]], results: dict[str, Any]) -> None:
    for index in ("none", "wids"):
        ratio = cold_start_ratio_16x(results.get("cold_start"), index)
        if ratio is not None:
            rows.append(
                {
                    "target": f"cold start: first batch at 16x the shards / at 1x ({index} sample index)",
                    "mode": "in-process",
                    "ratio": ratio,
                    "goal": 1.5,
                    "holds": ratio <= 1.5,
                    "at_most": True,
                    "note": "fresh process, empty cache; see the cold start section",
                }
            )


def _training_targets(rows: list[dict[str, Any]], results: dict[str, Any]) -> None:
    """Data-stall at a per-rank target the anchors miss."""
    anchors = {k for k, v in results.get("loaders", {}).items() if v.get("anchor")}
    training = results.get("training", {})
    for key in (*DROPINS, REFERENCE, WORKERS_REFERENCE):
        entry = training.get(key)
        if not entry or "worst_stall_fraction" not in entry:
            continue
        anchors_failing = all(
            not v.get("held", False) for k, v in training.items() if isinstance(v, dict) and k in anchors
        )
        stall = entry["worst_stall_fraction"]
        rows.append(
            {
                "target": "data-stall < 1% at a per-rank target the anchors miss",
                "mode": MODES[key],
                "ratio": stall,
                "goal": 0.01,
                "holds": stall < 0.01 and anchors_failing,
                "note": (
                    f"last epoch, its first batch excluded: "
                    f"{entry.get('worst_within_epoch_stall_fraction', 0.0):.2%}; "
                    f"every anchor misses the target: {'yes' if anchors_failing else 'no'}"
                ),
            }
        )


def _dropin_against_batch(add: Any, key: str, loaders: dict[str, Any]) -> None:
    """Drop-in cold within 10% of batch mode's (same workers); batch mode keeps its warm lead over drop-in."""
    dropin, batch = loaders.get(DROPIN), loaders.get(WORKERS_REFERENCE)
    if dropin is None or batch is None:
        return
    if key in DROPINS:
        add("cold epoch / batch mode cold (2 workers)", _median(loaders.get(key), "cold"), _median(batch, "cold"), 0.9)
    else:
        add(
            "warm epoch / drop-in warm",
            _median(loaders.get(key), "warm"),
            _median(dropin, "warm"),
            1.0,
            "batch mode leads",
        )


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def render(results: dict[str, Any], analysis: str, picture: str, raw: str) -> str:
    out = _intro_lines(results, picture, raw)
    out += _loader_lines(results)
    out += _limit_lines(results)
    out += _target_lines(results)
    out += _small_file_lines(results)
    out += _training_lines(results)
    out += _other_issue_lines(results)
    out += cold_start_lines(results.get("cold_start"))
    out += mixing_lines(results.get("mixing"))
    if analysis.strip():
        out.append(analysis.strip())
        out.append("")
    out += _machine_lines(results)
    return "\n".join(out)


def _intro_lines(results: dict[str, Any], picture: str, raw: str) -> list[str]:
    """The title, how the run was made, the picture, and the dataset and loaders it measured."""
    sizes = results["sizes"]
    dataset = results.get("dataset", {})
    out: list[str] = []
    out.append(f"# Benchmarks: datacache against the loaders users would pick instead ({results['mode']} run)")
    out.append("")
    out.append(
        "Generated by `python -m benchmarks.run"
        + (" --quick" if results["mode"] == "quick" else "")
        + f"` on {results['started']} ({results.get('seconds', 0):.0f} s). Reproduce with `make bench` "
        f"(or `make bench-quick`). Raw numbers: `benchmarks/{raw}`."
    )
    out.append("")
    out.append(f"![throughput per loader]({picture})")
    out.append("")
    out.append(
        f"Dataset: {dataset.get('samples')} samples of {sizes['min_bytes'] // 1000}-{sizes['max_bytes'] // 1000} KB "
        f"random bytes plus a label, {dataset.get('payload_bytes', 0) / 1e6:,.0f} MB of payload, written by each "
        f"tool's own writer in ~{sizes['shard_bytes'] / 1e6:.0f} MB shards/chunks ({dataset.get('shards')} "
        "WebDataset shards). S3 = moto's server on 127.0.0.1. Every loader goes through a "
        f"`torch.utils.data.DataLoader` with batch size {results['batch_size']} and "
        f"`num_workers={results['num_workers']}`, shuffling, and its consumer copies every byte it receives into a "
        "preallocated buffer and counts samples; `torch.set_num_threads(1)` in every consumer. "
        "datacache runs four ways: drop-in (`DataLoader(CachedIterableDataset(url), batch_size=64, "
        "num_workers=2)`, per-sample dicts batched by the DataLoader's `default_collate`: what users start with), "
        "the same with one import changed (`from datacache.loaders import DataLoader`: the same batches, read "
        "in the training process), "
        "batch mode with the same 2 worker processes as the anchors, and batch mode in its recommended "
        "in-process mode (`num_workers=0`, 2 reader threads inside the training process). Cold = empty cache, "
        "data in S3; warm = the next epoch, cache full (hot page cache). MB = 10^6 bytes. "
        f"Medians of {sizes['repeats']} run(s), range in brackets."
    )
    out.append("")
    if results.get("missing"):
        out.append(f"Not installed in this interpreter, skipped: {', '.join(results['missing'])}.")
        out.append("")
    return out


_LOADER_COLUMNS = [
    "loader",
    "cold MB/s",
    "cold samples/s",
    "warm MB/s",
    "warm samples/s",
    "warm / datacache in-process",
    "warm / datacache 2 workers",
    "cold / datacache in-process",
    "warm / plain read",
    "warm / no-I/O DataLoader",
    "cold / S3 GET ceiling",
    "samples per epoch ok",
    "first batch s (cold / warm)",
    "CPU s per GB (cold / warm)",
    "peak RSS / PSS MB",
]


def _loader_lines(results: dict[str, Any]) -> list[str]:
    """One cold and one warm epoch per loader, with its ratios to the references."""
    loaders = results.get("loaders", {})
    reference = loaders.get(REFERENCE)
    workers_ref = loaders.get(WORKERS_REFERENCE)
    readinto = _limit(results, "readinto")
    get = _limit(results, "s3_get_ceiling")
    ceiling = _median(loaders.get("dataloader-ceiling"), "warm")
    sizes = results["sizes"]
    out = ["## Loaders: one cold and one warm epoch", ""]
    rows = []
    for key, entry in loaders.items():
        warm = _median(entry, "warm")
        cold = _median(entry, "cold")
        counts = []
        for phase in ("cold", "warm"):
            if phase in entry:
                e = entry[phase]
                counts.append("yes" if e["counts_ok"] else f"NO ({e['samples']} vs {e['expected']})")
        label = entry["label"]
        if entry.get("errors"):
            label += f" (**{len(entry['errors'])} failed run(s)**)"
        if key == "s3torchconnector":
            label += f" [{sizes['raw_samples']} samples, one object each]"
        rows.append(
            [
                label,
                _spread(entry, "cold"),
                _spread(entry, "cold", "samples_per_s"),
                _spread(entry, "warm") if entry["loader"] != "s3torchconnector" else "no cache",
                _spread(entry, "warm", "samples_per_s"),
                _ratio(warm, _median(reference, "warm")),
                _ratio(warm, _median(workers_ref, "warm")),
                _ratio(cold, _median(reference, "cold")),
                _ratio(warm, readinto),
                _ratio(warm, ceiling),
                _ratio(cold, get),
                " / ".join(counts) or "-",
                " / ".join(
                    _fmt(entry[p]["first_batch_s"]["median"], 2) if p in entry else "-" for p in ("cold", "warm")
                ),
                " / ".join(
                    _fmt(entry[p]["cpu_s_per_gb"]["median"], 2) if "cpu_s_per_gb" in entry.get(p, {}) else "-"
                    for p in ("cold", "warm")
                ),
                f"{_fmt(entry.get('peak_rss_mb'))} / {_fmt(entry.get('peak_pss_mb'))}",
            ]
        )
    out += _table(_LOADER_COLUMNS, rows)
    out.append("")
    out.append(
        "CPU s per GB: user + system CPU seconds of the job's whole process tree (consumer, DataLoader "
        "workers, the loader's own threads) over the epoch, per GB delivered to the consumer; median of the runs. "
        "Peak memory is sampled every 0.25 s over the job's whole process tree (consumer plus DataLoader workers), "
        "RSS summed and PSS summed (PSS counts shared memory once). datacache maps cached shards, so their "
        "file pages count in its RSS."
    )
    out.append("")
    return out


def _limit_lines(results: dict[str, Any]) -> list[str]:
    """What this machine's disk, S3 server and a no-I/O DataLoader reach, same run."""
    loaders = results.get("loaders", {})
    out: list[str] = []
    out.append("## Limits of this machine, same run")
    out.append("")
    limits = results.get("limits", {})
    names = [
        ("readinto", "plain sequential read of the cached shard files, Python `readinto`, reused 8 MiB buffer"),
        ("cat", "`cat FILES > /dev/null` of the same files"),
        ("s3_get_ceiling", "S3 server GET ceiling: 8 threads of boto3 GETs of whole shards"),
        ("durable_write", "local disk durable write: shard-sized files, fsync and rename, 4 threads"),
        ("datacache_warm", "`datacache warm s3://...` into an empty local tier (wall clock, whole command)"),
        ("aws_s3_cp", "`aws s3 cp --recursive` (wall clock, whole command)"),
        ("s3fs_get", "s3fs `get(recursive=True)`"),
    ]
    limit_rows = []
    for name, what in names:
        entry = limits.get(name)
        if not entry:
            continue
        spread = (
            _fmt(entry["median"])
            if entry["n"] <= 1
            else f"{_fmt(entry['median'])} ({_fmt(entry['min'])}-{_fmt(entry['max'])})"
        )
        limit_rows.append([what, spread])
    if "dataloader-ceiling" in loaders:
        limit_rows.append(
            [
                "DataLoader, 2 workers, no I/O, passing lists of `bytes` (consumer copies them)",
                _spread(loaders["dataloader-ceiling"], "warm"),
            ]
        )
    warm_reported = limits.get("datacache_warm", {}).get("reported", {}).get("median")
    if warm_reported:
        limit_rows.append(["`datacache warm`, transfer rate as it reports it", _fmt(warm_reported)])
    out += _table(["limit", "MB/s"], limit_rows)
    out.append("")
    return out


def _target_lines(results: dict[str, Any]) -> list[str]:
    """The issues' targets, each measured as a ratio in this run."""
    out: list[str] = []
    out.append("## Targets (issue 5; drop-in: issue 15), ratios measured side by side in this run")
    out.append("")
    target_rows = []
    for row in targets(results):
        if row["target"].startswith("data-stall"):
            value = f"{row['ratio']:.2%}"
            goal = "< 1%"
        else:
            value = f"{row['ratio']:.2f}x" if row["ratio"] is not None else "-"
            goal = f"{'<=' if row.get('at_most') else '>='} {row['goal']:g}x"
        target_rows.append(
            [row["target"], row["mode"], value, goal, "**holds**" if row["holds"] else "**misses**", row["note"]]
        )
    out += _table(["target", "datacache mode", "measured", "goal", "", "note"], target_rows)
    out.append("")
    return out


def _small_file_lines(results: dict[str, Any]) -> list[str]:
    """Raw small objects one by one against the same after `datacache shard`."""
    out: list[str] = []
    small = results.get("small_files", {})
    if small:
        out.append("## Small files: raw objects one by one vs after `datacache shard`")
        out.append("")
        raw = small.get("raw", {})
        small_rows = [
            [
                f"raw {small.get('object_bytes')} B objects one by one, {raw.get('objects')} objects "
                f"({small.get('raw_how', 'sequential GETs')})",
                _fmt(raw.get("objects_per_s")),
                _fmt(raw.get("mb_per_s"), 1),
                "1.00x",
            ]
        ]
        shard = small.get("shard")
        if shard:
            small_rows.append(
                [
                    f"`datacache shard` of {shard.get('objects')} objects into {shard.get('shards')} shards "
                    f"(S3 to S3, {shard.get('wall_seconds', 0):.1f} s wall)",
                    _fmt(shard.get("objects_per_s")),
                    _fmt((shard.get("rate_bytes_per_s") or 0) / 1e6, 1),
                    "-",
                ]
            )
        for phase in ("cold", "warm"):
            if phase in small:
                sps = small[phase]["samples_per_s"]["median"]
                ok = "yes" if small[phase]["counts_ok"] else "NO"
                small_rows.append(
                    [
                        f"datacache loader over the shards, {phase} (in-process), samples ok: {ok}",
                        _fmt(sps),
                        _fmt(small[phase]["mb_per_s"]["median"], 1),
                        _ratio(sps, raw.get("objects_per_s")),
                    ]
                )
        out += _table(["", "objects (samples)/s", "MB/s", "vs raw"], small_rows)
        if small.get("shard_error"):
            out += ["", f"`datacache shard` failed: `{small['shard_error'][:500]}`"]
        if small.get("read_error"):
            out += ["", f"Reading the shards failed: `{small['read_error'][:500]}`"]
        out.append("")
    return out


def _training_lines(results: dict[str, Any]) -> list[str]:
    """The training-like consumer: data-stall per rank at a target rate."""
    out: list[str] = []
    training = results.get("training", {})
    if training:
        target = training["target_bytes_per_s"] / 1e6
        out.append(
            f"## Training-like consumer: {training['ranks']} ranks, {target:.0f} MB/s per rank, "
            f"{training['epochs']} warm epoch(s)"
        )
        out.append("")
        out.append(
            "Each rank is a process (torch.distributed on gloo over 127.0.0.1) with its own DataLoader, set up as "
            "above, whose consumer copies each batch and then 'computes' (sleeps) for batch bytes / target, as a "
            "GPU step would, leaving the CPUs to the loader. Data-stall = time waiting for the next batch / elapsed "
            "(first batch excluded). The cache is the one the last repeat left warm."
        )
        out.append("")
        train_rows = []
        for entry in training.values():
            if not isinstance(entry, dict) or "label" not in entry:
                continue
            if entry.get("errors"):
                error = entry["errors"][0][:200].replace("\n", " ")
                train_rows.append([entry["label"], "failed", "-", "-", "-", error[:150]])
                continue
            train_rows.append(
                [
                    entry["label"],
                    f"{entry['worst_stall_fraction']:.1%}"
                    + (
                        f" (last epoch {entry['worst_last_epoch_stall_fraction']:.1%})"
                        if training["epochs"] > 1 and "worst_last_epoch_stall_fraction" in entry
                        else ""
                    ),
                    _fmt(entry["slowest_rank_bytes_per_s"] / 1e6),
                    f"{entry.get('worst_within_epoch_stall_fraction', 0.0):.1%}",
                    "yes" if entry["held"] else "no",
                    str(entry["samples_total"]),
                ]
            )
        out += _table(
            [
                "loader",
                "worst rank's data-stall",
                "slowest rank MB/s",
                "last epoch's stall, its first batch excluded",
                "target held",
                "samples (all ranks)",
            ],
            train_rows,
        )
        out.append("")
    return out


def _other_issue_lines(results: dict[str, Any]) -> list[str]:
    """Figures other issues ask for, from the same run."""
    loaders = results.get("loaders", {})
    reference = loaders.get(REFERENCE)
    workers_ref = loaders.get(WORKERS_REFERENCE)
    readinto = _limit(results, "readinto")
    limits = results.get("limits", {})
    small = results.get("small_files", {})
    out: list[str] = []
    out.append("## Numbers other issues ask for (same run)")
    out.append("")
    warm_cli = limits.get("datacache_warm", {})
    aws = limits.get("aws_s3_cp", {})
    if warm_cli.get("median") and aws.get("median"):
        out.append(
            f"- Issue 2: `datacache warm` from the S3 server {_fmt(warm_cli['median'])} MB/s wall clock "
            f"({_fmt(warm_cli.get('reported', {}).get('median'))} MB/s as it reports the transfer) vs "
            f"`aws s3 cp --recursive` {_fmt(aws['median'])} MB/s: {_ratio(warm_cli['median'], aws['median'])}."
        )
    if workers_ref and readinto:
        out.append(
            f"- Issue 3: loader warm through a DataLoader with `num_workers=2`: {_fmt(_median(workers_ref, 'warm'))} "
            f"MB/s; in-process mode {_fmt(_median(reference, 'warm'))} MB/s; plain `readinto` of the same cached "
            f"files {_fmt(readinto)} MB/s: ratios {_ratio(_median(workers_ref, 'warm'), readinto)} and "
            f"{_ratio(_median(reference, 'warm'), readinto)}."
        )
    if small.get("shard") and small.get("cold"):
        speedup = _ratio(small["cold"]["samples_per_s"]["median"], small.get("raw", {}).get("objects_per_s"))
        out.append(
            f"- Issue 7: `datacache shard` packed {_fmt(small['shard'].get('objects_per_s'))} objects/s; reading "
            f"the result (cold, from S3) is {speedup} the raw objects one by one."
        )
    out.append("")
    return out


def _machine_lines(results: dict[str, Any]) -> list[str]:
    """The machine, its load, and the versions measured."""
    out: list[str] = []
    out.append("## Machine and versions")
    out.append("")
    machine = results.get("machine", {})
    out.append(
        f"- {machine.get('cpu_model', '?')}, {machine.get('cpus')} CPUs, {machine.get('memory_gb')} GB memory, "
        f"{machine.get('filesystem', '?')}, Linux {machine.get('kernel')}, Python {machine.get('python')}"
    )
    out.append(
        f"- load average at start {results.get('loadavg_start', [0])[0]:.2f}, at end "
        f"{results.get('loadavg_end', [0])[0]:.2f} (other work on the machine shows here)"
    )
    out.append("- " + ", ".join(f"{k} {v}" for k, v in results.get("versions", {}).items()))
    out.append("")
    return out


def plot(results: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    loaders = {k: v for k, v in results.get("loaders", {}).items() if k != "dataloader-ceiling"}
    names = [v["label"].split(" [")[0] for v in loaders.values()]
    figure, axes = plt.subplots(1, 2, figsize=(13, 0.55 * len(names) + 2.2), sharey=True)
    for axis, phase, heading in ((axes[0], "cold", "cold epoch (from S3)"), (axes[1], "warm", "warm epoch (cache)")):
        title = heading
        medians = [_median(v, phase) or 0.0 for v in loaders.values()]
        lows = [m - (v[phase]["mb_per_s"]["min"] if phase in v else 0.0) for m, v in zip(medians, loaders.values())]
        highs = [(v[phase]["mb_per_s"]["max"] if phase in v else 0.0) - m for m, v in zip(medians, loaders.values())]
        colors = ["#1f77b4" if not v.get("anchor") else "#999999" for v in loaders.values()]
        axis.barh(range(len(names)), medians, xerr=[lows, highs], color=colors, capsize=3)
        for y, value in enumerate(medians):
            axis.text(value, y, f" {value:,.0f}" if value else " no cache", va="center", fontsize=8)
        if phase == "cold" and _limit(results, "s3_get_ceiling"):
            axis.axvline(_limit(results, "s3_get_ceiling") or 0, color="red", linestyle="--", label="S3 GET ceiling")
        if phase == "warm":
            ceiling = _median(results["loaders"].get("dataloader-ceiling"), "warm")
            if ceiling:
                axis.axvline(ceiling, color="orange", linestyle="--", label="DataLoader 2 workers, no I/O")
            readinto = _limit(results, "readinto")
            highest = max([*(m + h for m, h in zip(medians, highs)), ceiling or 0.0])
            if readinto and readinto < 1.3 * highest:
                axis.axvline(readinto, color="red", linestyle="--", label="plain read (readinto)")
            else:
                axis.set_xlim(0, 1.3 * highest)
                title += f"; plain read: {readinto or 0:,.0f} MB/s, off scale"
        axis.set_title(title, fontsize=10)
        axis.set_xlabel("MB/s (median, range)")
        axis.legend(fontsize=8, loc="lower right")
    axes[0].set_yticks(range(len(names)))
    axes[0].set_yticklabels(names, fontsize=8)
    axes[0].invert_yaxis()
    figure.suptitle(f"Throughput per loader, {results['mode']} run (batch 64; anchors num_workers=2)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def write_report(results: dict[str, Any], out: Path) -> list[Path]:
    """Write RESULTS.md, results.json and throughput.png (``-quick`` names for a quick run); return the paths."""
    out.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if results["mode"] == "quick" else ""
    markdown, raw, picture = out / f"RESULTS{suffix}.md", out / f"results{suffix}.json", out / f"throughput{suffix}.png"
    analysis_path = Path(__file__).resolve().parent / "analysis.md"
    analysis = analysis_path.read_text() if analysis_path.is_file() else ""
    results["targets"] = targets(results)
    raw.write_text(json.dumps(results, indent=1, default=str))
    plotted = plot(results, picture)
    text = render(results, analysis, picture.name, raw.name)
    if not plotted:
        text += "\n(matplotlib is not installed here: no plot.)\n"
    markdown.write_text(text)
    return [markdown, raw, picture] if plotted else [markdown, raw]
