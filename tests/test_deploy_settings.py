"""The settings each deployed daemon really runs with, resolved the way the container resolves them.

For every deployment shape (the DaemonSet, the sidecar Job, the Helm chart in both modes, the
systemd unit): the image's ENV and files, the manifest's env and args, and the config files its
volumes mount over the image's, fed to `datacache serve`'s own argument parser and settings
merge (`datacache.cli.serve_settings`: flags over DATACACHE_* over the config file). Then the
checks an operator cares about: the local tier is on the NVMe/emptyDir volume (never the
container's read-only root filesystem), the socket is on the mount the training processes share,
and the capacity sits below the volume's size limit.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from test_deploy import DEPLOY, _quantity, dockerfile, dockerfile_env, render_chart

from datacache import cli
from datacache.config import Settings

# Files the image itself carries (deploy/Dockerfile's COPY into the image), by their path in it.
IMAGE_FILES = {"/etc/datacache/config.toml": DEPLOY / "config" / "image.toml"}


@dataclass
class Resolved:
    settings: Settings
    mounts: dict[str, dict[str, Any]]  # mountPath -> the pod's volume


def _under(path: PurePosixPath | Path, root: str) -> bool:
    return PurePosixPath(path) == PurePosixPath(root) or PurePosixPath(root) in PurePosixPath(path).parents


def _mount_of(path: Path, mounts: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    best = max((m for m in mounts if _under(path, m)), key=len, default=None)
    return None if best is None else (best, mounts[best])


def _image_entrypoint() -> tuple[list[str], list[str]]:
    entrypoint: list[str] = []
    command: list[str] = []
    for keyword, rest in dockerfile():
        if keyword == "ENTRYPOINT":
            entrypoint = json.loads(rest)
        elif keyword == "CMD":
            command = json.loads(rest)
    return entrypoint, command


def resolve_container(
    container: dict[str, Any], pod: dict[str, Any], configmaps: dict[str, dict[str, str]], tmp_path: Path
) -> Resolved:
    """Settings of ``container`` (a `datacache serve` container of ``pod``) as it would start."""
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {m["mountPath"]: {**volumes[m["name"]], "readOnly": m.get("readOnly", False)}
              for m in container.get("volumeMounts", [])}

    def file_in_container(path: str) -> Path:
        found = _mount_of(Path(path), mounts)
        if found is not None:  # a mount hides whatever the image had there
            mount, volume = found
            if "configMap" not in volume:
                raise FileNotFoundError(f"{path} is on the {volume['name']} volume, not a config map")
            key = str(PurePosixPath(path).relative_to(mount))
            local = tmp_path / volume["configMap"]["name"] / key
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(configmaps[volume["configMap"]["name"]][key])
            return local
        if path in IMAGE_FILES:
            return IMAGE_FILES[path]
        raise FileNotFoundError(f"{path}: not in the image")

    entrypoint, command = _image_entrypoint()
    argv = container.get("command") or entrypoint
    args = container.get("args", command if "command" not in container else [])
    argv = [*argv, *args]
    assert argv[:2] == ["datacache", "serve"], argv
    env = {**dockerfile_env(), **{item["name"]: item["value"] for item in container.get("env", [])}}
    env["HOME"] = "/nonexistent"
    parsed = cli.parse_args(argv[1:])
    if parsed.config:
        parsed.config = str(file_in_container(parsed.config))
    if "DATACACHE_CONFIG" in env:
        try:
            env["DATACACHE_CONFIG"] = str(file_in_container(env["DATACACHE_CONFIG"]))
        except FileNotFoundError:
            if not parsed.config:  # the daemon would fail: no config where the variable says
                raise
    return Resolved(settings=cli.serve_settings(parsed, env), mounts=mounts)


def check_resolved(resolved: Resolved, *, cache_volume: str, clients: list[dict[str, Any]]) -> None:
    """The local tier on its volume, the socket where clients mount it, capacity under the limit."""
    settings = resolved.settings
    cache = _mount_of(settings.local_dir, resolved.mounts)
    assert cache is not None, f"local_dir {settings.local_dir} is on the container's read-only root filesystem"
    cache_path, volume = cache
    assert cache_volume in volume and not volume["readOnly"], (settings.local_dir, volume)
    socket = _mount_of(settings.daemon_socket.parent, resolved.mounts)
    assert socket is not None, f"the socket {settings.daemon_socket} is on the container's root filesystem"
    socket_path, socket_volume = socket
    for client in clients:  # each training container sees the socket and the cache at the same paths
        client_mounts = {m["mountPath"]: m["name"] for m in client["volumeMounts"]}
        assert client_mounts.get(socket_path) == socket_volume["name"], (client["name"], socket_path)
        assert client_mounts.get(cache_path) == volume["name"], (client["name"], cache_path)
        client_env = {item["name"]: item["value"] for item in client.get("env", [])}
        assert client_env.get("DATACACHE_SOCKET", str(settings.daemon_socket)) == str(settings.daemon_socket)
    assert settings.local_capacity is not None, "an unbounded cache fills the volume"
    if "emptyDir" in volume:
        assert settings.local_capacity < _quantity(volume["emptyDir"]["sizeLimit"])


def _documents(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def _configmaps(documents: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {doc["metadata"]["name"]: doc["data"] for doc in documents if doc["kind"] == "ConfigMap"}


def _daemonset_case(documents: list[dict[str, Any]], tmp_path: Path) -> Resolved:
    daemonset = next(doc for doc in documents if doc["kind"] == "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    resolved = resolve_container(pod["containers"][0], pod, _configmaps(documents), tmp_path)
    check_resolved(resolved, cache_volume="hostPath", clients=[])
    return resolved


def _sidecar_case(documents: list[dict[str, Any]], tmp_path: Path) -> Resolved:
    job = next(doc for doc in documents if doc["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    sidecar = next(c for c in pod["initContainers"] if c.get("restartPolicy") == "Always")
    resolved = resolve_container(sidecar, pod, _configmaps(documents), tmp_path)
    check_resolved(resolved, cache_volume="emptyDir", clients=pod["containers"])
    return resolved


def test_the_daemonset_runs_on_the_nvme_hostpath_with_its_config(tmp_path: Path) -> None:
    documents = _documents((DEPLOY / "kubernetes" / "daemonset.yaml").read_text())
    resolved = _daemonset_case(documents, tmp_path)
    assert str(resolved.settings.local_dir) == "/mnt/nvme/datacache"
    assert str(resolved.settings.shared_dir) == "/mnt/shared/datacache"
    # The ConfigMap is the sample config of this deployment shape, verbatim.
    config = _configmaps(documents)["datacache-config"]["config.toml"]
    assert config == (DEPLOY / "config" / "daemonset.toml").read_text()


def test_the_sidecar_runs_on_its_emptydir_below_the_size_limit(tmp_path: Path) -> None:
    documents = _documents((DEPLOY / "kubernetes" / "sidecar.yaml").read_text())
    resolved = _sidecar_case(documents, tmp_path)
    assert str(resolved.settings.local_dir) == "/cache"


@pytest.mark.parametrize("mode", ["daemonset", "sidecar"])
def test_the_helm_chart_in_both_modes(mode: str, tmp_path: Path) -> None:
    overrides: dict[str, Any] = {"daemonset.enabled": mode == "daemonset", "trainingJob.enabled": mode == "sidecar"}
    rendered = render_chart(**overrides)
    documents = [doc for name, text in rendered.items() if name.endswith(".yaml") for doc in _documents(text)]
    if mode == "daemonset":
        resolved = _daemonset_case(documents, tmp_path)
        values = yaml.safe_load((DEPLOY / "helm" / "datacache" / "values.yaml").read_text())
        assert str(resolved.settings.local_dir) == values["cacheDir"]
        assert str(resolved.settings.daemon_socket.parent) == values["socketDir"]
        assert values["config"] == (DEPLOY / "config" / "daemonset.toml").read_text()
    else:
        resolved = _sidecar_case(documents, tmp_path)
        assert str(resolved.settings.local_dir) == "/cache"


def test_a_variable_in_the_image_would_override_the_mounted_config(tmp_path: Path) -> None:
    """The failure this suite exists for: an image ENV beats the config a manifest mounts."""
    documents = _documents((DEPLOY / "kubernetes" / "daemonset.yaml").read_text())
    daemonset = next(doc for doc in documents if doc["kind"] == "DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    container = pod["containers"][0]
    container.setdefault("env", []).append({"name": "DATACACHE_LOCAL_DIR", "value": "/var/cache/datacache"})
    resolved = resolve_container(container, pod, _configmaps(documents), tmp_path)
    with pytest.raises(AssertionError, match="read-only root filesystem"):
        check_resolved(resolved, cache_volume="hostPath", clients=[])


# -- systemd (Slurm nodes) ----------------------------------------------------------------------


def _unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(path.read_text())
    return parser


def test_the_systemd_unit_runs_on_the_configured_paths_with_enough_descriptors(tmp_path: Path) -> None:
    unit = _unit(DEPLOY / "slurm" / "datacache.service")
    service = unit["Service"]
    env = dict(pair.split("=", 1) for pair in shlex.split(service.get("Environment", "")))
    argv = shlex.split(service["ExecStart"])
    assert Path(argv[0]).name == "datacache" and argv[1] == "serve"
    config_in_unit = env.get("DATACACHE_CONFIG")
    assert config_in_unit == "/etc/datacache/config.toml"
    sample = DEPLOY / "config" / "slurm.toml"  # installed there by deploy/slurm/install.sh
    assert f"{sample.relative_to(DEPLOY.parent)}" in (DEPLOY / "slurm" / "install.sh").read_text()
    # The daemon's user exists once install.sh made it (here: root, as `DATACACHE_USER=root` would have it).
    text = sample.read_text()
    assert f'daemon_uid = "{service["User"]}"' in text
    installed = tmp_path / "config.toml"
    installed.write_text(text.replace(f'daemon_uid = "{service["User"]}"', 'daemon_uid = "root"'))
    env.update({"DATACACHE_CONFIG": str(installed), "HOME": "/nonexistent"})
    settings = cli.serve_settings(cli.parse_args(argv[1:]), env)
    writable = service["ReadWritePaths"].split()
    runtime = f"/run/{service['RuntimeDirectory']}"
    assert any(_under(settings.local_dir, path) for path in writable), (settings.local_dir, writable)
    assert settings.shared_dir is not None and any(_under(settings.shared_dir, path) for path in writable)
    assert _under(settings.daemon_socket.parent, runtime) or any(
        _under(settings.daemon_socket.parent, path) for path in writable
    )
    assert settings.local_capacity is not None
    # One client may hold hundreds of shard files open; 1,024 descriptors starve the daemon.
    assert int(service["LimitNOFILE"]) >= 65536
    # Jobs of many users reach the socket through the daemon's group, which install.sh creates
    # and fills (docs/SECURITY.md, Deployments); UMask=0077 would shut them out of its files.
    assert service["Group"] != service["User"] and service["UMask"] != "0077"
    assert f'DATACACHE_GROUP:={service["Group"]}' in (DEPLOY / "slurm" / "install.sh").read_text()


def test_the_install_script_checks_each_prerequisite_and_names_what_is_missing(tmp_path: Path) -> None:
    script = DEPLOY / "slurm" / "install.sh"
    env = {
        "PATH": os.environ["PATH"],
        "DATACACHE_USER": "root",  # exists everywhere: the check looks it up, never creates it
        "DATACACHE_GROUP": "root",
        "DATACACHE_PREFIX": str(tmp_path / "opt"),
        "DATACACHE_ETC": str(tmp_path / "etc"),
        "DATACACHE_LOCAL_DIR": str(tmp_path / "nvme" / "datacache"),
        "DATACACHE_SHARED_DIR": str(tmp_path / "shared" / "datacache"),
        "DATACACHE_UNIT_DIR": str(tmp_path / "systemd"),
    }
    result = subprocess.run(["bash", str(script), "--check"], env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 1
    missing = result.stdout.splitlines()
    assert missing == [
        f"missing: {tmp_path}/opt/bin/datacache (the venv)",
        f"missing: {tmp_path}/etc/config.toml",
        f"missing: directory {tmp_path}/nvme/datacache",
        f"missing: directory {tmp_path}/shared/datacache",
        f"missing: {tmp_path}/systemd/datacache.service",
    ]
    (tmp_path / "opt" / "bin").mkdir(parents=True)
    (tmp_path / "opt" / "bin" / "datacache").symlink_to(Path(sys.executable).parent / "datacache")
    for directory in ("etc", "nvme/datacache", "shared/datacache", "systemd"):
        (tmp_path / directory).mkdir(parents=True)
    (tmp_path / "etc" / "config.toml").write_text((DEPLOY / "config" / "slurm.toml").read_text())
    (tmp_path / "systemd" / "datacache.service").write_text((DEPLOY / "slurm" / "datacache.service").read_text())
    result = subprocess.run(["bash", str(script), "--check"], env=env, capture_output=True, text=True, check=False)
    assert (result.returncode, result.stdout.strip()) == (0, "datacache: node ready")


def test_one_image_name_built_and_referenced_everywhere() -> None:
    """The name `make image` builds is the one every manifest, the chart and the docs use."""
    version = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"]["version"]
    expected = f"ghcr.io/datacache/datacache:{version}"
    makefile = (DEPLOY.parent / "Makefile").read_text()
    assert "IMAGE ?= ghcr.io/datacache/datacache:$(VERSION)" in makefile
    assert "IMAGE=$(IMAGE) VERSION=$(VERSION) BASE=$(BASE) deploy/build-image.sh" in makefile
    assert "push $(IMAGE)" in makefile
    values = yaml.safe_load((DEPLOY / "helm" / "datacache" / "values.yaml").read_text())
    assert f"{values['image']['repository']}:{values['image']['tag']}" == expected
    chart = yaml.safe_load((DEPLOY / "helm" / "datacache" / "Chart.yaml").read_text())
    assert chart["appVersion"] == version
    paths = [*DEPLOY.rglob("*.yaml"), DEPLOY / "Dockerfile", DEPLOY.parent / "README.md"]
    texts = {path: path.read_text() for path in paths}
    found = {
        (str(path), name)
        for path, text in texts.items()
        for name in re.findall(r"[\w./-]*datacache/datacache:[\w.]+|\bdatacache:\d[\w.]*", text)
    }
    assert found and {name for _, name in found} == {expected}, sorted(found)
