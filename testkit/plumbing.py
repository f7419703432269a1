"""Bench plumbing shared by the scenario scripts: processes, CPU and RSS accounting, workload names,
table formats.

Each scenario in bench/ reads as the experiment it runs; what they all need to start and watch
processes (a JSON-lines helper, a server's process tree, CPU per phase) and to print their tables
lives here once. Linux only: CPU and RSS come from /proc.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import queue
import random
import resource
import shutil
import signal
import statistics
import string
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from storage.lmdb.store import Store
from testkit.harness import ROOT, SubprocessServer

VIN_CHARS = "ABCDEFGHJKLMNPRSTUVWXYZ" + string.digits  # no I, O, Q, as in real VINs
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- processes ----------------------------------------------------------------------------------


def unpack_tree(rev: str, dest: Path, packages: Sequence[str] = ("exhook_server", "storage")) -> Path:
    """`packages` of this repository as of git revision `rev`, unpacked into `dest` (for PYTHONPATH):
    a rig of an older server measured beside this checkout's."""
    tar = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev, *packages],
        capture_output=True,
        check=True,
    ).stdout
    dest.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        tf.extractall(dest, filter="data")
    return dest


def descendants(pid: int) -> list[int]:
    """pid and every process below it (walks /proc: this kernel has no task/*/children)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def tree_cpu_s(pids: Iterable[int]) -> float:
    """utime + stime of these processes (all threads); a process gone counts 0."""
    return sum(proc_cpu_s(p) for p in pids)


def own_cpu_s() -> float:
    """This process's CPU seconds (every thread)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run_ns(pids: Iterable[int]) -> int:
    """Nanoseconds on CPU of every thread of these processes (schedstat: finer than the 10 ms ticks
    of /proc/<pid>/stat, which are too coarse for short measurements); a process gone counts 0."""
    total = 0
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            with contextlib.suppress(OSError, ValueError):
                total += int((task / "schedstat").read_text().split()[0])
    return total


def group_cpu_s(pids: Iterable[int]) -> float:
    """run_ns in seconds."""
    return run_ns(pids) / 1e9


def rss_bytes(pids: Iterable[int]) -> int:
    """VmRSS summed over processes (each counts the pages it shares with its parent too; only
    differences of this sum are reported); a process gone counts 0."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
            total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    return total


def quiesce(pids: list[int], timeout_s: float = 30.0, idle_share: float = 0.03) -> None:
    """Wait until the processes used under idle_share of a core in two 0.2 s windows running."""
    deadline = time.monotonic() + timeout_s
    quiet = 0
    while quiet < 2 and time.monotonic() < deadline:
        c0, t0 = sum(map(proc_cpu_s, pids)), time.monotonic()
        time.sleep(0.2)
        busy = (sum(map(proc_cpu_s, pids)) - c0) / (time.monotonic() - t0)
        quiet = quiet + 1 if busy < idle_share else 0


class Child:
    """A helper process speaking JSON lines (testkit/fleet.py); stderr goes to a log file."""

    def __init__(self, name: str, argv: list[str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self._log: IO[bytes] = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1, cwd=ROOT
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"read-{name}", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"{self.name}: no answer within {timeout_s:.0f} s\n{self.log_tail()}") from None
        if line is None:
            raise RuntimeError(f"{self.name} exited ({self.proc.wait(5)}):\n{self.log_tail()}")
        return json.loads(line)  # type: ignore[no-any-return]

    def log_tail(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "quit"})
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(15)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def stop_server(server: SubprocessServer) -> None:
    if server.proc.poll() is None:
        try:
            server.terminate(20)
        except Exception:
            server.kill()


def machine_busy_s() -> float:
    """CPU seconds all CPUs spent busy (not idle or iowait) since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / CLK_TCK  # user nice system irq softirq steal


def thread_cpu_s(pids: list[int]) -> dict[int, float]:
    """utime + stime per thread of some processes."""
    out = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            out[int(task.name)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


class CpuMeter:
    """CPU of named groups of processes over one phase, as a share of one core; plus the rest of the
    machine (processes that are not this bench's) and the busiest thread of the server (over all
    its processes)."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self.t0 = time.monotonic()
        self.wall_s = 0.0  #: the wall time the last shares() covered
        self.c0 = {g: sum(proc_cpu_s(p) for p in pids) for g, pids in groups.items()}
        self.self0 = proc_cpu_s(os.getpid())
        self.machine0 = machine_busy_s()
        self.threads0 = thread_cpu_s(groups["server"])

    def shares(self) -> dict[str, float]:
        """Each group's CPU since the meter started, as a share of one core over `wall_s`."""
        wall = self.wall_s = time.monotonic() - self.t0
        out = {g: (sum(proc_cpu_s(p) for p in pids) - self.c0[g]) / wall for g, pids in self.groups.items()}
        out["bench"] = (proc_cpu_s(os.getpid()) - self.self0) / wall
        out["total"] = sum(out.values())
        out["other processes"] = max(0.0, (machine_busy_s() - self.machine0) / wall - out["total"])
        threads = thread_cpu_s(self.groups["server"])
        out["server busiest thread"] = (
            max((c - self.threads0.get(tid, 0.0) for tid, c in threads.items()), default=0.0) / wall
        )
        return out


# -- fleets: the JSON-lines protocol of testkit/fleet.py ---------------------------------------


def arm_fleets(fleets: Sequence[Child], expect: int, deadline_s: float, **extra: Any) -> None:
    """Start a phase in every fleet process: each VIN is to get `expect` new distinct messages."""
    for c in fleets:
        c.send({"cmd": "phase", "expect": expect, "deadline_s": deadline_s, **extra})
    for c in fleets:
        if not c.recv(30).get("armed"):
            raise RuntimeError(f"{c.name} did not arm")


def collect_fleets(fleets: Sequence[Child], expect_total: int, deadline_s: float) -> list[dict[str, Any]]:
    """The fleets' reports of the phase; raises unless every VIN got every message."""
    done = [c.recv(deadline_s + 30)["done"] for c in fleets]
    distinct = sum(d["distinct"] for d in done)
    if distinct != expect_total or any(d["short"] for d in done):
        raise RuntimeError(f"fleet got {distinct} distinct messages of {expect_total}")
    return done


def cycle_stats(done: list[dict[str, Any]]) -> dict[str, float]:
    """Percentiles of the per-vehicle cycle and its two parts, from the fleets' samples."""
    out = {}
    for key in ("cycle", "fleet", "turn", "rpc"):
        values = [v for d in done for v in d.get(key, ())]
        for q in (50, 99):
            out[f"{key}_p{q}_ms"] = pct(values, q / 100) * 1000 if values else 0.0
    return out


def machine_meta(load_before: float, wall0: float) -> dict[str, Any]:
    """The run's conditions for a report: CPUs, 1-min load average before and now, wall time since
    `wall0` (time.monotonic()), Python version."""
    return {
        "cpus": os.cpu_count(),
        "loadavg_1m_before": load_before,
        "loadavg_1m_after": os.getloadavg()[0],
        "wall_s": time.monotonic() - wall0,
        "python": platform.python_version(),
    }


class Run:
    """A bench run's frame: SIGTERM unwinds through the finally blocks, a tmp dir, progress lines
    stamped with the seconds since the start, and the machine's conditions for the report."""

    def __init__(self, name: str) -> None:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        self.wall0 = time.monotonic()
        self.load_before = os.getloadavg()[0]
        self.tmp = Path(tempfile.mkdtemp(prefix=f"sdv-bench-{name}-"))

    def say(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.wall0:6.1f} s] {msg}", file=sys.stderr, flush=True)

    def meta(self) -> dict[str, Any]:
        """machine_meta, and the code under test (`git describe` of the checkout)."""
        described = ["git", "-C", str(ROOT), "describe", "--always", "--dirty"]
        commit = subprocess.run(described, capture_output=True, text=True, check=False).stdout.strip()
        return {"commit": commit, **machine_meta(self.load_before, self.wall0)}

    @contextlib.contextmanager
    def keeping(self, keep: bool = False, what: str = "server, broker and fleet logs, LMDB") -> Iterator[Path]:
        """The tmp dir for the run's body: removed after a success, kept (and said so) after a
        failure, or always with `keep`."""
        try:
            yield self.tmp
        except BaseException:
            print(f"kept {self.tmp} ({what})", file=sys.stderr)
            raise
        if keep:
            print(f"kept {self.tmp} ({what})", file=sys.stderr)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


def conditions(meta: dict[str, Any]) -> str:
    """The report's closing line: the code under test and the machine's conditions (Run.meta)."""
    seed = f" Seed {meta['seed']}." if "seed" in meta else ""
    return (
        f"Code under test: {meta['commit']} (the checkout, as every bench here). {meta['cpus']} CPUs shared by "
        f"everything; 1-min load average {meta['loadavg_1m_before']:.2f} before, {meta['loadavg_1m_after']:.2f} "
        f"after; {meta['wall_s']:.0f} s wall.{seed}"
    )


def pending_rows(store: Store) -> int:
    """Rows (VIN, request) the server still holds in LMDB (one stat: cheap to poll)."""
    with store.read() as txn:
        return int(txn.stat(store.tables.ids)["entries"])


# -- workload -----------------------------------------------------------------------------------


def make_vins(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    vins: dict[str, None] = {}
    while len(vins) < n:
        vins["LSV" + "".join(rng.choices(VIN_CHARS, k=14))] = None
    return list(vins)


def pct(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of values; NaN for none."""
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def mmm(values: Sequence[float]) -> dict[str, float]:
    """min / median / max, the form every summary keeps a paired ratio in."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def say(*parts: Any) -> None:
    """Progress to stderr (stdout is the report)."""
    print(*parts, file=sys.stderr, flush=True)


# -- table formats ------------------------------------------------------------------------------


def min_med_max(values: Sequence[float], fmt: Callable[[float], str]) -> str:
    return f"{fmt(min(values))} | {fmt(statistics.median(values))} | {fmt(max(values))}"


def num(v: float) -> str:
    return f"{v:,.0f}"


def dec(v: float) -> str:
    return f"{v:.2f}"


def dec3(v: float) -> str:
    return f"{v:.3f}"


def share(v: float) -> str:
    return f"{v * 100:.0f} %"


def mib(v: float) -> str:
    return f"{v / (1 << 20):.1f}"


def alternate(sides: Sequence[str], r: int) -> list[str]:
    """Round r's order of paired sides: as given in even rounds, reversed in odd ones."""
    return list(sides) if r % 2 == 0 else list(sides)[::-1]


def order(sides: Sequence[str], r: int) -> list[str]:
    """Round r's order: rotated every other round and reversed every other, so six rounds run
    all orders of three sides (two sides simply alternate in pairs)."""
    k = (r // 2) % len(sides)
    rotated = [*sides[k:], *sides[:k]]
    return rotated if r % 2 == 0 else rotated[::-1]
