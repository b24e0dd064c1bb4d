"""The daemon's origin allowlist, attacked by a client of another uid (issue 23 items 1, 2, 13).

The daemon runs as root (a real subprocess); alice is an allowed client that is not an
operator (`tests/_users.py`). HTTP origins are real servers on 127.0.0.1 that record every
request, so a test sees what the daemon fetched, not only what it answered.
"""

from __future__ import annotations

import http.server
import ipaddress
import os
import random
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _users
import pytest
from _daemon import make_shards
from _daemon_users import calls_as, error_code, serve_for
from _users import User

from datacache._protocol import config_to_wire
from datacache.config import DatasetConfig, canonical_origin, dataset_id_for, load_settings
from datacache.config import resolve_dataset as resolve
from datacache.daemon._http import Forbidden
from datacache.daemon._policy import OriginPolicy, canonical_url
from datacache.errors import ConfigError

users = _users.users  # the fixtures, by name
world_dir = _users.world_dir

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


class Site(http.server.ThreadingHTTPServer):
    """A static site on 127.0.0.1 serving ``root`` (directory listings as index pages), recording paths.

    ``redirect``: answer a request with 302 to what it returns for the request's path (None: serve it).
    """

    def __init__(self, root: Path, redirect: Callable[[str], str | None] | None = None) -> None:
        self.seen: list[str] = []
        site = self

        class Handler(http.server.SimpleHTTPRequestHandler):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, directory=str(root), **kwargs)

            def send_head(self) -> Any:
                site.seen.append(self.path)
                target = redirect(self.path) if redirect is not None else None
                if target is not None:
                    self.send_response(302)
                    self.send_header("Location", target)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                return super().send_head()

            def log_message(self, *args: Any) -> None:
                return

        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def sites() -> Iterator[list[Site]]:
    running: list[Site] = []
    yield running
    for site in running:
        site.shutdown()
        site.server_close()


def start(sites: list[Site], root: Path, redirect: Callable[[str], str | None] | None = None) -> Site:
    site = Site(root, redirect)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    sites.append(site)
    return site


@pytest.fixture
def base_env(cache_env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in cache_env.items() if not k.startswith("AWS_")}


# -- item 1: one canonical form; dot segments never lead out of an allowed prefix --------------


def test_dot_segments_resolve_after_percent_decoding_for_every_scheme() -> None:
    for spelling in (
        "http://h/ok/../private/",
        "http://h/ok/%2e%2e/private/",
        "http://h/ok/%2E./private",
        "http://h/ok/./%2e/../private/",
        "http://h/%70rivate/",
    ):
        assert canonical_origin(spelling, env={}) == "http://h/private", spelling
        assert dataset_id_for(spelling, env={}) == dataset_id_for("http://h/private/", env={})
    assert canonical_url("s3a://bucket/ok/../secret/") == "s3://bucket/secret"
    assert canonical_url("s3://bucket/ok/%2E%2E/%2e%2e/../secret") == "s3://bucket/secret"


@pytest.mark.parametrize(
    "url",
    [
        "http://h/ok/../private/",
        "http://h/ok/%2e%2e/private/",
        "https://h/ok/.%2E/private/",
        "http://h/ok/./x/",
        "http://h/ok%2f..%2fprivate/",
        "s3a://bucket/ok/../secret/",
        "s3://bucket/ok/%2e%2e/secret/",
        "gs://bucket/ok/..",
        "file:///data/ok/%2e%2e/private/",
    ],
)
def test_a_url_that_could_fetch_something_else_than_it_names_is_refused(url: str) -> None:
    policy = OriginPolicy(prefixes=("http://h/ok/", "s3://bucket/ok/", "gs://bucket/ok/", "file:///data/ok/"))
    for operator in (False, True):
        with pytest.raises(Forbidden, match="dot segments resolved"):
            policy.admit(DatasetConfig(name="x", url=url), {}, configured=False, operator=operator)
    from datacache.config import check_origin_form

    with pytest.raises(ConfigError, match="dot segments resolved"):
        check_origin_form(url)
    with pytest.raises(ConfigError, match="dot segments resolved"):
        resolve(url, load_settings({}))

    policy = OriginPolicy(prefixes=("http://h/ok/", "s3://bucket/ok/", "file:///data/"))
    for url in ("http://h/ok/a.b/..c/...", "s3://bucket/ok/x.tar", "s3a://bucket/ok/", "file:///data/ok/../y/"):
        policy.admit(DatasetConfig(name="x", url=url), {}, configured=False, operator=False)


def test_dot_segments_never_lead_the_daemon_out_of_an_allowed_http_prefix(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str], sites: list[Site]
) -> None:
    root = world_dir / "site"
    make_shards(root / "ok", 2, 10_000, seed=1)
    make_shards(root / "private", 2, 10_000, seed=2)
    site = start(sites, root)
    daemon = serve_for(users, world_dir, base_env, "--allow-dataset", f"{site.url}/ok/")
    try:
        attacks = [
            ("POST", "/v1/open", {"dataset": f"{site.url}/ok/../private/"}),
            ("POST", "/v1/open", {"dataset": f"{site.url}/ok/%2e%2e/private/"}),
            ("POST", "/v1/open", {"dataset": f"{site.url}/ok/%2E%2e/private/"}),
            ("POST", "/v1/open", {"dataset": {"name": "x", "url": f"{site.url}/ok/%2e%2e/private/"}}),
            ("POST", "/v1/warm", {"dataset": f"{site.url}/ok/./../private/"}),
        ]
        for (_, _, body), (status, reply) in zip(attacks, calls_as(users["alice"], daemon, *attacks), strict=True):
            assert (status, error_code(reply)) == (403, "forbidden"), (body, status, reply)
        assert not [path for path in site.seen if "private" in path], site.seen
        ((status, reply),) = calls_as(users["alice"], daemon, ("POST", "/v1/open", {"dataset": f"{site.url}/ok/"}))
        assert status == 200 and reply["shards"] == 2, reply  # the allowed prefix is served
    finally:
        daemon.kill()


# -- item 2: no SSRF through a redirect --------------------------------------------------------


def test_the_daemon_follows_no_redirect_out_of_what_a_client_opened(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str], sites: list[Site]
) -> None:
    make_shards(world_dir / "secret" / "ok", 2, 10_000, seed=3)
    secret = start(sites, world_dir / "secret")  # a loopback service nobody allowed
    make_shards(world_dir / "public" / "ok", 2, 10_000, seed=4)
    make_shards(world_dir / "public" / "private", 2, 10_000, seed=5)
    # Allowed hosts that answer 302: to another host, and out of the allowed prefix on the same host.
    away = start(sites, world_dir / "public", redirect=lambda path: secret.url + path)
    out = start(sites, world_dir / "public", redirect=lambda p: p.replace("/ok", "/private") if "/ok" in p else None)
    # ... and one whose redirects stay inside the dataset's URL (a directory's missing "/", a moved shard).
    inside = start(
        sites, world_dir / "public", redirect=lambda p: "/ok/shard-0001.tar" if p.endswith("0000.tar") else None
    )
    daemon = serve_for(
        users, world_dir, base_env, *(a for s in (away, out, inside) for a in ("--allow-dataset", f"{s.url}/ok/"))
    )
    try:
        for site in (away, out):
            for verb in ("open", "warm"):
                ((status, reply),) = calls_as(
                    users["alice"], daemon, ("POST", f"/v1/{verb}", {"dataset": f"{site.url}/ok/"})
                )
                assert "redirects" in str(reply) and "outside the dataset's URL" in str(reply), reply
        assert away.seen and secret.seen == []  # the redirect was asked for, never followed
        assert not [path for path in out.seen if "private" in path], out.seen
        assert not [p for p in (world_dir / "cache").rglob("shard-*") if p.is_file()]
        url = f"{inside.url}/ok/"
        shard = {"dataset": dataset_id_for(url), "key": "shard-0001.tar"}
        (status, reply), (status2, location) = calls_as(
            users["alice"], daemon, ("POST", "/v1/open", {"dataset": url}), ("POST", "/v1/ensure", shard)
        )
        assert status == 200 and reply["shards"] == 2, reply  # redirects inside the dataset's URL are followed
        assert (
            status2 == 200
            and Path(location["path"]).read_bytes() == (world_dir / "public/ok/shard-0001.tar").read_bytes()
        )
    finally:
        daemon.kill()


# -- item 13: an allowed prefix ends at a path boundary ----------------------------------------


def test_an_allowed_prefix_does_not_admit_a_neighbour_that_shares_its_spelling() -> None:
    for prefix in ("s3://b/public/", "s3://b/public"):
        policy = OriginPolicy(prefixes=(prefix,))
        for url in ("s3://b/public/", "s3://b/public/x/", "s3://b/public"):
            policy.admit(DatasetConfig(name="x", url=url), {}, configured=False, operator=False)
        for url in ("s3://b/public-secret/", "s3://b/publicity/x", "s3://b/public.bak/"):
            with pytest.raises(Forbidden, match="allowed"):
                policy.admit(DatasetConfig(name="x", url=url), {}, configured=False, operator=False)


def test_the_daemon_serves_an_allowed_root_but_not_its_neighbour(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str]
) -> None:
    data = world_dir / "data"
    make_shards(data / "public", 2, 10_000, seed=1)
    make_shards(data / "public-secret", 2, 10_000, seed=2)
    daemon = serve_for(users, world_dir, base_env, "--allow-dataset", f"file://{data}/public/")
    try:
        neighbour, allowed = calls_as(
            users["alice"],
            daemon,
            ("POST", "/v1/open", {"dataset": f"file://{data}/public-secret/"}),
            ("POST", "/v1/open", {"dataset": f"file://{data}/public/"}),
        )
        assert (neighbour[0], error_code(neighbour[1])) == (403, "forbidden"), neighbour
        assert allowed[0] == 200 and allowed[1]["shards"] == 2, allowed
    finally:
        daemon.kill()


# -- item 2 with a public host: an address in a network namespace of its own -------------------

_PUBLIC_SITE = r"""
import http.server, sys
address, root, secret = sys.argv[1], sys.argv[2], sys.argv[3]

class Handler(http.server.SimpleHTTPRequestHandler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, directory=root, **kwargs)

    def send_head(self):
        if self.path.startswith("/ok"):  # the allowed host sends the daemon to the node's loopback
            self.send_response(302)
            self.send_header("Location", secret + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        return super().send_head()

    def log_message(self, *args):
        return

server = http.server.ThreadingHTTPServer((address, 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


@pytest.fixture
def public_address() -> Iterator[tuple[str, Callable[[list[str]], subprocess.Popen[str]]]]:
    """An address outside loopback and link-local (198.18.0.0/15), on a veth into a network namespace.

    Yields the address and a way to start a process inside the namespace. Only root can make it.
    """
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make a network namespace")
    name = f"dct{uuid.uuid4().hex[:8]}"
    block = random.Random(name).randrange(1 << 15) * 4  # a /30 of 198.18.0.0/15, by chance
    base = int(ipaddress.IPv4Address("198.18.0.0")) + block
    near, far = str(ipaddress.IPv4Address(base + 1)), str(ipaddress.IPv4Address(base + 2))
    steps = [
        ["ip", "netns", "add", name],
        ["ip", "link", "add", f"{name}a", "type", "veth", "peer", "name", f"{name}b"],
        ["ip", "link", "set", f"{name}b", "netns", name],
        ["ip", "addr", "add", f"{near}/30", "dev", f"{name}a"],
        ["ip", "link", "set", f"{name}a", "up"],
        ["ip", "netns", "exec", name, "ip", "addr", "add", f"{far}/30", "dev", f"{name}b"],
        ["ip", "netns", "exec", name, "ip", "link", "set", f"{name}b", "up"],
    ]
    processes: list[subprocess.Popen[str]] = []
    try:
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                pytest.skip(f"cannot make a network namespace here: {' '.join(step)}: {done.stderr.strip()}")

        def start_inside(argv: list[str]) -> subprocess.Popen[str]:
            process = subprocess.Popen(["ip", "netns", "exec", name, *argv], stdout=subprocess.PIPE, text=True)
            processes.append(process)
            return process

        yield far, start_inside
    finally:
        for process in processes:
            process.kill()
            process.wait()
            if process.stdout is not None:
                process.stdout.close()  # else its pipe is closed by the collector, in some later test
        subprocess.run(["ip", "link", "del", f"{name}a"], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def test_a_public_host_cannot_redirect_the_daemon_to_its_loopback(
    users: dict[str, User],
    world_dir: Path,
    base_env: dict[str, str],
    sites: list[Site],
    public_address: tuple[str, Callable[[list[str]], subprocess.Popen[str]]],
) -> None:
    """The issue's attack: ``--allow-dataset http://`` (public hosts only), a public host answers 302."""
    make_shards(world_dir / "secret" / "ok", 2, 10_000, seed=6)
    secret = start(sites, world_dir / "secret")  # the node's loopback service
    make_shards(world_dir / "public" / "plain", 2, 10_000, seed=7)
    address, start_inside = public_address
    site = start_inside([sys.executable, "-c", _PUBLIC_SITE, address, str(world_dir / "public"), secret.url])
    assert site.stdout is not None
    public = f"http://{address}:{int(site.stdout.readline())}"
    daemon = serve_for(users, world_dir, base_env, "--allow-dataset", "http://")
    try:
        redirected, direct, plain = calls_as(
            users["alice"],
            daemon,
            ("POST", "/v1/open", {"dataset": f"{public}/ok/"}),
            ("POST", "/v1/open", {"dataset": f"{secret.url}/ok/"}),
            ("POST", "/v1/open", {"dataset": f"{public}/plain/"}),
        )
        assert "outside the dataset's URL" in str(redirected[1]), redirected
        assert (direct[0], error_code(direct[1])) == (403, "forbidden"), direct  # loopback, named directly
        assert secret.seen == []  # neither way reached it
        assert plain[0] == 200 and plain[1]["shards"] == 2, plain  # a public host that does not redirect
    finally:
        daemon.kill()


def test_a_url_equal_to_a_configured_datasets_url_is_that_dataset_through_the_daemon(
    users: dict[str, User], world_dir: Path, base_env: dict[str, str]
) -> None:
    """Names are aliases of the origin (issue 34 item 3): a script that passes the URL works on Slurm too.

    Before, ``a-wds = { url = ... }`` configured, its URL was refused to another uid as
    "neither configured in this daemon nor under a prefix".
    """
    data = world_dir / "data"
    make_shards(data / "a-wds", 2, 10_000, seed=1)
    make_shards(data / "other", 2, 10_000, seed=2)
    config = world_dir / "daemon.toml"
    # Declared shared with alice (issue 33's access rule): undeclared, she would first prove the origin answers her.
    readers = users["alice"].name
    config.write_text(f'[datasets]\na-wds = {{ url = "file://{data}/a-wds/", readers = ["{readers}"] }}\n')
    daemon = serve_for(users, world_dir, base_env, "--config", str(config))
    # What a client without the node's config sends for the URL (the Kubernetes sidecar's trainer).
    bare = load_settings({}, overrides={"local_dir": str(world_dir / "probe")})
    wire = config_to_wire(resolve(f"file://{data}/a-wds/", bare))
    try:
        replies = calls_as(
            users["alice"],
            daemon,
            ("POST", "/v1/open", {"dataset": "a-wds"}),
            ("POST", "/v1/open", {"dataset": f"file://{data}/a-wds/"}),
            ("POST", "/v1/open", {"dataset": f"{data}//a-wds"}),  # another spelling of the same origin
            ("POST", "/v1/open", {"dataset": wire}),
            ("POST", "/v1/open", {"dataset": f"file://{data}/other/"}),
        )
    finally:
        daemon.kill()
    *same, other = replies
    assert [status for status, _ in same] == [200] * 4, same
    assert len({reply["dataset_id"] for _, reply in same}) == 1, same
    assert (other[0], error_code(other[1])) == (403, "forbidden"), other
