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

    def owner(self, key: str) -> str:
        """The node that owns `key`."""
        i = bisect.bisect_left(self._keys, _point(key))
        return self._owners[i % len(self._owners)]
