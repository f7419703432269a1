"""Consistent hashing: which worker owns a VIN.

Each worker id is placed on a 32-bit ring at many points (virtual nodes); a
VIN belongs to the first point at or after its own hash. Adding or removing
one of N workers moves only about 1/N of the VINs, and the mapping depends on
nothing but the worker ids, so the same ring can later span processes or pods.
"""

from __future__ import annotations

import bisect
import zlib
from collections.abc import Iterable

#: Top bits of a hash that index the lookup table (2^16 buckets of 65,536 hash values each).
_SHIFT = 16


def _point(text: str) -> int:
    # CRC-32: stable across processes and hosts (unlike hash()), and ~10x cheaper than a
    # cryptographic hash on the hot path (one call per VIN per batch); spread is ample for a ring.
    return zlib.crc32(text.encode())


class HashRing:
    """An immutable ring over worker ids."""

    def __init__(self, nodes: Iterable[str], vnodes: int = 128) -> None:
        self.nodes = tuple(dict.fromkeys(nodes))
        if not self.nodes:
            raise ValueError("a hash ring needs at least one node")
        points = sorted((_point(f"{node}#{i}"), node) for node in self.nodes for i in range(vnodes))
        self._keys = [p for p, _ in points]
        self._owners = [n for _, n in points]
        # Every hash of a bucket without a ring point has the same owner: one list index instead
        # of a bisection (owner() runs for every VIN of every batch). Buckets holding a point
        # (a few hundred of 65,536) keep None and bisect.
        self._table: list[str | None] = []
        i = 0
        for bucket in range(1 << (32 - _SHIFT)):
            low, high = bucket << _SHIFT, ((bucket + 1) << _SHIFT) - 1
            while i < len(self._keys) and self._keys[i] < low:
                i += 1
            inside = i < len(self._keys) and self._keys[i] <= high
            self._table.append(None if inside else self._owners[i % len(self._owners)])

    def owner(self, key: str) -> str:
        """The node that owns `key`: the first ring point at or after its hash."""
        point = _point(key)
        node = self._table[point >> _SHIFT]
        if node is not None:
            return node
        return self._owners[bisect.bisect_left(self._keys, point) % len(self._owners)]
