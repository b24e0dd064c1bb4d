"""One training process of the load tests: a DataLoader over the dataset, as rank RANK of WORLD_SIZE.

Run as ``python _reader.py SPEC_JSON``; prints one JSON line: the mode, a
digest of every sample it delivered, and its peak memory (its own and its
worker processes').
"""

from __future__ import annotations

import hashlib
import json
import resource
import sys

from datacache.loaders import CachedIterableDataset
from torch.utils.data import DataLoader

from datacache.config import DatasetConfig, load_settings


def main() -> None:
    spec = json.loads(sys.argv[1])
    settings = load_settings()
    config = DatasetConfig(name=spec["name"], url=spec["url"], storage_options=spec.get("options", {}))
    dataset = CachedIterableDataset(config, config=settings, seed=spec["seed"], shuffle_buffer=64)
    loader = DataLoader(dataset, batch_size=None, num_workers=spec["workers"])
    seen: dict[str, list[str]] = {}
    for sample in loader:
        seen.setdefault(str(sample["__key__"]), []).append(hashlib.sha256(bytes(sample["bin"])).hexdigest())
    stats = dataset.stats()
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    print(
        json.dumps(
            {
                "mode": stats.mode,
                "seen": seen,
                "samples": stats.samples,
                "peak_rss_kib": own,
                "worker_peak_rss_kib": workers,
            }
        )
    )


if __name__ == "__main__":
    main()
