"""`datacache warm` against `aws s3 cp --recursive` on the same data, in one run.

Generates ~500 MB of shards (40 x 12 MB by default), puts them into a local
moto S3 server (started as tests/s3server.py starts it) and into a local
folder, then times, end to end as a user would run them:

- ``datacache warm s3://...``  (origin: the S3 server)
- ``datacache warm file://...`` (origin: the local folder)
- ``aws s3 cp --recursive s3://... DIR --endpoint-url ...``

Each is run ``--repeat`` times into an empty destination; the table shows the
median MB/s (decimal MB, wall-clock time of the whole command including its
start-up), and for warm also the rate it reports for the transfer alone.

Run: ``.venv/bin/python benchmarks/warm_vs_awscli.py [--shards 40] [--shard-mb 12]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@dataclass
class Result:
    """One tool on one source: wall-clock MB/s per run, and the rate warm itself reported."""

    tool: str
    source: str
    rates: list[float]
    reported: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.rates)


def start_s3_server() -> tuple[subprocess.Popen[bytes], str]:
    process = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "s3server.py")],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert process.stdout is not None
    port = process.stdout.readline().decode().strip()
    if not port.isdigit():
        process.kill()
        raise RuntimeError(f"the S3 server did not start (printed {port!r})")
    return process, f"http://127.0.0.1:{port}"


def make_data(origin: Path, endpoint: str, bucket: str, shards: int, shard_bytes: int) -> None:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    client.create_bucket(Bucket=bucket)
    origin.mkdir(parents=True)
    for index in range(shards):
        data = os.urandom(shard_bytes)
        key = f"shard-{index:05d}.tar"
        (origin / key).write_bytes(data)
        client.put_object(Bucket=bucket, Key=f"ds/{key}", Body=data)
    client.close()


def timed(command: list[str], env: dict[str, str]) -> tuple[float, str]:
    started = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO, check=False)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stderr[-2000:]}")
    return seconds, result.stdout


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and p.suffix == ".tar")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=40)
    parser.add_argument("--shard-mb", type=float, default=12.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=None, help="datacache warm --concurrency")
    args = parser.parse_args()

    shard_bytes = int(args.shard_mb * 1e6)
    total = args.shards * shard_bytes
    work = Path(tempfile.mkdtemp(prefix="datacache-bench-"))
    server, endpoint = start_s3_server()
    try:
        origin = work / "origin"
        bucket = "bench"
        print(f"generating {args.shards} x {args.shard_mb} MB = {total / 1e6:.0f} MB ...", file=sys.stderr)
        make_data(origin, endpoint, bucket, args.shards, shard_bytes)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DATACACHE_", "AWS_", "FSSPEC_"))}
        env.update(
            {
                "HOME": str(work / "home"),
                "XDG_CACHE_HOME": str(work / "home" / ".cache"),
                "XDG_CONFIG_HOME": str(work / "home" / ".config"),
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true",
            }
        )
        extra = ["--concurrency", str(args.concurrency)] if args.concurrency else []
        dest = work / "dest"
        cases = [
            (
                "datacache warm",
                "S3 (moto, 127.0.0.1)",
                [*map(str, [BIN / "datacache", "warm", f"s3://{bucket}/ds", "--json", "--local-dir", dest]), *extra],
                {"AWS_ENDPOINT_URL": endpoint},
            ),
            (
                "datacache warm",
                "file:// (local folder)",
                [*map(str, [BIN / "datacache", "warm", f"file://{origin}", "--json", "--local-dir", dest]), *extra],
                {},
            ),
            (
                "aws s3 cp --recursive",
                "S3 (moto, 127.0.0.1)",
                [
                    *map(str, [BIN / "aws", "s3", "cp", "--recursive", "--quiet", f"s3://{bucket}/ds", dest]),
                    "--endpoint-url",
                    endpoint,
                ],
                {},
            ),
        ]
        results = []
        for tool, source, command, extra_env in cases:
            result = Result(tool, source, [], [])
            for _ in range(args.repeat):
                shutil.rmtree(dest, ignore_errors=True)
                subprocess.run(["sync"], check=False)
                seconds, stdout = timed(command, {**env, **extra_env})
                moved = directory_bytes(dest)
                if moved != total:
                    raise RuntimeError(f"{tool} from {source}: {moved} bytes in the destination, expected {total}")
                result.rates.append(total / seconds / 1e6)
                if tool.startswith("datacache"):
                    done = json.loads(stdout.strip().splitlines()[-1])
                    result.reported.append(done["rate_bytes_per_s"] / 1e6)
                print(f"{tool} from {source}: {total / seconds / 1e6:.1f} MB/s", file=sys.stderr)
            results.append(result)
    finally:
        server.terminate()
        server.wait(timeout=10)
        if server.stdout is not None:
            server.stdout.close()
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"\n{args.shards} shards x {args.shard_mb:g} MB = {total / 1e6:.0f} MB; median of {args.repeat} runs; "
        f"{os.cpu_count()} CPUs\n"
    )
    print("| command | origin | MB/s (wall clock, whole command) | MB/s (transfer, as warm reports) |")
    print("|---|---|---|---|")
    for result in results:
        reported = f"{statistics.median(result.reported):.1f}" if result.reported else "-"
        print(f"| `{result.tool}` | {result.source} | {result.median:.1f} | {reported} |")


if __name__ == "__main__":
    main()
