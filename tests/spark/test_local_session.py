"""A job run locally (`python -m spark.gc_job ...`, no cluster) listens on loopback only and starts
no web UI: its own session says so (spark.LOCAL_CONF), whatever the machine's address is. Before,
the driver bound the host's address and the UI listened on every interface at 4040."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys

from testkit.harness import ROOT
from tests.spark.conftest import _need_java


def test_a_local_job_session_listens_on_loopback_only_without_a_ui() -> None:
    _need_java()
    # The job's own settings only: none of the tests' loopback settings (conftest.LOOPBACK_CONF).
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_SUBMIT_ARGS", "SPARK_LOCAL_IP")}
    env["PYSPARK_SUBMIT_ARGS"] = "--driver-java-options -XX:TieredStopAtLevel=1 pyspark-shell"  # startup only
    out = subprocess.run(
        [sys.executable, "-m", "tests.spark.listeners"], capture_output=True, text=True, timeout=240, env=env, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["ui"] is None
    assert seen["listening"], "the driver listens somewhere"
    hosts = {address.rsplit(":", 1)[0] for address in seen["listening"]}
    assert all(ipaddress.ip_address(h).is_loopback for h in hosts), seen["listening"]
