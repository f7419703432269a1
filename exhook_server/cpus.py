"""How many CPUs this process may really use: its affinity, capped by a cgroup CPU quota.

A pod limited to 2 CPUs on a 64-core node still sees 64 CPUs in its affinity mask; only the
cgroup's CFS quota tells. One server process per visible CPU would then start 64 processes
that share 2 CPUs' worth of time, each with its own gRPC server, MQTT client and memory.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _quota_cpus(root: Path) -> float | None:
    """CPUs the cgroup quota allows (quota / period), or None when there is no quota."""
    v2 = root / "cpu.max"  # cgroup v2: "<quota|max> <period>"
    try:
        quota, _, period = v2.read_text().strip().partition(" ")
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1: quota -1 = none
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """CPUs in this process's affinity mask, capped by the cgroup quota (rounded up), at least 1."""
    visible = len(os.sched_getaffinity(0)) or 1
    quota = _quota_cpus(root)
    return max(1, min(visible, math.ceil(quota))) if quota else visible
