"""How `datacache top` shows a frame: the plain text one (``--once``) and the rich live view's.

A frame is the plain dict `datacache.cli._top.Sampler` reads; nothing here reads the node.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from datacache.sizes import format_bytes

__all__ = [
    "BETWEEN_EPOCHS_GRACE",
    "SORTS",
    "KeptClients",
    "View",
    "name_datasets",
    "rich_frame",
    "sort_clients",
    "text_frame",
]

SORTS: dict[str, tuple[str, Callable[[dict[str, Any]], Any]]] = {
    "c": ("client", lambda c: (c.get("rank", -1), c.get("worker", -1), c["client"])),
    "u": ("user", lambda c: str(c.get("user") or c.get("uid"))),
    "d": ("dataset", lambda c: str(c.get("dataset_name") or c.get("dataset") or "")),
    "b": ("MB/s", lambda c: c.get("delivered_bytes_per_s", 0.0)),
    "p": ("samples/s", lambda c: c.get("samples_per_s", 0.0)),
    "s": ("stall", lambda c: c.get("stall_fraction", 0.0)),
    "f": ("depth", lambda c: c.get("prefetch_depth", 0)),
    "h": ("local hits", lambda c: c["hit_share"]["local"]),
}


BETWEEN_EPOCHS_GRACE = 20.0
"""Seconds a client that stopped reporting is still shown, as between epochs: torch's DataLoader ends its
workers at an epoch's end and starts new ones, which report only once they have read (a few seconds)."""


def name_datasets(clients: list[dict[str, Any]], names: dict[str, str]) -> None:
    """Give each client row ``dataset_name``: the name its reader opened it by, else ``names[id]`` (configured)."""
    for client in clients:
        if not client.get("dataset_name") and str(client.get("dataset")) in names:
            client["dataset_name"] = names[str(client.get("dataset"))]


class KeptClients:
    """Clients seen lately that stopped reporting, kept for `BETWEEN_EPOCHS_GRACE` seconds, marked between epochs.

    A reader whose process ended is dropped by the daemon (and its report file by top): between an epoch's
    last workers and the next epoch's first reports the node would show no client at all. A newer epoch of
    the same rank replaces them (`_top.current_epoch`).
    """

    def __init__(self, grace: float = BETWEEN_EPOCHS_GRACE) -> None:
        self.grace = grace
        self._seen: dict[str, tuple[float, dict[str, Any]]] = {}

    def merged(self, clients: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
        """``clients`` and the recently seen ones now missing (``between_epochs``)."""
        present = {str(c["client"]) for c in clients}
        for client in clients:
            self._seen[str(client["client"])] = (now, {**client, "between_epochs": True})
        kept = []
        for name, (seen, row) in list(self._seen.items()):
            if name in present:
                continue
            if now - seen > self.grace:
                del self._seen[name]
            else:
                kept.append({**row, "seconds_since_report": round(now - seen, 3)})
        return [*clients, *kept]


def _dataset(row: dict[str, Any]) -> Any:
    return row.get("dataset_name") or row.get("dataset")


def _mbps(value: float | None) -> str:
    return "-" if value is None else f"{value / 1e6:.1f}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _bar(share: float, width: int) -> str:
    filled = round(max(0.0, min(1.0, share)) * width)
    return "#" * filled + "." * (width - filled)


def _hits(shares: dict[str, float]) -> str:
    """Hit share per tier as one bar: L local, S shared, O origin."""
    width = 10
    local = round(shares["local"] * width)
    shared = min(width - local, round(shares["shared"] * width))
    origin = width - local - shared if sum(shares.values()) else 0
    bar = "L" * local + "S" * shared + "O" * origin
    bar = bar.ljust(width, ".")
    return f"{bar} {100 * shares['local']:3.0f}/{100 * shares['shared']:.0f}/{100 * shares['origin']:.0f}"


def sort_clients(clients: list[dict[str, Any]], key: str, reverse: bool) -> list[dict[str, Any]]:
    _, value = SORTS[key]
    return sorted(clients, key=value, reverse=reverse)


def _label(client: dict[str, Any]) -> str:
    between = client.get("between_epochs")
    if "remote_workers" in client:  # a rank whose batches a remote pool makes (remote=)
        pool = f"{client['remote_workers']}/{client.get('remote_max_workers', '?')}"
        return f"r{client['rank']} pool {pool}" + (" between epochs" if between else f" pid {client.get('pid')}")
    if "rank" in client:  # between epochs its pid is gone: the words fit the column instead
        reader = f"r{client['rank']}/w{client.get('worker', 0)}"
        return f"{reader} between epochs" if between else f"{reader} pid {client.get('pid')}"
    return f"{client['client']} (between epochs)" if between else str(client["client"])


def _short(text: Any, width: int) -> str:
    value = str(text if text is not None else "-")
    return value if len(value) <= width else value[: width - 1] + "~"


def header_lines(frame: dict[str, Any]) -> list[str]:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(frame["time"]))
    daemon = frame["daemon"]
    if frame["source"] == "daemon":
        how = f"through the daemon on {daemon['socket']} (pid {daemon.get('pid')})"
    else:
        how = "embedded: this node's catalog and readers' report files"
    lines = [f"datacache top - {frame['host']} - {stamp} - {how}"]
    if daemon.get("error"):
        lines.append(
            f"! the daemon on {daemon['socket']} is not answering ({daemon['error']}); "
            f"retrying every {frame['interval_s']:g}s"
        )
    if frame.get("error"):
        lines.append(f"! {frame['error']}")
    if not frame.get("operator"):
        who = "root or the daemon's user" if frame["source"] == "daemon" else "root"
        lines.append(f"(your own clients only: {who} sees everyone's)")
    return lines


def text_frame(frame: dict[str, Any], *, sort: str = "c", reverse: bool = False) -> str:
    """One frame as plain text (``--once``, and the live view without rich)."""
    out = [*header_lines(frame), ""]
    out += _text_clients(sort_clients(frame["clients"], sort, reverse))
    out += own_staging_lines(frame["clients"])
    out += _text_ranks(frame["ranks"])
    out += ["", *_text_tiers(frame["tiers"]), ""]
    transfers = frame["transfers"]
    out.append(f"TRANSFERS IN FLIGHT: {len(transfers)}")
    for t in transfers[:8]:
        done = _progress(t, 12)
        out.append(f"  {_short(t['dataset'], 20)}/{_short(t['key'], 30):<30} {t['source']}->{t['tier']:<7} {done}")
    policies = frame["policies"]
    if policies:
        out.append("EVICTION POLICY: " + ", ".join(f"{_short(d, 24)}: {p}" for d, p in sorted(policies.items())))
    return "\n".join(out) + "\n"


def _text_clients(clients: list[dict[str, Any]]) -> list[str]:
    out = [
        f"{'CLIENT':<22} {'USER':<10} {'DATASET':<20} {'EP':>3} {'MB/s':>8} {'TARGET':>8} "
        f"{'SAMPLES/s':>10} {'STALL':>6} {'DEPTH':>5}  HITS local/shared/origin %"
    ]
    for c in clients:
        out.append(
            f"{_short(_label(c), 22):<22} {_short(c.get('user') or c.get('uid'), 10):<10} "
            f"{_short(_dataset(c), 20):<20} {c.get('epoch', '-'):>3} "
            f"{_mbps(c.get('delivered_bytes_per_s')):>8} {_mbps(c.get('target_share_bytes_per_s')):>8} "
            f"{c.get('samples_per_s', 0.0):>10.1f} {_percent(c.get('stall_fraction')):>6} "
            f"{c.get('prefetch_depth', 0):>5}  {_hits(c['hit_share'])}"
        )
    if not clients:
        out.append("(no client is reading on this node)")
    return out


def own_staging_lines(clients: list[dict[str, Any]]) -> list[str]:
    """Readers whose own process staged shards (the daemon away, or a dataset it does not serve them)."""
    own = [c for c in clients if c.get("own_bytes_in") or c.get("own_transfers")]
    if not own:
        return []
    out = ["", "STAGED BY THE READER'S OWN PROCESS, NOT THROUGH THE DAEMON:"]
    for c in own:
        out.append(
            f"  {_short(_label(c), 22):<22} {_short(c.get('user') or c.get('uid'), 10):<10} "
            f"{_short(_dataset(c), 20):<20} {format_bytes(int(c.get('own_bytes_in') or 0))} staged, "
            f"{int(c.get('own_transfers') or 0)} in flight ({c.get('mode', '?')})"
        )
    return out


def _text_ranks(ranks: list[dict[str, Any]]) -> list[str]:
    if not ranks:
        return []
    out = [
        "",
        f"{'RANK':<6} {'USER':<10} {'DATASET':<20} {'READERS':>7} {'SAMPLES':>9} {'MB/s':>8} "
        f"{'TARGET':>8} {'WAIT':>5} {'DEPTH':>5}  HITS local/shared/origin %",
    ]
    for r in ranks:
        target = _mbps(r["target_bandwidth"]) if r["target_bandwidth"] else "-"
        flag = "" if r["meets_target"] is None else (" ok" if r["meets_target"] else " LOW")
        out.append(
            f"{r['rank']:<6} {_short(r['user'] or r['uid'], 10):<10} {_short(_dataset(r), 20):<20} "
            f"{r['readers']:>7} {r['samples']:>9} {_mbps(r['bytes_per_second']):>8} {target + flag:>8} "
            f"{_percent(r['reader_wait_fraction']):>5} {r['prefetch_depth']:>5}  {_hits(r['hit_ratio'])}"
        )
    return out


def _text_tiers(tiers: list[dict[str, Any]]) -> list[str]:
    out = [f"{'TIER':<7} {'USAGE':<38} {'SHARDS':>7} {'IN MB/s':>8} {'OUT MB/s':>9} {'EVICT/s':>8} {'DECLINE/s':>9}"]
    for t in tiers:
        if t["tier"] == "origin":
            usage = ""
        else:
            capacity = t.get("capacity_bytes")
            used = int(t.get("used_bytes", 0))
            if capacity:
                usage = f"[{_bar(used / capacity, 12)}] {format_bytes(used)} / {format_bytes(capacity)}"
            else:
                usage = f"{format_bytes(used)} (unbounded)"
        shards = t.get("shards", "")
        out.append(
            f"{t['tier']:<7} {usage:<38} {shards!s:>7} {_mbps(t.get('bytes_in_per_s')):>8} "
            f"{_mbps(t.get('bytes_out_per_s')):>9} {_rate(t.get('evictions_per_s')):>8} "
            f"{_rate(t.get('declines_per_s')):>9}"
        )
    return out


def _progress(transfer: dict[str, Any], width: int) -> str:
    progress = transfer.get("progress")
    if progress is None:
        return format_bytes(transfer["bytes"])
    if progress >= 1.0:
        return f"[{_bar(1.0, width)}] all bytes in: verifying, writing"
    return f"[{_bar(progress, width)}] {100 * progress:3.0f}% of {format_bytes(transfer['size'])}"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


@dataclass
class View:
    """The live view's sort key and direction, changed by key presses."""

    sort: str = "c"
    reverse: bool = False


def rich_frame(frame: dict[str, Any], view: View) -> Any:
    """The live view's screen: the plain frame's tables as rich tables, bars coloured."""
    from rich.console import Group
    from rich.text import Text

    parts: list[Any] = [
        Text(line, style="bold red" if line.startswith("!") else "bold") for line in header_lines(frame)
    ]
    parts += [Text(""), _rich_clients(frame["clients"], view)]
    if not frame["clients"]:
        parts.append(Text("(no client is reading on this node)", style="dim"))
    parts += [Text(line, style="bold" if line.isupper() else "") for line in own_staging_lines(frame["clients"])]
    if frame["ranks"]:
        parts += [Text(""), _rich_ranks(frame["ranks"])]
    parts += [Text(""), _rich_tiers(frame["tiers"]), Text("")]
    transfers = frame["transfers"]
    parts.append(Text(f"TRANSFERS IN FLIGHT: {len(transfers)}", style="bold"))
    for t in transfers[:8]:
        done = _progress(t, 20)
        where = f"{_short(t['dataset'], 20)}/{_short(t['key'], 30):<30} {t['source']}->{t['tier']:<7}"
        parts.append(Text(f"  {where} {done}"))
    if frame["policies"]:
        parts.append(Text("EVICTION POLICY: " + ", ".join(f"{d}: {p}" for d, p in sorted(frame["policies"].items()))))
    name, _ = SORTS[view.sort]
    keys = " ".join(f"{key} {label}" for key, (label, _) in SORTS.items())
    parts.append(Text(f"\nq quit   sort: {keys}   r reverse   (sorted by {name})", style="dim"))
    return Group(*parts)


def _rich_clients(clients: list[dict[str, Any]], view: View) -> Any:
    from rich.table import Table
    from rich.text import Text

    table = Table(expand=True, box=None, header_style="reverse")
    for column, keyed in (
        ("CLIENT", "c"),
        ("USER", "u"),
        ("DATASET", "d"),
        ("EP", ""),
        ("MB/s", "b"),
        ("TARGET", ""),
        ("SAMPLES/s", "p"),
        ("STALL", "s"),
        ("DEPTH", "f"),
        ("HITS local/shared/origin", "h"),
    ):
        arrow = (" v" if view.reverse else " ^") if keyed == view.sort else ""
        table.add_column(f"{column}{arrow}", justify="left" if keyed in ("c", "u", "d", "h") else "right")
    for c in sort_clients(clients, view.sort, view.reverse):
        stall = float(c.get("stall_fraction", 0.0))
        table.add_row(
            _label(c),
            str(c.get("user") or c.get("uid")),
            _short(_dataset(c), 24),
            str(c.get("epoch", "-")),
            _mbps(c.get("delivered_bytes_per_s")),
            _mbps(c.get("target_share_bytes_per_s")),
            f"{c.get('samples_per_s', 0.0):.1f}",
            Text(_percent(stall), style="red" if stall > 0.2 else ""),
            str(c.get("prefetch_depth", 0)),
            _hit_text(c["hit_share"]),
        )
    return table


def _rich_ranks(ranks: list[dict[str, Any]]) -> Any:
    from rich.table import Table
    from rich.text import Text

    table = Table(expand=True, box=None, header_style="reverse")
    for column in ("RANK", "USER", "DATASET", "READERS", "SAMPLES", "MB/s", "TARGET", "WAIT", "DEPTH", "HITS"):
        table.add_column(column, justify="left" if column in ("RANK", "USER", "DATASET", "HITS") else "right")
    for r in ranks:
        low = r["meets_target"] is False
        table.add_row(
            str(r["rank"]),
            str(r["user"] or r["uid"]),
            _short(_dataset(r), 24),
            str(r["readers"]),
            str(r["samples"]),
            Text(_mbps(r["bytes_per_second"]), style="red" if low else ""),
            _mbps(r["target_bandwidth"]) if r["target_bandwidth"] else "-",
            _percent(r["reader_wait_fraction"]),
            str(r["prefetch_depth"]),
            _hit_text(r["hit_ratio"]),
        )
    return table


def _rich_tiers(tiers: list[dict[str, Any]]) -> Any:
    from rich.table import Table
    from rich.text import Text

    table = Table(expand=True, box=None, header_style="reverse")
    for column in ("TIER", "USAGE", "SHARDS", "IN MB/s", "OUT MB/s", "EVICT/s", "DECLINE/s"):
        table.add_column(column, justify="left" if column in ("TIER", "USAGE") else "right")
    for t in tiers:
        usage = Text("")
        if t["tier"] != "origin":
            capacity, used = t.get("capacity_bytes"), int(t.get("used_bytes", 0))
            if capacity:
                share = used / capacity
                usage = Text(
                    _bar(share, 20).replace("#", "\u2588").replace(".", "\u2591"),
                    style="red" if share > 0.95 else "green",
                )
                usage.append(f" {format_bytes(used)} / {format_bytes(capacity)}")
            else:
                usage = Text(f"{format_bytes(used)} (unbounded)")
        table.add_row(
            t["tier"],
            usage,
            str(t.get("shards", "")),
            _mbps(t.get("bytes_in_per_s")),
            _mbps(t.get("bytes_out_per_s")),
            _rate(t.get("evictions_per_s")),
            _rate(t.get("declines_per_s")),
        )
    return table


def _hit_text(shares: dict[str, float]) -> Any:
    from rich.text import Text

    width = 12
    local = round(shares["local"] * width)
    shared = min(width - local, round(shares["shared"] * width))
    origin = width - local - shared if sum(shares.values()) else 0
    text = Text()
    text.append("\u2588" * local, style="green")
    text.append("\u2588" * shared, style="yellow")
    text.append("\u2588" * origin, style="red")
    text.append("\u2591" * (width - local - shared - origin), style="dim")
    text.append(f" {100 * shares['local']:3.0f}/{100 * shares['shared']:.0f}/{100 * shares['origin']:.0f}")
    return text
