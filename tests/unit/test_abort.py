"""The abort rule as values: when a criterion is crossed, what counts as a failed answer, and the
counts a request is judged on (exhook_server/abort.py, exhook_server/policy.py, storage/model.py)."""

from __future__ import annotations

from exhook_server.abort import abort_counts
from exhook_server.policy import AbortCriterion
from storage.model import COUNT_NAMES, Generation, answer_failed


def counts(finished: int, **outcomes: int) -> dict[str, int]:
    return {"finished": finished, "failed": 0, "expired": 0, "answer_failed": 0, **outcomes}


def test_a_criterion_is_crossed_at_its_ratio_only_after_min_finished() -> None:
    """The share reaching the ratio exactly crosses it; below min_finished nothing does."""
    c = AbortCriterion("failed", 0.1, 100)
    assert not c.crossed(counts(99, failed=99))
    assert c.crossed(counts(100, failed=10))
    assert not c.crossed(counts(100, failed=9))
    assert AbortCriterion("expired", 0.3, 1).crossed(counts(10, expired=3))  # 3/10 == 0.3, not 0.29999


def test_a_failed_answer_is_a_json_object_whose_status_is_failed_or_rejected() -> None:
    """Only a parseable JSON object with a string status of failed or rejected counts."""
    assert answer_failed(b'{"status": "failed"}') and answer_failed(b'\n {"status":"rejected", "x": [1]}')
    for other in (b'{"status": "ok"}', b'{"status": "Failed"}', b'["failed"]', b'{"status": "failed"', b"", b"\xff"):
        assert not answer_failed(other), other


def test_abort_counts_sum_the_generations_and_count_every_outcome_as_finished() -> None:
    """finished is every pair with an outcome, over all of the request's generations."""

    def gen(sha: bytes, **c: int) -> Generation:
        return Generation("r", sha, 0, 0, {name: c.get(name, 0) for name in COUNT_NAMES})

    found = abort_counts([gen(b"a", total=5, pending=2, failed=3), gen(b"b", total=4, delivered=1, superseded=3)], 2)
    assert (found["finished"], found["failed"], found["pending"], found["total"], found["answer_failed"]) == (
        7,
        3,
        2,
        9,
        2,
    )
