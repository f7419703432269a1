"""Campaign pacing under an injected clock: a rate leased in chunks from the fleet-wide bucket
holds over a simulated minute, the ramp grows it, max_in_flight blocks at the cap, and idle
vehicles are offered capacity when it returns, a bounded number per tick."""

from __future__ import annotations

import asyncio

import pytest

from exhook_server.dispatch.pacing import Lease, LocalBudget, Pacer
from exhook_server.policy import Policy, Ramp


class Clock:
    def __init__(self) -> None:
        self.ms = 1_800_000_000_000

    def __call__(self) -> int:
        return self.ms


def pacer_on(clock: Clock, woken: list[str] | None = None) -> Pacer:
    budget = LocalBudget(lambda: clock.ms / 1000)
    return Pacer(budget, wall_ms=clock, on_wake=woken.extend if woken is not None else None)


def greedy_starts(pacer: Pacer, clock: Clock, rid: str, seconds: float, tick_ms: int = 50) -> int:
    """Start every delivery of `rid` the pacer allows, ticking every `tick_ms` for `seconds`."""
    started = 0
    for _ in range(round(seconds * 1000 / tick_ms)):
        asyncio.run(pacer.tick())
        while rid not in pacer.blocked():
            pacer.started(rid)
            started += 1
        clock.ms += tick_ms
    return started


@pytest.mark.parametrize("per_minute", [60, 600, 6000])
def test_starts_over_a_minute_follow_the_rate(per_minute: int) -> None:
    """Under endless demand, a minute gives the rate within 1 % plus the first token."""
    clock = Clock()
    pacer = pacer_on(clock)
    pacer.set("task_r_1", Policy(max_per_minute=per_minute), clock.ms)
    started = greedy_starts(pacer, clock, "task_r_1", 60)
    assert per_minute * 0.99 <= started <= per_minute * 1.01 + 1


def test_the_ramp_multiplies_the_rate_every_step_up_to_the_maximum() -> None:
    """start 60/min, x2 every 10 s, max 300/min: 10 s at 1/s, 10 s at 2/s, 10 s at 4/s, then 5/s."""
    clock = Clock()
    pacer = pacer_on(clock)
    policy = Policy(max_per_minute=300, ramp=Ramp(60, 2.0, 10))
    assert [policy.rate_per_minute(s * 1000) for s in (0, 9, 10, 20, 30, 3600)] == [60, 60, 120, 240, 300, 300]
    pacer.set("task_r_2", policy, clock.ms)
    steps = [greedy_starts(pacer, clock, "task_r_2", 10) for _ in range(4)]
    assert steps[0] in (10, 11) and 19 <= steps[1] <= 21 and 39 <= steps[2] <= 41 and 49 <= steps[3] <= 51


def test_a_ramp_counts_from_when_the_policy_was_set() -> None:
    """A policy set 25 s ago with a 10 s ramp step is at its third step already (a restart keeps it)."""
    policy = Policy(max_per_minute=1000, ramp=Ramp(10, 3.0, 10))
    assert policy.rate_per_minute(25_000) == 90
    assert policy.rate_per_minute(-5) == 10  # a clock behind the set time: the start rate


def test_max_in_flight_blocks_at_the_cap_and_a_freed_slot_wakes_idle_vehicles() -> None:
    """Two out of a cap of two block the request; one ending lets idle vehicles be offered it."""
    clock = Clock()
    woken: list[str] = []
    pacer = pacer_on(clock, woken)
    pacer.set("task_c_1", Policy(max_in_flight=2), clock.ms)
    pacer.out("task_c_1", 1)
    pacer.out("task_other", 1)
    assert pacer.blocked() == frozenset()
    pacer.out("task_c_1", 1)
    assert pacer.blocked() == {"task_c_1"}
    for vin in ("VIN3", "VIN4", "VIN5", "VIN3"):
        pacer.idle(vin)
    asyncio.run(pacer.tick())
    assert woken == []  # no capacity: nobody offered
    pacer.out("task_c_1", -1)
    assert pacer.blocked() == frozenset() and pacer.in_flight("task_c_1") == 1
    asyncio.run(pacer.tick())
    assert woken == ["VIN3", "VIN4"]  # twice the one free slot, oldest idle first


def test_a_vehicle_idle_for_a_blocked_request_is_offered_only_once_that_request_opens() -> None:
    """A vehicle that found nothing while only a rated request was blocked is not offered another
    request's free slots (it would find nothing again: on PostgreSQL an event each tick); it is
    offered again once the rated request has a token."""
    clock = Clock()
    woken: list[str] = []
    pacer = pacer_on(clock, woken)
    pacer.set("task_w_rated", Policy(max_per_minute=6), clock.ms)
    pacer.set("task_w_capped", Policy(max_in_flight=5), clock.ms)
    asyncio.run(pacer.tick())  # the bucket's first token
    pacer.started("task_w_rated")
    assert pacer.blocked() == {"task_w_rated"}
    pacer.idle("VIN1")
    asyncio.run(pacer.tick())
    assert woken == []  # five free slots of the capped request, none for what VIN1 waits for
    clock.ms += 10_000  # one token of 6 per minute
    asyncio.run(pacer.tick())
    assert woken == ["VIN1"]


def test_a_cap_set_while_deliveries_are_out_counts_them() -> None:
    """Deliveries out before the policy came count against its cap at once."""
    clock = Clock()
    pacer = pacer_on(clock)
    for _ in range(3):
        pacer.out("task_c_2", 1)
    pacer.set("task_c_2", Policy(max_in_flight=3), clock.ms)
    assert pacer.blocked() == {"task_c_2"}
    pacer.set("task_c_2", None, clock.ms)  # cleared: nothing bounds it
    assert pacer.blocked() == frozenset()


def test_idle_vehicles_are_bounded_and_the_oldest_goes_first() -> None:
    """Past max_idle the oldest idle vehicle is forgotten (its next heartbeat brings it)."""
    clock = Clock()
    woken: list[str] = []
    pacer = Pacer(LocalBudget(lambda: clock.ms / 1000), wall_ms=clock, on_wake=woken.extend, max_idle=3)
    pacer.set("task_r_3", Policy(max_per_minute=600), clock.ms)
    for n in range(5):
        pacer.idle(f"VIN{n}")
    asyncio.run(pacer.tick())  # one token leased: two offered
    assert woken == ["VIN2", "VIN3"]


def test_the_fleet_wide_bucket_is_shared_by_every_pacer_leasing_from_it() -> None:
    """Three pacers on one budget (three processes or instances) start the rate together, not three times it."""
    clock = Clock()
    budget = LocalBudget(lambda: clock.ms / 1000)
    pacers = [Pacer(budget, wall_ms=clock) for _ in range(3)]
    for p in pacers:
        p.set("task_r_4", Policy(max_per_minute=600), clock.ms)
    started = 0
    for _ in range(1200):  # 60 s
        for p in pacers:
            asyncio.run(p.tick())
            while "task_r_4" not in p.blocked():
                p.started("task_r_4")
                started += 1
        clock.ms += 50
    assert 594 <= started <= 607


class CountingBudget(LocalBudget):
    """A LocalBudget recording which requests each lease asked for."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(lambda: clock.ms / 1000)
        self.asked: list[list[str]] = []

    async def lease(self, asks: list[Lease]) -> list[int]:
        self.asked.append(sorted(a.request_id for a in asks))
        return self.take(asks)


def test_a_reload_of_many_unchanged_policies_and_idle_ticks_cost_a_lookup_each() -> None:
    """10,000 paced policies reloaded unchanged rebuild nothing; a tick leases only for the
    requests that started a delivery since the last one."""
    clock = Clock()
    budget = CountingBudget(clock)
    pacer = Pacer(budget, wall_ms=clock)
    found = [(f"task_{n}", Policy(max_per_minute=600), clock.ms) for n in range(10_000)]
    pacer.replace_all(found)
    asyncio.run(pacer.tick())  # every new one leases its first chunk
    assert len(budget.asked[-1]) == 10_000
    rebuilds = 0
    rebuild = pacer._rebuild

    def counted() -> None:
        nonlocal rebuilds
        rebuilds += 1
        rebuild()

    pacer._rebuild = counted  # type: ignore[method-assign]
    pacer.replace_all(found)
    assert rebuilds == 0
    pacer.started("task_7")
    clock.ms += 1000  # its bucket has accrued what it spent
    asyncio.run(pacer.tick())
    assert budget.asked[-1] == ["task_7"]
    asyncio.run(pacer.tick())
    assert len(budget.asked) == 2  # nothing spent since: no lease at all


def test_deliveries_carried_over_a_restart_count_until_they_end_are_resent_or_time_out() -> None:
    """Three deliveries out before a restart hold a cap of three; one ends, one is sent again
    (the worker's entry counts it from then on, not twice) and the last stops counting when its
    in-flight timeout passes; one already past it never counts."""
    clock = Clock()
    pacer = pacer_on(clock)
    rid = "task_c_3"
    carried = [("VIN1", rid, clock.ms + 1000), ("VIN2", rid, clock.ms + 5000), ("VIN3", rid, clock.ms + 9000)]
    assert pacer.carry([*carried, ("VIN4", rid, clock.ms)]) == 3
    pacer.set(rid, Policy(max_in_flight=3), clock.ms)
    assert pacer.blocked() == {rid} and pacer.in_flight(rid) == 3
    pacer.ended("VIN2", rid)
    assert pacer.blocked() == frozenset() and pacer.in_flight(rid) == 2
    pacer.out(rid, 1)  # the worker's entry of VIN1's new delivery ...
    pacer.started(rid, "VIN1")  # ... replaces the carried one
    assert pacer.in_flight(rid) == 2
    clock.ms += 8999
    asyncio.run(pacer.tick())
    assert pacer.in_flight(rid) == 2
    clock.ms += 1
    asyncio.run(pacer.tick())
    assert pacer.in_flight(rid) == 1
