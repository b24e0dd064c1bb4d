"""A node's measured bandwidth per tier set against what a job needs: the verdict, and its table."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from datacache.errors import ConfigError
from datacache.sizes import format_bytes

TIERS = ("origin", "shared", "local")
_GB = 1e9


def gbps(value: float | None) -> str:
    return "-" if value is None else f"{value / _GB:.2f} GB/s"


@dataclass(frozen=True)
class TierMeasurement:
    """What reading one tier gave: bytes over seconds, with how many readers."""

    tier: str
    bytes_read: int
    seconds: float
    readers: int
    files: int

    @property
    def bytes_per_s(self) -> float:
        return self.bytes_read / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class TierVerdict:
    """One tier set against the job: measured, needed in steady state, and on a cold epoch."""

    tier: str
    measured: float | None
    need: float
    cold_need: float
    note: str = ""

    @property
    def meets(self) -> bool | None:
        """Whether the tier delivers what the job needs of it (None: not measured)."""
        if self.need <= 0:
            return True
        return None if self.measured is None else self.measured >= self.need

    @property
    def meets_cold(self) -> bool | None:
        """Whether the tier could feed a cold epoch, nothing staged (None: not asked or not measured)."""
        if self.cold_need <= 0 or self.measured is None:
            return None
        return self.measured >= self.cold_need


@dataclass(frozen=True)
class BenchReport:
    """The answer of `run_bench`."""

    dataset: str
    gpus: int
    per_gpu: float
    dataset_bytes: int
    local_fraction: float
    tiers: tuple[TierVerdict, ...]
    bottleneck: str | None
    verdict: str
    measurements: tuple[TierMeasurement, ...] = field(default=())

    @property
    def need(self) -> float:
        return self.gpus * self.per_gpu

    @property
    def ok(self) -> bool:
        return self.bottleneck is None

    def to_json(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "gpus": self.gpus,
            "per_gpu_bytes_per_s": self.per_gpu,
            "need_bytes_per_s": self.need,
            "dataset_bytes": self.dataset_bytes,
            "local_fraction": round(self.local_fraction, 4),
            "ok": self.ok,
            "bottleneck": self.bottleneck,
            "verdict": self.verdict,
            "tiers": [
                {
                    "tier": v.tier,
                    "measured_bytes_per_s": v.measured,
                    "need_bytes_per_s": v.need,
                    "cold_epoch_need_bytes_per_s": v.cold_need,
                    "meets": v.meets,
                    "meets_cold_epoch": v.meets_cold,
                    "note": v.note,
                }
                for v in self.tiers
            ],
            "measurements": [asdict(m) | {"bytes_per_s": m.bytes_per_s} for m in self.measurements],
        }


def assess(
    measured: dict[str, float | None],
    *,
    gpus: int,
    per_gpu: float,
    dataset_bytes: int,
    local_room: int | None,
    shared_configured: bool,
    dataset: str = "",
) -> BenchReport:
    """Set measured bandwidths (bytes/s per tier; None = not measured) against a job's needs.

    In steady state the local tier serves the share of the dataset it can
    hold; the rest comes from the next tier down (shared if configured, else
    the origin). A cold epoch, with nothing staged, reads at the full rate
    from wherever the data is: that is the case ``datacache warm`` avoids.
    """
    if gpus <= 0 or per_gpu <= 0:
        raise ConfigError("--gpus and --per-gpu must be positive")
    need = gpus * per_gpu
    fraction = (
        1.0 if local_room is None or dataset_bytes <= 0 else min(1.0, local_room / dataset_bytes)
    )
    verdicts = _tier_verdicts(measured, need=need, fraction=fraction, shared_configured=shared_configured)
    bottleneck, verdict = _verdict(verdicts, gpus=gpus, per_gpu=per_gpu)
    return BenchReport(
        dataset=dataset,
        gpus=gpus,
        per_gpu=per_gpu,
        dataset_bytes=dataset_bytes,
        local_fraction=fraction,
        tiers=tuple(verdicts),
        bottleneck=bottleneck,
        verdict=verdict,
    )


def _tier_verdicts(
    measured: dict[str, float | None], *, need: float, fraction: float, shared_configured: bool
) -> list[TierVerdict]:
    """Each tier's share of the job: the local tier its ``fraction``, the next tier down the rest."""
    below = need * (1.0 - fraction)
    return [
        TierVerdict(
            "origin",
            measured.get("origin"),
            0.0 if shared_configured else below,
            need,
            "first reads of every shard"
            + ("" if shared_configured else "; the rest of each epoch"),
        ),
        TierVerdict(
            "shared",
            measured.get("shared"),
            below if shared_configured else 0.0,
            need if shared_configured else 0.0,
            "what the local tier cannot hold" if shared_configured else "not configured",
        ),
        TierVerdict(
            "local",
            measured.get("local"),
            need * fraction,
            0.0,
            "holds all of the dataset" if fraction >= 1 else f"holds {fraction:.0%} of the dataset",
        ),
    ]


def _verdict(verdicts: list[TierVerdict], *, gpus: int, per_gpu: float) -> tuple[str | None, str]:
    """The bottleneck (None: none) and the sentence that answers the question."""
    need = gpus * per_gpu
    short = [v for v in verdicts if v.need > 0 and v.measured is not None and v.measured < v.need]
    bottleneck = None
    if short:
        worst = min(short, key=lambda v: (v.measured or 0.0) / v.need)
        bottleneck = worst.tier
        verdict = (
            f"NO: the {worst.tier} tier delivers {gbps(worst.measured)} "
            f"of the {gbps(worst.need)} "
            f"{gpus} GPUs need from it; it is the bottleneck"
        )
    else:
        verdict = f"YES: this node can feed {gpus} GPUs at {gbps(per_gpu)} each ({gbps(need)})"
        cold_short = [v for v in verdicts if v.meets_cold is False]
        if cold_short:
            first = cold_short[0]  # the origin before the shared tier: where a cold read goes first
            verdict += (
                f", once the dataset is warm; a cold first epoch reads the {first.tier} at "
                f"{gbps(first.measured)}: run 'datacache warm' before training"
            )
    return bottleneck, verdict


def format_bench(report: BenchReport) -> str:
    """The report as a table, one line per tier, then the verdict."""
    lines = [
        f"bench {report.dataset}: {report.gpus} GPUs x {gbps(report.per_gpu)} = "
        f"{gbps(report.need)} needed"
        + (
            f" (dataset {format_bytes(report.dataset_bytes)}, "
            f"local tier holds {report.local_fraction:.0%})"
            if report.dataset_bytes
            else ""
        ),
        f"{'TIER':<8} {'MEASURED':>12} {'NEED':>12} {'OK':<4} {'COLD EPOCH':>12} {'OK':<4} NOTE",
    ]
    by_tier = {m.tier: m for m in report.measurements}
    for verdict in report.tiers:
        measurement = by_tier.get(verdict.tier)
        note = verdict.note
        if measurement is not None:
            m = measurement
            note += f" ({m.readers} readers, {m.files} shards, {m.seconds:.1f}s)"
        elif verdict.tier != "shared" or verdict.note != "not configured":
            note += " (not measured)"
        # Each need beside its own answer: a tier idle once warm can still starve a cold epoch.
        lines.append(
            f"{verdict.tier:<8} {gbps(verdict.measured):>12} {gbps(verdict.need):>12} "
            f"{_yes_no(verdict.meets):<4} {gbps(verdict.cold_need) if verdict.cold_need else '-':>12} "
            f"{_yes_no(verdict.meets_cold):<4} {note}"
        )
    lines.append(f"bottleneck: {report.bottleneck or 'none'}")
    lines.append(report.verdict)
    return "\n".join(lines) + "\n"


def _yes_no(meets: bool | None) -> str:
    return "-" if meets is None else "yes" if meets else "NO"
