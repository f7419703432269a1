"""A flood of large batch calls against the server configured as deploy/k8s ships it.

The pod's memory limit, its number of server processes and its config.toml are read from the
manifests, so this test follows them: what it proves is what the StatefulSet promises.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
import yaml

from storage.lmdb.store import Store
from testkit.flood import RssSampler, flood, hwm_bytes
from testkit.harness import ROOT, SubprocessServer, alive, poll
from testkit.plumbing import rss_bytes

pytestmark = pytest.mark.slow

K8S = ROOT / "deploy" / "k8s"
_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
#: What a flood may leave resident per server process once it is over: the LMDB pages it read
#: through the map (its 8 blobs, 8 MiB) and the growth of Python's small-object heap; 20-30 MiB
#: in our runs. The failure this guards against kept 1.2 GiB (glibc arenas never trimmed).
RETAINED_PER_PROCESS = 48 << 20


def quantity(text: str) -> int:
    """A Kubernetes memory quantity in bytes (`2Gi`, `512Mi`, plain bytes)."""
    for suffix, factor in _UNITS.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * factor
    return int(text)


def shipped() -> tuple[int, int, str]:
    """The StatefulSet's memory limit and server processes (its CPU request), and the ConfigMap's config.toml."""
    sts = yaml.safe_load((K8S / "statefulset.yaml").read_text())
    [container] = sts["spec"]["template"]["spec"]["containers"]
    [processes] = [e for e in container["env"] if e["name"] == "SDV_FANOUT_PROCESSES"]
    assert processes["valueFrom"]["resourceFieldRef"]["resource"] == "requests.cpu"
    resources = container["resources"]
    config = yaml.safe_load((K8S / "configmap.yaml").read_text())["data"]["config.toml"]
    return quantity(resources["limits"]["memory"]), int(resources["requests"]["cpu"]), config


def metric(srv: SubprocessServer, name: str) -> float:
    """A counter summed over the group, from the parent's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_flood_of_large_batches_stays_under_half_the_pod_memory_limit(tmp_path: Path) -> None:
    """2 x 500 concurrent 1 MB batches: peak under half the limit, RSS back after, each call stored or refused."""
    limit, processes, config = shipped()
    (tmp_path / "config.toml").write_text(config)
    srv = SubprocessServer(
        tmp_path / "lmdb", "--config", str(tmp_path / "config.toml"), env={"SDV_FANOUT_PROCESSES": str(processes)}
    )
    try:
        pids = [srv.proc.pid, *srv.pids]  # the parent and every server process: the whole pod
        start = rss_bytes(pids)
        with RssSampler(pids) as sampler:
            result = flood(srv.port, channels=2, calls=500, payload_bytes=1 << 20, blobs=8)
        peak = max(hwm_bytes(pids), sampler.peak)
        report = f"peak {peak >> 20} MiB, start {start >> 20} MiB, answers {dict(result.codes)} {result.details}"
        # UNAVAILABLE only for a commit past its deadline (the disk shared with other work): a defined
        # answer, and the write may still land, so its rows are allowed below, not required.
        assert set(result.codes) <= {"OK", "RESOURCE_EXHAUSTED", "UNAVAILABLE"}, report
        assert result.codes["UNAVAILABLE"] == len(result.undecided), report
        assert sum(result.codes.values()) == 1000
        assert peak < limit // 2, report
        refused = result.codes["RESOURCE_EXHAUSTED"]
        assert refused > 0 and metric(srv, "sdv_fanout_batches_refused_total") == refused, report
        allowed = start + processes * RETAINED_PER_PROCESS
        try:
            # Writes whose callers stopped waiting (commit past its deadline) still finish first.
            poll(lambda: rss_bytes(pids) <= allowed, timeout_s=60, interval_s=0.2)
        except AssertionError:
            raise AssertionError(f"RSS {rss_bytes(pids) >> 20} MiB, not back under {allowed >> 20}; {report}") from None
        assert all(map(alive, pids)), "a server process died"
    finally:
        assert srv.terminate() == 0
    with Store(tmp_path / "lmdb", readonly=True) as store:
        landed = [u for u in result.undecided if store.pending(u[0])]
        assert store.row_count() == len(result.stored) + len(landed)
        for vin, request_id, sha1 in [*result.stored, *landed]:
            [row] = store.pending(vin)
            assert (row.request_id, row.sha1) == (request_id, sha1)
        assert all(store.blob(sha1) is not None for sha1 in {s for _, _, s in [*result.stored, *landed]})
