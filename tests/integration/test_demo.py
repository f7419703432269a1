"""`make demo`, short: a newcomer's first command must keep working at any process count, with the
simulator and with the real EMQX.

Each test runs `python -m demo.run` as a subprocess with a small fleet, as a person would, and
reads its output. The demo stops everything it started; should it hang, its process group is
terminated and then killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from demo.brokers import choose
from tests.emqx_real import EmqxUnavailable
from tests.harness import ROOT

pytestmark = pytest.mark.slow

#: Small enough for ~10-15 s a run on 2 cores, big enough for every scenario event to happen.
SHORT = ["--vehicles", "40", "--batches", "8", "--interval", "0.3", "--seed", "7", "--drain-timeout", "20"]
EMQX_VERSION = "5.8.9"


def run_demo(log_dir: Path, *args: str, timeout_s: float = 90) -> tuple[int, str]:
    """Run the demo to its end; returns its exit code and everything it printed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "demo.run", *SHORT, "--log-dir", str(log_dir), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: on a hang, everything it started goes too
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the demo stops what it started
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        raise AssertionError(f"the demo did not finish within {timeout_s} s:\n{out}") from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out


def assert_passed(code: int, out: str, processes: int) -> None:
    assert code == 0, out
    assert f"sdv-fanout serve, {processes} process(es)" in out, out
    assert "PASS: every row reached its vehicle, was acknowledged and deleted, one in flight per vehicle" in out, out
    assert "server stopped cleanly on SIGTERM" in out, out


@pytest.mark.parametrize("processes", [2, 4])
def test_demo_passes_with_the_simulator(tmp_path: Path, processes: int) -> None:
    """A short demo with mosquitto and the simulated EMQX delivers every row and exits 0."""
    code, out = run_demo(tmp_path / "logs", "--broker", "sim", "--processes", str(processes))
    assert "broker    the simulator" in out, out
    assert_passed(code, out, processes)


def test_demo_passes_with_the_real_emqx(tmp_path: Path) -> None:
    """A short demo against a real EMQX 5.8.9, which calls the hooks itself, delivers every row and exits 0."""
    try:
        choose("emqx", EMQX_VERSION)  # what the demo itself asks: a release that can run here
    except EmqxUnavailable as exc:
        pytest.skip(f"EMQX {EMQX_VERSION} cannot run here: {exc}")
    code, out = run_demo(tmp_path / "logs", "--broker", "emqx", "--emqx-version", EMQX_VERSION, "--processes", "2")
    assert f"broker    the real EMQX {EMQX_VERSION}" in out, out
    assert_passed(code, out, 2)
