"""The consistent-hash ring that assigns VINs to workers."""

from __future__ import annotations

from collections import Counter

import pytest

from exhook_server.dispatch.ring import HashRing

VINS = [f"WVW{n:014d}" for n in range(20_000)]


def test_same_vin_same_owner_across_instances() -> None:
    """Ownership depends only on worker ids, not on the process or the order they were given in."""
    a, b = HashRing(["w0", "w1", "w2"]), HashRing(["w2", "w0", "w1"])
    assert all(a.owner(v) == b.owner(v) for v in VINS[:2000])


def test_load_is_spread_evenly() -> None:
    """With 128 virtual nodes no worker gets more than 1.3x its fair share."""
    ring = HashRing([f"w{i}" for i in range(8)])
    counts = Counter(ring.owner(v) for v in VINS)
    assert len(counts) == 8
    assert max(counts.values()) < 1.3 * len(VINS) / 8


@pytest.mark.parametrize("n", [2, 4, 8])
def test_adding_a_worker_moves_about_one_in_n_plus_one(n: int) -> None:
    """Growing from N to N+1 workers moves ~1/(N+1) of the VINs, all of them to the new worker."""
    old = HashRing([f"w{i}" for i in range(n)])
    new = HashRing([f"w{i}" for i in range(n + 1)])
    moved = [v for v in VINS if old.owner(v) != new.owner(v)]
    assert {new.owner(v) for v in moved} == {f"w{n}"}
    assert abs(len(moved) / len(VINS) - 1 / (n + 1)) < 0.06


def test_removing_a_worker_moves_only_its_vins() -> None:
    """Shrinking moves exactly the VINs of the removed worker."""
    old = HashRing(["w0", "w1", "w2", "w3"])
    new = HashRing(["w0", "w1", "w3"])
    for v in VINS[:5000]:
        if old.owner(v) != "w2":
            assert new.owner(v) == old.owner(v)


def test_empty_ring_is_refused() -> None:
    """A ring without workers is a configuration error, not a silent drop."""
    with pytest.raises(ValueError):
        HashRing([])


def test_lookup_table_agrees_with_the_ring_at_every_boundary() -> None:
    """The bucket table gives the owner the bisection would, also right at, before and after
    every ring point and at both ends of the hash space."""
    import bisect

    ring = HashRing([f"p{p}w{i}" for p in range(2) for i in range(3)])

    def reference(point: int) -> str:
        return ring._owners[bisect.bisect_left(ring._keys, point) % len(ring._owners)]

    probes = {0, (1 << 32) - 1} | {k + d for k in ring._keys for d in (-1, 0, 1) if 0 <= k + d < 1 << 32}
    probes |= {b << 16 for b in range(0, 1 << 16, 97)}
    for point in probes:
        bucket = ring._table[point >> 16]
        assert (bucket or reference(point)) == reference(point), point
    assert sum(b is None for b in ring._table) <= len(ring._keys)
