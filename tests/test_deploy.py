"""deploy/ checked without a container engine or a cluster: lint, render, validate, run the entrypoint."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import stat
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from _daemon import REPO, unix_request, wait_until

from datacache.config import load_settings
from datacache.daemon.metrics import METRICS
from datacache.sizes import parse_size

DEPLOY = REPO / "deploy"
CHART = DEPLOY / "helm" / "datacache"
K8S_VERSION = "1.30.0"  # native sidecars (initContainers[].restartPolicy) need >= 1.29
YAMLLINT_CONFIG = "{extends: default, rules: {line-length: {max: 120}, document-start: disable}}"


def yamllint(*paths: Path, text: str | None = None) -> None:
    from yamllint import config as lint_config
    from yamllint import linter

    conf = lint_config.YamlLintConfig(YAMLLINT_CONFIG)
    sources = [(str(path), path.read_text()) for path in paths]
    if text is not None:
        sources.append(("<rendered>", text))
    problems = [
        f"{name}:{problem.line}:{problem.column}: {problem.message} ({problem.rule})"
        for name, source in sources
        for problem in linter.run(source, conf)
        if problem.level == "error"
    ]
    assert problems == [], "\n".join(problems) + ("\n---\n" + text if text else "")


def validate(document: dict[str, Any]) -> None:
    """Validate a Kubernetes object against the API schema, strictly (unknown fields fail)."""
    kubernetes_validate.validate(document, K8S_VERSION, strict=True)


# -- a tiny Helm renderer: .Values/.Release/.Chart, if/else/end, quote/indent/nindent/toYaml/default ---

_ACTION = re.compile(r"\{\{(-)?\s*(.*?)\s*(-)?\}\}", re.S)


def _lookup(path: str, context: dict[str, Any]) -> Any:
    value: Any = context
    for part in path.lstrip(".").split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(f"{path}: no {part!r}")
        value = value[part]
    return value


def _to_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)


def _term(word: str, context: dict[str, Any]) -> Any:
    if word.startswith("."):
        return _lookup(word, context)
    if word.startswith('"'):
        return json.loads(word)
    if re.fullmatch(r"-?\d+", word):
        return int(word)
    raise ValueError(f"unsupported template term {word!r}")


def _call(name: str, args: list[Any]) -> Any:
    if name == "quote":
        return json.dumps(_to_text(args[0]))
    if name == "toYaml":
        return yaml.safe_dump(args[0], default_flow_style=False, sort_keys=False).rstrip("\n")
    if name in ("indent", "nindent"):
        pad = " " * int(args[0])
        text = "\n".join(pad + line if line else line for line in _to_text(args[1]).rstrip("\n").split("\n"))
        return "\n" + text if name == "nindent" else text
    if name == "default":
        return args[1] if args[1] else args[0]
    raise ValueError(f"unsupported template function {name!r}")


def _evaluate(expression: str, context: dict[str, Any]) -> Any:
    value: Any = None
    for index, stage in enumerate(part.strip() for part in expression.split("|")):
        words = shlex.split(stage, posix=False)
        if words[0].startswith((".", '"')) or re.fullmatch(r"-?\d+", words[0]):
            if index != 0 or len(words) != 1:
                raise ValueError(f"unsupported pipeline {expression!r}")
            value = _term(words[0], context)
            continue
        args = [_term(word, context) for word in words[1:]]
        value = _call(words[0], args if index == 0 else [*args, value])
    return value


def _pieces(template: str) -> list[tuple[str, str]]:
    """The template as ("text", ...) and ("action", ...) pieces, with ``{{-`` and ``-}}`` trimming applied."""
    pieces: list[tuple[str, str]] = []
    position, trim_next = 0, False
    for match in _ACTION.finditer(template):
        text = template[position : match.start()]
        if trim_next:
            text = text.lstrip()
        if match.group(1):
            text = text.rstrip()
        pieces += [("text", text), ("action", match.group(2))]
        trim_next, position = bool(match.group(3)), match.end()
    tail = template[position:]
    pieces.append(("text", tail.lstrip() if trim_next else tail))
    return pieces


def render(template: str, context: dict[str, Any]) -> str:
    """Render the Helm template subset the chart uses (valid Helm, checked here without helm)."""
    out: list[str] = []
    stack: list[tuple[bool, bool]] = []  # (parent active, this branch taken)

    def active() -> bool:
        return all(parent and taken for parent, taken in stack)

    for kind, value in _pieces(template):
        if kind == "text":
            if active():
                out.append(value)
            continue
        if value.startswith("/*"):
            continue
        keyword, _, rest = value.partition(" ")
        if keyword == "if":
            parent = active()
            stack.append((parent, bool(_evaluate(rest, context)) if parent else False))
        elif keyword == "else":
            parent, taken = stack.pop()
            stack.append((parent, not taken))
        elif keyword == "end":
            stack.pop()
        elif active():
            out.append(_to_text(_evaluate(value, context)))
    assert not stack, "unbalanced if/end"
    return "".join(out)


def render_chart(**overrides: Any) -> dict[str, str]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for dotted, value in overrides.items():
        target = values
        *parents, last = dotted.split(".")
        for parent in parents:
            target = target[parent]
        target[last] = value
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    context = {
        "Values": values,
        "Release": {"Name": "datacache", "Namespace": "ml", "Service": "Helm"},
        "Chart": {"Name": chart["name"], "Version": chart["version"], "AppVersion": chart["appVersion"]},
    }
    return {
        path.name: render(path.read_text(), context)
        for path in sorted((CHART / "templates").iterdir())
        if path.suffix in (".yaml", ".txt")
    }


def test_the_tiny_renderer_follows_helm_semantics() -> None:
    context = {"Values": {"a": {"b": "x"}, "on": True, "off": False, "list": ["p", "q"], "n": 3}}
    assert render("k: {{ .Values.a.b | quote }}", context) == 'k: "x"'
    assert render("a:\n  {{- if .Values.off }}\n  x: 1\n  {{- end }}\n  y: 2", context) == "a:\n  y: 2"
    assert render("a:\n{{- if .Values.on }}\n  x: 1\n{{- else }}\n  z: 1\n{{- end }}", context) == "a:\n  x: 1"
    assert render("l:\n  {{- toYaml .Values.list | nindent 2 }}", context) == "l:\n  - p\n  - q"
    assert render('{{ .Values.missing | default "d" }}', {"Values": {"missing": ""}}) == "d"
    with pytest.raises(KeyError):
        render("{{ .Values.nope }}", context)


# -- the Helm chart ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"trainingJob.enabled": True, "serviceMonitor.enabled": True},
        {"shared.enabled": False, "shared.createClaim": False},
    ],
    ids=["defaults", "everything", "no-shared-tier"],
)
def test_helm_chart_renders_lints_and_validates(overrides: dict[str, Any], tmp_path: Path) -> None:
    yamllint(CHART / "Chart.yaml", CHART / "values.yaml")
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "datacache"
    rendered = render_chart(**overrides)
    kinds: dict[str, dict[str, Any]] = {}
    for name, text in rendered.items():
        if name.endswith(".txt"):
            assert "{{" not in text
            continue
        documents = [doc for doc in yaml.safe_load_all(text) if doc]
        if not documents:
            continue
        yamllint(text=text.lstrip("\n"))  # helm leaves the newline after a leading if
        for document in documents:
            kinds[document["kind"]] = document
            if document["apiVersion"].startswith("monitoring.coreos.com/"):
                endpoint = document["spec"]["endpoints"][0]
                assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
                continue
            validate(document)
    assert {"ConfigMap", "DaemonSet", "Service"} <= set(kinds)
    assert ("PersistentVolumeClaim" in kinds) == (overrides.get("shared.createClaim", True))
    assert ("Job" in kinds) == bool(overrides.get("trainingJob.enabled"))
    assert ("ServiceMonitor" in kinds) == bool(overrides.get("serviceMonitor.enabled"))
    config = tmp_path / "config.toml"
    config.write_text(kinds["ConfigMap"]["data"]["config.toml"])
    settings = load_settings({"HOME": str(tmp_path)}, config_path=config)
    assert settings.metrics_address.endswith(":9464")
    check_daemonset(kinds["DaemonSet"])
    if "Job" in kinds:
        check_native_sidecar(kinds["Job"])


def check_daemonset(daemonset: dict[str, Any]) -> None:
    pod = daemonset["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    container = pod["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert "hostPath" in volumes["cache"] and "hostPath" in volumes["socket"]
    mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
    assert {"cache", "socket", "config"} <= set(mounts)
    if "shared" in volumes:
        assert "persistentVolumeClaim" in volumes["shared"]


def check_native_sidecar(job: dict[str, Any]) -> None:
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    sidecar = pod["initContainers"][0]
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar: the Job completes when training ends
    assert sidecar["startupProbe"]["httpGet"]["path"] == "/readyz"
    env = {item["name"]: item["value"] for item in sidecar["env"]}
    trainer = pod["containers"][0]
    trainer_env = {item["name"]: item["value"] for item in trainer["env"]}
    assert trainer_env["DATACACHE_SOCKET"] == env["DATACACHE_SOCKET"]
    sidecar_mounts = {m["name"]: m["mountPath"] for m in sidecar["volumeMounts"]}
    trainer_mounts = {m["name"]: m["mountPath"] for m in trainer["volumeMounts"]}
    # Same paths in both containers: the paths the daemon returns open as they are.
    assert sidecar_mounts["cache"] == trainer_mounts["cache"] == env["DATACACHE_LOCAL_DIR"]
    assert sidecar_mounts["socket"] == trainer_mounts["socket"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert "emptyDir" in volumes["socket"]
    limit = _quantity(volumes["cache"]["emptyDir"]["sizeLimit"])
    assert parse_size(env["DATACACHE_LOCAL_CAPACITY"]) < limit  # the cache evicts before the kubelet would


def _quantity(text: str) -> int:
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?", text)
    assert match, text
    factor = {
        None: 1,
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
        "k": 10**3,
        "M": 10**6,
        "G": 10**9,
        "T": 10**12,
    }
    return int(match.group(1)) * factor[match.group(2)]


# -- plain Kubernetes manifests --------------------------------------------------------------------


def test_kubernetes_manifests_lint_and_validate(tmp_path: Path) -> None:
    manifests = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
    assert {path.name for path in manifests} >= {"daemonset.yaml", "sidecar.yaml"}
    yamllint(*manifests)
    kinds: dict[str, dict[str, Any]] = {}
    for path in manifests:
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                validate(document)
                kinds[document["kind"]] = document
    check_daemonset(kinds["DaemonSet"])
    check_native_sidecar(kinds["Job"])
    config = tmp_path / "config.toml"
    config.write_text(kinds["ConfigMap"]["data"]["config.toml"])
    load_settings({"HOME": str(tmp_path)}, config_path=config)


def test_strict_validation_catches_mistakes() -> None:
    document = next(d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "sidecar.yaml").read_text()) if d)
    document["spec"]["template"]["spec"]["containers"][0]["volumeMount"] = []  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(document)


# -- the image -------------------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs of deploy/Dockerfile, continuation lines joined."""
    text = (DEPLOY / "Dockerfile").read_text()
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    instructions = []
    for line in joined.splitlines():
        if line.strip():
            keyword, _, rest = line.strip().partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    return instructions


def dockerfile_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, rest in dockerfile():
        if keyword == "ENV":
            for pair in shlex.split(rest):
                name, _, value = pair.partition("=")
                env[name] = value
    return env


def image_env() -> dict[str, str]:
    """The image's ENV, with the files it names taken from where the image's COPY takes them."""
    env = dockerfile_env()
    copies = {}
    for keyword, rest in dockerfile():
        if keyword == "COPY":
            *sources, target = shlex.split(rest)
            if len(sources) == 1:
                copies[target] = REPO / sources[0]
    if "DATACACHE_CONFIG" in env:
        env["DATACACHE_CONFIG"] = str(copies[env["DATACACHE_CONFIG"]])
    return env


def test_dockerfile_installs_like_make_without_torch_as_non_root() -> None:
    instructions = dockerfile()
    by_keyword: dict[str, list[str]] = {}
    for keyword, rest in instructions:
        by_keyword.setdefault(keyword, []).append(rest)
    # One file for both bases: Debian's own (make image, offline) or python:3.11-slim from a registry.
    assert by_keyword["FROM"] == ["${BASE}"]
    args = dict(arg.partition("=")[::2] for arg in by_keyword["ARG"])
    assert args["BASE"] == "python:3.11-slim"
    assert args["VERSION"] == tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert json.loads(by_keyword["ENTRYPOINT"][-1]) == ["datacache", "serve"]
    user = by_keyword["USER"][-1].split(":")[0]
    assert user not in ("0", "root")
    assert any("/healthz" in line for line in by_keyword["HEALTHCHECK"])
    # The install step is the Makefile's: the same constraints file, the project itself, no torch extra,
    # from the wheels `make wheels` built under it (no index).
    makefile = (REPO / "Makefile").read_text()
    constraints = re.search(r"^CONSTRAINTS\s*:=\s*(\S+)", makefile, re.M)
    assert constraints is not None
    assert re.search(r"install .*-c \$\(CONSTRAINTS\) -e '\.\[", makefile)
    assert re.search(r"wheel .*-c \$\(CONSTRAINTS\) .*--wheel-dir \$\(WHEELS\) \.$", makefile, re.M)
    installs = [part for line in by_keyword["RUN"] for part in line.split("&&") if "pip install" in part]
    assert len(installs) == 1
    words = shlex.split(installs[0])
    context = "/src/"  # the build context, bind-mounted for the one step
    assert words[words.index("-c") + 1] == context + constraints.group(1)
    assert "--no-index" in words and words[words.index("--find-links") + 1] == context + "build/wheels"
    assert words[-1] == "datacache==${VERSION}"  # the package alone: no [torch] extra in the sidecar image
    assert "torch" not in installs[0]
    # Every file the image copies is in the repository.
    for line in by_keyword["COPY"]:
        *sources, _ = shlex.split(line)
        for source in sources:
            assert (REPO / source).exists(), source
    # The image's environment is settings datacache accepts.
    settings = load_settings({**image_env(), "HOME": "/nonexistent"})
    # The cache and socket come from the image's config file, never its ENV (which would beat
    # the config a deployment mounts over it).
    assert not {"DATACACHE_LOCAL_DIR", "DATACACHE_SOCKET", "DATACACHE_LOCAL_CAPACITY"} & set(dockerfile_env())
    assert str(settings.local_dir) == "/var/cache/datacache"


def test_the_image_entrypoint_serves_healthz(tmp_path: Path, cache_env: dict[str, str]) -> None:
    entrypoint: list[str] = []
    command: list[str] = []
    for keyword, rest in dockerfile():
        if keyword == "ENTRYPOINT":
            entrypoint = json.loads(rest)
        elif keyword == "CMD":
            command = json.loads(rest)
    executable = Path(sys.executable).parent / entrypoint[0]
    assert executable.exists(), "the console script the image's entrypoint names"
    env = {**cache_env, **image_env()}
    env.update(
        {
            "DATACACHE_LOCAL_DIR": str(tmp_path / "cache"),
            "DATACACHE_SOCKET": str(tmp_path / "run" / "daemon.sock"),
            "DATACACHE_METRICS_ADDRESS": "127.0.0.1:0",
        }
    )
    log = (tmp_path / "serve.log").open("wb")
    process = subprocess.Popen(
        [str(executable), *entrypoint[1:], *command], env=env, stdout=log, stderr=log, cwd=tmp_path
    )
    try:
        socket_path = tmp_path / "run" / "daemon.sock"

        def healthy() -> bool:
            assert process.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                return unix_request(socket_path, "GET", "/healthz", timeout=5)[0] == 200
            except OSError:
                return False

        wait_until(healthy, timeout=60, what="the entrypoint to answer /healthz")
        assert stat.S_IMODE(socket_path.stat().st_mode) == 0o660
        wait_until(lambda: unix_request(socket_path, "GET", "/readyz")[0] == 200, what="readiness")
        status = unix_request(socket_path, "GET", "/v1/status")[1]
        port = status["metrics_address"].rsplit(":", 1)[1]
        # The image's HEALTHCHECK command, pointed at this daemon's port.
        healthcheck = next(rest for keyword, rest in dockerfile() if keyword == "HEALTHCHECK")
        probe = json.loads(healthcheck[healthcheck.index("CMD") + 3 :].strip())
        assert probe[0] == "python"
        code = probe[2].replace(":9464/", f":{port}/")
        assert subprocess.run([sys.executable, "-c", code], check=False, timeout=30).returncode == 0
        lines = (tmp_path / "serve.log").read_text().splitlines()
        assert lines and all(json.loads(line)["logger"].startswith("datacache") for line in lines)  # --log-json
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert not socket_path.exists()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()


def test_the_daemon_never_imports_torch() -> None:
    code = "import datacache.daemon, datacache.client, datacache.daemon.metrics, sys; assert 'torch' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=REPO)
    assert result.returncode == 0, result.stderr


# -- compose, Slurm, Grafana -----------------------------------------------------------------------


def test_compose_file_builds_the_image_and_sets_known_settings(tmp_path: Path) -> None:
    path = DEPLOY / "docker-compose.yaml"
    yamllint(path)
    compose = yaml.safe_load(path.read_text())
    service = compose["services"]["datacache"]
    context = (DEPLOY / service["build"]["context"]).resolve()
    assert context == REPO and (context / service["build"]["dockerfile"]).exists()
    assert "healthcheck" not in service  # the image's own HEALTHCHECK applies
    env = {k: str(v) for k, v in service["environment"].items() if k.startswith("DATACACHE_")}
    load_settings({**env, "HOME": str(tmp_path)})
    assert env["DATACACHE_METRICS_ADDRESS"].startswith("0.0.0.0:")
    assert all(port.startswith("127.0.0.1:") for s in compose["services"].values() for port in s.get("ports", []))


def test_the_compose_seed_writes_shards_a_reader_can_read(tmp_path: Path, s3: Any, settings: Any) -> None:
    """The walk-through reaches reading: `seed` wrote random bytes named *.tar once (issue 24 item 3)."""
    from datacache.loaders import CachedIterableDataset

    seed = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())["services"]["seed"]
    assert seed["entrypoint"][:2] == ["python", "-c"]
    code = seed["entrypoint"][2].replace("http://s3:5000", s3.server.endpoint)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    warm = compose_warm_url()
    samples = list(CachedIterableDataset(warm, config=settings))
    assert len(samples) == 16 * 64
    assert {sample["__key__"].split("_")[0] for sample in samples} == {f"{i:04d}" for i in range(16)}
    assert all(len(sample["bin"]) == 64 << 10 for sample in samples)


def compose_warm_url() -> str:
    """The dataset the compose file's `warm` service warms."""
    warm = yaml.safe_load((DEPLOY / "docker-compose.yaml").read_text())["services"]["warm"]
    return str(next(word for word in warm["entrypoint"] if word.startswith("s3://")))


def test_slurm_prolog_warms_the_named_dataset_and_never_fails(tmp_path: Path) -> None:
    scripts = [DEPLOY / "slurm" / "datacache-prolog.sh", DEPLOY / "slurm" / "train.sbatch"]
    for script in scripts:
        assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0, script
    sbatch = scripts[1].read_text()
    assert "#SBATCH --comment=datacache=" in sbatch
    # Stubs for scontrol, logger and the datacache binary.
    stubs = tmp_path / "bin"
    stubs.mkdir()
    calls = tmp_path / "calls"
    (stubs / "scontrol").write_text(
        "#!/bin/bash\necho 'JobId=7 JobName=train'\necho '   Comment=datacache=s3://bucket/ds/ Reservation=(null)'\n"
    )
    (stubs / "logger").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path / "log"}\n')
    for outcome in (0, 1):
        (stubs / "datacache").write_text(f'#!/bin/bash\necho "$@" >> {calls}\nexit {outcome}\n')
        for stub in stubs.iterdir():
            stub.chmod(0o755)
        result = subprocess.run(
            ["bash", str(scripts[0])],
            env={
                "PATH": f"{stubs}:{os.environ['PATH']}",
                "SLURM_JOB_ID": "7",
                "DATACACHE_BIN": str(stubs / "datacache"),
                "DATACACHE_USER": "no-such-user-here",
            },
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stderr  # a failing prolog would drain the node
    assert calls.read_text().splitlines() == ["warm s3://bucket/ds/ --tier local --quiet"] * 2
    # The flags the prolog passes exist.
    help_text = subprocess.run(
        [sys.executable, "-m", "datacache.cli", "warm", "--help"], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout
    assert "--tier" in help_text and "--quiet" in help_text


def test_grafana_dashboard_queries_only_metrics_the_daemon_exports() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboard.json").read_text())
    expressions = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                expressions.append(node["expr"])
            for key in ("query", "definition"):
                if isinstance(node.get(key), str) and "datacache_" in node[key]:
                    expressions.append(node[key])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(dashboard)
    assert len(expressions) >= 15
    used = set()
    for expression in expressions:
        for name in re.findall(r"\bdatacache_[a-z0-9_]+", expression):
            used.add(name)
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            declared = name in METRICS or (base in METRICS and METRICS[base] == "histogram")
            assert declared, f"the dashboard queries {name}, which datacache/daemon/metrics.py does not export"
    # The panels that answer "is the GPU fed?" are there.
    for needed in (
        "datacache_client_delivered_bytes_per_second",
        "datacache_client_data_stall_fraction",
        "datacache_staging_seconds_bucket",
        "datacache_tier_used_bytes",
        "datacache_queue_depth",
    ):
        assert needed in used, needed
