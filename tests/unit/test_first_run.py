"""`make run` on a fresh machine: the runtime set only, one line per bootstrap step, and every
listener on loopback unless told otherwise (the image and the manifests say 0.0.0.0 themselves)."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

from exhook_server.config import Config, split_host_port
from testkit.harness import ROOT
from tests.unit.test_deploy import K8S, PG, by_kind

DEV_ONLY = ("pyspark", "pytest", "ruff", "mypy", "grpcio-tools", "matplotlib", "hadolint", "kubernetes-validate")


def requirement_names(path: Path) -> set[str]:
    return {re.split(r"[=<>\[ ]", line)[0].lower() for line in path.read_text().splitlines() if line[:1].isalnum()}


def test_the_runtime_set_has_no_test_spark_or_lint_tools() -> None:
    runtime = requirement_names(ROOT / "requirements-runtime.txt")
    assert runtime and not {name for name in runtime if name.startswith(DEV_ONLY)}
    assert runtime <= requirement_names(ROOT / "requirements.txt") | runtime  # dev installs it via -r
    assert "-r requirements-runtime.txt" in (ROOT / "requirements.txt").read_text()


def test_make_run_bootstraps_the_runtime_set_and_make_test_everything(tmp_path: Path) -> None:
    """`make -n` (what make would do) for a venv not yet built."""

    def plan(target: str) -> str:
        out = subprocess.run(
            ["make", "-n", "-C", str(ROOT), target, f"VENV={tmp_path / 'venv'}"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert "scripts/bootstrap runtime" in plan("run") and "bootstrap dev" not in plan("run")
    assert "scripts/bootstrap dev" in plan("test")


def test_bootstrap_runtime_prints_a_line_per_step_and_installs_only_the_runtime_set(tmp_path: Path) -> None:
    """The script itself, with the interpreter, pip and apt as recording stand-ins (the real ones
    would download from the network): no apt package but python3-venv is asked for, pip gets
    requirements-runtime.txt, and each step says what it does."""
    calls = tmp_path / "calls"
    stub = '#!/bin/sh\necho "$(basename $0) $*" >> ' + str(calls) + "\n"
    bin_dir = tmp_path / "bin"
    venv_bin = tmp_path / "venv" / "bin"
    for path in (bin_dir / "apt-get", bin_dir / "sudo", bin_dir / "python3", venv_bin / "python"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(stub)
        path.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": "python3", "VENV": str(tmp_path / "venv")}
    out = subprocess.run(
        [str(ROOT / "scripts" / "bootstrap"), "runtime"], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert [line.split("] ")[0] for line in lines] == [f"bootstrap (runtime) [{i}/4" for i in range(1, 5)], lines
    recorded = calls.read_text().splitlines()
    assert not [c for c in recorded if c.startswith(("apt-get", "sudo"))], recorded
    assert "python -m pip install -q -r requirements-runtime.txt" in recorded, recorded
    assert not [c for c in recorded if "requirements.txt" in c.split()], recorded


def test_every_listener_defaults_to_loopback() -> None:
    for name in ("listen", "metrics_listen", "admin_listen"):
        assert split_host_port(getattr(Config(), name))[0] == "127.0.0.1", name


def test_the_image_and_the_manifests_set_their_addresses_themselves() -> None:
    """What must be reachable from outside a container says 0.0.0.0 where it is deployed; the
    Admin API stays on loopback there too."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "SDV_FANOUT_LISTEN=0.0.0.0:9000" in dockerfile and "SDV_FANOUT_METRICS_LISTEN=0.0.0.0:9100" in dockerfile
    for root in (K8S, PG):
        settings = tomllib.loads(by_kind("ConfigMap", root)["data"]["config.toml"])
        assert (settings["listen"], settings["metrics_listen"]) == ("0.0.0.0:9000", "0.0.0.0:9100")
        assert settings["admin_listen"].startswith("127.0.0.1:")
