"""The ingest byte budget and the deserializers that consult it: admit, refuse at once, give back."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from exhook_server import decoding
from exhook_server._proto import exhook_v3_pb2 as pb
from exhook_server.admission import IngestBudget

MiB = 1 << 20


def refused_total() -> float:
    return REGISTRY.get_sample_value("sdv_fanout_batches_refused_total") or 0.0


def test_calls_are_admitted_until_the_budget_is_spent() -> None:
    """Charges add up to the limit; the call that would pass it is refused, the others keep theirs."""
    budget = IngestBudget(10 * MiB)
    assert budget.try_acquire(6 * MiB)
    assert budget.try_acquire(4 * MiB)
    before = refused_total()
    with capture_logs() as logs:
        assert not budget.try_acquire(1)
    assert budget.in_use == 10 * MiB
    assert refused_total() == before + 1
    assert logs == [
        {
            "event": "batch_refused_overload",
            "size": 1,
            "in_progress_bytes": 10 * MiB,
            "limit_bytes": 10 * MiB,
            "log_level": "warning",
        }
    ]


def test_released_bytes_admit_the_next_call() -> None:
    """Once a call gives its charge back, a call of that size fits again and the gauge follows."""
    budget = IngestBudget(4 * MiB)
    assert budget.try_acquire(3 * MiB)
    assert not budget.fits(2 * MiB)
    budget.release(3 * MiB)
    assert budget.fits(2 * MiB) and budget.try_acquire(2 * MiB)
    assert REGISTRY.get_sample_value("sdv_fanout_ingest_inflight_bytes") == 2 * MiB
    budget.release(2 * MiB)
    assert budget.in_use == 0


def test_a_call_larger_than_the_budget_runs_alone() -> None:
    """An oversize call is charged the whole budget: admitted when idle, refused when anything runs."""
    budget = IngestBudget(4 * MiB)
    charge = budget.charge(10 * MiB)
    assert charge == 4 * MiB
    assert budget.fits(10 * MiB) and budget.try_acquire(charge)
    budget.release(charge)
    assert budget.try_acquire(1)
    assert not budget.fits(10 * MiB)


def test_releasing_more_than_was_taken_is_an_error() -> None:
    """A double release would let the budget drift open; it raises instead."""
    budget = IngestBudget(MiB)
    assert budget.try_acquire(100)
    with pytest.raises(ValueError):
        budget.release(200)


def test_every_call_counts_towards_the_churn_seen() -> None:
    """Admitted, refused and turned-away bytes all count as memory that went through ingest."""
    budget = IngestBudget(MiB)
    budget.try_acquire(MiB)
    budget.try_acquire(MiB)
    budget.turn_away(3 * MiB)
    assert budget.seen_total == 5 * MiB


def test_deserializer_turns_a_large_message_away_unparsed_when_it_cannot_fit() -> None:
    """With the budget full, a large OnMessagePublish becomes Overloaded; a small one is still parsed."""
    budget = IngestBudget(MiB)
    budget.try_acquire(MiB)
    parse = decoding.deserializer(pb.MessagePublishRequest, budget.fits)
    big = pb.MessagePublishRequest(message=pb.Message(topic="$SDV-FANOUT", payload=b"x" * (100 << 10)))
    small = pb.MessagePublishRequest(message=pb.Message(topic="ecp/VIN1/heartbeat", payload=b"{}"))
    assert parse(big.SerializeToString()) == decoding.Overloaded(big.ByteSize())
    assert parse(small.SerializeToString()) == small


def test_deserializer_never_raises_on_bad_bytes() -> None:
    """Garbage and invalid UTF-8 become Malformed with the parser's reason, not an exception."""
    parse = decoding.deserializer(pb.ClientConnectedRequest)
    garbage = parse(b"\xff\xff\xff\xff")
    assert isinstance(garbage, decoding.Malformed)
    assert (garbage.message_type, garbage.size) == ("emqx.exhook.v3.ClientConnectedRequest", 4)
    bad_utf8 = pb.ClientConnectedRequest(clientinfo=pb.ClientInfo(clientid="ok")).SerializeToString()
    bad = parse(bad_utf8.replace(b"ok", b"o\xff"))
    assert isinstance(bad, decoding.Malformed) and "UTF-8" in bad.detail
