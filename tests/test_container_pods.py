"""The Kubernetes sidecar pod (the manifest and the Helm chart's rendering) played with `podman kube play`.

No Kubernetes API server can be had here; podman plays Pod YAML. The test takes the Job's pod
template as the manifest ships it and changes, in the test and never in the manifest, what podman
4.3 does not know or what this machine lacks, each named where it is done:

- the Job becomes its pod template as a Pod (kube play runs Pods, Deployments, PVCs);
- the native sidecar (an init container with ``restartPolicy: Always``, Kubernetes >= 1.29) becomes a
  container beside the trainer, and the init containers after it (prestage), which Kubernetes starts
  once the sidecar's startupProbe passed, run at the head of the trainer's command after a wait for
  the sidecar's /readyz (podman runs init containers before every container, and knows no startupProbe);
- emptyDir volumes become host directories of the test's (podman 4.3 plays hostPath and PVCs);
- probes go (kube play turns httpGet into curl, which the image does not carry; the wait above is
  the startupProbe), and so do the resources (no GPUs here; a 1Ti limit is not this machine's);
- the trainer's image (registry.example.com/...) is the Debian base with the tests' own Python
  environment mounted read-only at its path (torch is in it), running the tests' training script;
- the pod uses the host's network (moto's S3 server on 127.0.0.1), its metrics on a free port, and
  the origin is the test's bucket (the manifests' s3://datasets/imagenet-wds/ is swapped for it).

The pod's uids, security contexts, env, volume mounts and commands are the manifest's own.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import _users
import pytest
import yaml
from _containers import BASE, IMAGE, REPO, Containers, containers, engine, require_image
from _daemon import wait_until
from _users import User
from test_deploy import render_chart
from test_deploy_slurm import _TRAIN, _shards

pytestmark = pytest.mark.containers

users = _users.users
world_dir = _users.world_dir
__all__ = ["containers"]  # a fixture, by name

SIDECAR = REPO / "deploy" / "kubernetes" / "sidecar.yaml"
ORIGIN = "s3://datasets/imagenet-wds/"

_READY = """
import http.client, socket, sys, time
class Unix(http.client.HTTPConnection):
    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(sys.argv[1])
deadline = time.monotonic() + 120
while True:
    try:
        connection = Unix("localhost", timeout=5)
        connection.request("GET", "/readyz")
        if connection.getresponse().status == 200:
            break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit("the sidecar never became ready")
    time.sleep(0.1)  # sleep-ok: spaces the polls of the startupProbe's stand-in
"""


def _pod_of(job: dict[str, Any], name: str, root: Path, bucket_url: str, s3_env: dict[str, str]) -> dict[str, Any]:
    """The Job's pod template as a Pod podman 4.3 plays (the module's docstring lists each change)."""
    spec = copy.deepcopy(job["spec"]["template"]["spec"])
    sidecar = next(c for c in spec["initContainers"] if c.get("restartPolicy") == "Always")
    after = spec["initContainers"][spec["initContainers"].index(sidecar) + 1 :]
    trainer = spec["containers"][0]
    socket = next(e["value"] for e in trainer["env"] if e["name"] == "DATACACHE_SOCKET")
    del sidecar["restartPolicy"]
    python = str(REPO / ".venv" / "bin" / "python")
    steps = [shlex.join([python, "-c", _READY, socket])]
    for init in after:  # prestage: its own command, with the tests' environment's datacache
        assert init["image"] == IMAGE and init["command"][:2] == ["sh", "-c"]
        steps.append(init["command"][2].replace("datacache warm", f"{python} -m datacache.cli warm", 1))
    steps.append(shlex.join([python, "-c", textwrap.dedent(_TRAIN), bucket_url]))
    data = next(a for a in trainer["command"] if a.startswith("--data="))
    assert data == f"--data={ORIGIN}"  # the trainer reads what prestage stages
    trainer.update(image=BASE, command=["/bin/sh", "-c", " && ".join(steps).replace(ORIGIN, bucket_url)])
    extra = [{"name": k, "value": v} for k, v in s3_env.items()]
    for container in (sidecar, trainer):
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            container.pop(probe, None)
        container.pop("resources", None)
        container["env"] = [*container["env"], *extra]
    sidecar["env"] = [e if e["name"] != "DATACACHE_METRICS_ADDRESS" else {**e, "value": "127.0.0.1:0"}
                      for e in sidecar["env"]]
    sidecar.pop("ports", None)
    prefix = Path(os.path.realpath(sys.executable)).parent.parent
    mounts = {"tests-python": prefix, "tests-repo": REPO}
    if prefix.parts[1] == "root":  # pyenv's: under the image's /root (0700), so an empty 0755 /root above it
        inner = root / "tests-root" / prefix.relative_to("/root")
        inner.mkdir(parents=True)  # the mount point of the prefix, made here: the fake /root is read-only
        for path in [inner, *inner.parents][: len(prefix.parts) - 1]:
            path.chmod(0o755)
        mounts["tests-root"] = root / "tests-root"
    trainer["volumeMounts"] = [*trainer["volumeMounts"],
                               *[{"name": n, "mountPath": "/root" if n == "tests-root" else str(p), "readOnly": True}
                                 for n, p in mounts.items()]]
    volumes = []
    for volume in spec["volumes"]:
        path = root / volume["name"]
        path.mkdir()
        os.chown(path, 0, spec["securityContext"]["fsGroup"])  # as the kubelet makes an emptyDir for fsGroup
        path.chmod(0o2777)
        volumes.append({"name": volume["name"], "hostPath": {"path": str(path), "type": "Directory"}})
    volumes += [{"name": n, "hostPath": {"path": str(p), "type": "Directory"}} for n, p in mounts.items()]
    spec.update(containers=[sidecar, trainer], volumes=volumes, hostNetwork=True)
    del spec["initContainers"]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def _play(job: dict[str, Any], root: Path, s3: Any, containers: Containers) -> None:
    for key, data in _shards(3, 4).items():
        s3.put(f"wds/{key}", data)
    name = f"dct-pod-{uuid.uuid4().hex[:8]}"
    pod = _pod_of(job, name, root, f"{s3.url('wds')}/", s3.server.env())
    manifest = root / "pod.yaml"
    manifest.write_text(yaml.safe_dump(pod))
    containers.pods.append(name)
    s3.server.reset_counts()
    engine(["kube", "play", str(manifest)], timeout=300)
    names = {c["name"]: f"{name}-{c['name']}" for c in pod["spec"]["containers"]}
    trainer, sidecar = names["train"], names["datacache"]

    def trained() -> bool:
        return not containers.inspect(trainer)["State"]["Running"]

    wait_until(trained, timeout=300, what="the pod's trainer to finish")
    state = containers.inspect(trainer)["State"]
    logs = containers.logs(trainer)
    assert state["ExitCode"] == 0, logs + containers.logs(sidecar)
    result = json.loads([line for line in logs.splitlines() if line.startswith("{")][-1])
    assert sorted(result["keys"]) == sorted(f"s{s:02d}_{i:03d}" for s in range(3) for i in range(4))
    for failure in ("PermissionError", "DatacacheError", "refusing", "embedded"):
        assert failure not in logs, logs
    assert containers.inspect(sidecar)["State"]["Running"]  # the sidecar served to the end
    assert "prestage incomplete" not in logs, logs
    gets = {k: n for k, n in s3.server.request_counts().items() if k.startswith("GET ") and "/wds/shard-" in k}
    assert len(gets) == 3 and set(gets.values()) == {1}, gets  # each shard once, by the sidecar
    catalog = root / "cache" / "catalog.sqlite"
    assert catalog.stat().st_uid == pod["spec"]["securityContext"]["runAsUser"]


def test_the_sidecar_pod_plays_prestaged_and_trains_through_its_sidecar(
    world_dir: Path, s3: Any, containers: Containers, users: dict[str, User]
) -> None:
    require_image()
    require_image(BASE)
    job = next(d for d in yaml.safe_load_all(SIDECAR.read_text()) if d and d["kind"] == "Job")
    _play(job, world_dir, s3, containers)


def test_the_helm_charts_sidecar_job_plays_as_the_manifest_does(
    world_dir: Path, s3: Any, containers: Containers, users: dict[str, User]
) -> None:
    require_image()
    require_image(BASE)
    rendered = render_chart(**{"trainingJob.enabled": True, "daemonset.enabled": False,
                               "trainingJob.prestage.dataset": ORIGIN})
    job = next(d for name, text in rendered.items() if name.endswith(".yaml") for d in yaml.safe_load_all(text)
               if d and d.get("kind") == "Job")
    trainer = job["spec"]["template"]["spec"]["containers"][0]
    trainer["command"] = [*trainer["command"], f"--data={ORIGIN}"]  # the chart's example names no dataset
    _play(job, world_dir, s3, containers)
