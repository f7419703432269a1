"""testkit/pg_cluster.py: a cluster whose owner died without stopping it (a killed pytest) is
stopped and deleted by the next one made on the machine; a live owner's is left alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from testkit.harness import poll
from testkit.pg_cluster import PgCluster, pid_alive, reap_orphans

_ORPHAN = """
import json, os
from testkit.pg_cluster import PgCluster
c = PgCluster.create(name="orphan")
print(json.dumps({"dir": str(c.dir), "pid": c.pid}), flush=True)
os._exit(0)  # no atexit, no stop: as a SIGKILLed pytest leaves it
"""


def test_a_cluster_whose_owner_died_is_stopped_and_deleted_and_a_live_ones_kept(pg_cluster: PgCluster) -> None:
    made = subprocess.run([sys.executable, "-c", _ORPHAN], capture_output=True, text=True, timeout=120, check=True)
    orphan = json.loads(made.stdout.strip().splitlines()[-1])
    assert Path(orphan["dir"]).is_dir() and pid_alive(orphan["pid"])
    reaped = reap_orphans(Path(orphan["dir"]).parent)
    assert Path(orphan["dir"]) in reaped
    assert not Path(orphan["dir"]).exists()
    poll(lambda: not pid_alive(orphan["pid"]), timeout_s=10)
    assert pg_cluster.dir.is_dir() and pg_cluster.dir not in reaped  # its owner (this process) lives
    assert "1" in pg_cluster.psql("SELECT 1")  # and still serves
