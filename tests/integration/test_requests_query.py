"""Per-request status through the Admin API, the CLI (offline and --server) and grpcurl, on a real server.

Every test stores the same story over gRPC: request `task_q_1` to three vehicles (generation A),
one of them acked, then `task_q_1` again with another payload to one of the others (generation B,
which supersedes that vehicle's A), then `task_q_2` to a fourth vehicle (generation C).
"""

from __future__ import annotations

import functools
import hashlib
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from exhook_server._proto import admin_pb2 as apb
from storage.lmdb import batches
from storage.lmdb.outcomes import Outcome
from storage.lmdb.store import now_ms
from testkit.harness import BIN, ExHookClient, InProcessServer, admin_call, poll, put
from tests.certs import make_pki
from tests.integration.test_tls import sdv_fanout as cli

GRPCURL = str(BIN / "grpcurl")
RID = "task_q_1"


def sha1(data: str) -> str:
    return hashlib.sha1(data.encode()).hexdigest()


A, B, C = sha1("first payload"), sha1("second payload"), sha1("other request")


@dataclass
class Story:
    """The server the story was told to."""

    srv: InProcessServer
    admin: str  # the admin listener, HOST:PORT

    @property
    def data_dir(self) -> str:
        return self.srv.cfg.data_dir


def later_than(ms: int) -> None:
    """Wait until the wall clock has moved past `ms`, so the next change gets a later stamp."""
    poll(lambda: now_ms() > ms, timeout_s=2.0, interval_s=0.001)


def tell_story(srv: InProcessServer) -> Story:
    """Store the module docstring's generations A, B, C through the ExHook port; ack RQ1's A."""
    c = ExHookClient(srv.port)
    try:
        c.batch(["RQ1", "RQ2", "RQ3"], RID, "first payload")
        acked = now_ms()
        # What dispatch does on RQ1's PUBACK: delete the row if still A, recording `delivered`.
        done = srv.server.committer.submit(
            functools.partial(
                batches.delete_row_if,
                t=srv.store.tables,
                vin="RQ1",
                request_id=RID,
                sha1=bytes.fromhex(A),
                now_ms=acked,
                outcome=Outcome.DELIVERED,
                attempts=1,
            )
        ).result(10)
        assert done
        later_than(acked)
        c.batch(["RQ2"], RID, "second payload")
        later_than(now_ms())
        c.batch(["RQ9"], "task_q_2", "other request")
    finally:
        c.close()
    return Story(srv, f"127.0.0.1:{srv.server.admin_port}")


@pytest.fixture
def story(make_server: Any) -> Story:
    return tell_story(make_server())


def admin(story: Story, method: str, request: Any) -> Any:
    """One Admin RPC on the story's admin listener, plaintext."""
    with grpc.insecure_channel(story.admin) as channel:
        return admin_call(channel, method, request)


def counts(m: Any) -> dict[str, int]:
    """A Counts message's non-zero entries."""
    return {f.name: v for f, v in m.ListFields()}


def test_get_request_returns_both_generations_newest_first_with_their_counts(story: Story) -> None:
    """GetRequest shows B then A; A counts the ack as delivered and RQ2's replaced row as superseded."""
    reply = admin(story, "GetRequest", apb.GetRequestRequest(request_id=RID))
    assert reply.request_id == RID
    assert [g.sha1 for g in reply.generations] == [B, A]
    new, old = reply.generations
    assert counts(new.counts) == {"total": 1, "pending": 1}
    assert counts(old.counts) == {"total": 3, "pending": 1, "delivered": 1, "superseded": 1}
    assert old.first_ms < new.first_ms <= new.last_ms
    assert old.last_ms == new.first_ms  # A last changed when B superseded RQ2's row, in B's transaction
    assert {g.request_id for g in reply.generations} == {RID}


def test_get_request_of_an_unknown_request_is_not_found(story: Story) -> None:
    """A request id the store never took gets NOT_FOUND, not an empty answer."""
    with pytest.raises(grpc.RpcError) as missing:
        admin(story, "GetRequest", apb.GetRequestRequest(request_id="task_never_1"))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND


def test_list_requests_pages_newest_first_by_last_change(story: Story) -> None:
    """Pages of 2 give C, then the two task_q_1 generations, then no token; together they equal one big page."""
    everything = admin(story, "ListRequests", apb.ListRequestsRequest(page_size=100))
    listed = [(g.request_id, g.sha1) for g in everything.generations]
    # A and B last changed in the same transaction: the larger key (here: sha1) comes first.
    assert listed == [("task_q_2", C), *sorted([(RID, A), (RID, B)], reverse=True)]
    assert everything.total == 3 and everything.next_page_token == ""
    first = admin(story, "ListRequests", apb.ListRequestsRequest(page_size=2))
    assert [(g.request_id, g.sha1) for g in first.generations] == listed[:2] and first.total == 3
    assert first.next_page_token
    second = admin(story, "ListRequests", apb.ListRequestsRequest(page_size=2, page_token=first.next_page_token))
    assert [(g.request_id, g.sha1) for g in second.generations] == listed[2:]
    assert second.next_page_token == ""
    assert counts(second.generations[0].counts) == counts(everything.generations[2].counts)


def test_list_requests_token_stays_put_when_a_newer_generation_arrives(story: Story) -> None:
    """A generation stored between two pages does not shift the second page (it is ahead of the token)."""
    first = admin(story, "ListRequests", apb.ListRequestsRequest(page_size=1))
    later_than(now_ms())
    c = ExHookClient(story.srv.port)
    c.batch(["RQ10"], "task_q_3", "newest")
    c.close()
    rest = admin(story, "ListRequests", apb.ListRequestsRequest(page_size=100, page_token=first.next_page_token))
    assert [g.request_id for g in rest.generations] == [RID, RID] and rest.total == 4


def test_list_requests_refuses_a_token_it_did_not_give(story: Story) -> None:
    """A malformed page token is INVALID_ARGUMENT."""
    with pytest.raises(grpc.RpcError) as bad:
        admin(story, "ListRequests", apb.ListRequestsRequest(page_token="not-a-token"))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_get_vehicle_lists_the_vehicles_recent_outcomes(story: Story) -> None:
    """GetVehicle shows RQ1's delivery (1 attempt) and RQ2's superseded A next to its pending B."""
    rq1 = admin(story, "GetVehicle", apb.GetVehicleRequest(vin="RQ1"))
    assert not rq1.pending
    [delivered] = rq1.outcomes
    assert (delivered.request_id, delivered.sha1, delivered.outcome, delivered.attempts) == (RID, A, "delivered", 1)
    assert delivered.stored_ms <= delivered.ts_ms
    rq2 = admin(story, "GetVehicle", apb.GetVehicleRequest(vin="RQ2"))
    assert [(p.request_id, p.sha1) for p in rq2.pending] == [(RID, B)]
    assert [(o.sha1, o.outcome, o.attempts) for o in rq2.outcomes] == [(A, "superseded", 0)]
    none = admin(story, "GetVehicle", apb.GetVehicleRequest(vin="RQ3", outcomes_limit=5))
    assert not none.outcomes and len(none.pending) == 1


def test_cli_request_offline_and_server_print_the_same_numbers(story: Story) -> None:
    """`request` on the data dir and with --server give the same JSON, counts as numbers; human lines too."""
    offline = cli("request", RID, "--data-dir", story.data_dir, "--json")
    served = cli("request", RID, "--server", story.admin, "--json")
    assert offline.returncode == 0 and served.returncode == 0, offline.stderr + served.stderr
    doc = json.loads(offline.stdout)
    assert doc == json.loads(served.stdout)
    assert [g["sha1"] for g in doc["generations"]] == [B, A]
    assert doc["generations"][1]["counts"] == {
        "total": 3,
        "pending": 1,
        "delivered": 1,
        "superseded": 1,
        "cancelled": 0,
        "expired": 0,
        "failed": 0,
        "responded": 0,
    }
    human = cli("request", RID, "--data-dir", story.data_dir).stdout
    assert human == cli("request", RID, "--server", story.admin).stdout
    lines = human.splitlines()
    assert lines[0] == f"{RID}: 2 generations, newest first"
    assert lines[2].startswith(f"  sha1 {A}  total 3  pending 1  delivered 1  superseded 1  cancelled 0")


def test_cli_request_of_an_unknown_request_exits_1_both_ways(story: Story) -> None:
    """An unknown request id is an answer (exit 1, one line on stderr), offline and with --server."""
    for where in (["--data-dir", story.data_dir], ["--server", story.admin]):
        out = cli("request", "task_never_1", *where)
        assert out.returncode == 1 and "task_never_1" in out.stderr and not out.stdout, out.stderr


def test_cli_requests_offline_and_server_print_the_same_numbers(story: Story) -> None:
    """`requests` lists every generation newest first both ways; --limit keeps the newest N and the total."""
    offline = json.loads(cli("requests", "--data-dir", story.data_dir, "--json").stdout)
    served = json.loads(cli("requests", "--server", story.admin, "--json").stdout)
    assert offline == served and offline["total"] == 3
    assert [g["request_id"] for g in offline["generations"]] == ["task_q_2", RID, RID]
    limited = cli("requests", "--server", story.admin, "--limit", "1")
    assert limited.returncode == 0, limited.stderr
    assert limited.stdout.splitlines()[0] == "3 generations; the 1 most recently changed first"
    assert limited.stdout == cli("requests", "--data-dir", story.data_dir, "--limit", "1").stdout
    assert (
        len(limited.stdout.splitlines()) == 2
        and "task_q_2" in limited.stdout
        and "total 1  pending 1" in limited.stdout
    )


def test_inspect_shows_the_vehicles_recent_outcomes(story: Story) -> None:
    """`inspect RQ2` offline: B pending, and A's superseded outcome, in JSON and in the human view."""
    doc = json.loads(cli("inspect", "RQ2", "--data-dir", story.data_dir, "--json").stdout)
    assert [p["sha1"] for p in doc["pending"]] == [B]
    assert [(o["request_id"], o["sha1"], o["outcome"]) for o in doc["outcomes"]] == [(RID, A, "superseded")]
    human = cli("inspect", "RQ2", "--data-dir", story.data_dir).stdout
    assert "RQ2: recent outcomes, newest first" in human and "superseded" in human
    served = json.loads(cli("inspect", "RQ1", "--server", story.admin, "--json").stdout)
    assert [(o["outcome"], o["attempts"]) for o in served["outcomes"]] == [("delivered", 1)]


def test_grpcurl_calls_get_request_and_list_requests_through_reflection(story: Story) -> None:
    """grpcurl, with no .proto, gets task_q_1's generations and a page of ListRequests."""
    out = subprocess.run(
        [GRPCURL, "-plaintext", "-d", json.dumps({"request_id": RID}), story.admin, "sdv.fanout.v1.Admin/GetRequest"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert [g["sha1"] for g in reply["generations"]] == [B, A]
    assert reply["generations"][1]["counts"]["superseded"] == "1"  # proto JSON: 64-bit numbers are strings
    page = subprocess.run(
        [GRPCURL, "-plaintext", "-d", '{"page_size": 1}', story.admin, "sdv.fanout.v1.Admin/ListRequests"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert page.returncode == 0, page.stderr
    listed = json.loads(page.stdout)
    assert listed["total"] == "3" and listed["next_page_token"] and len(listed["generations"]) == 1


def test_cli_request_server_reaches_a_mutual_tls_admin_listener(make_server: Any, tmp_path: Path) -> None:
    """request/requests --server present the cli_tls_* certificate to a TLS-only admin listener."""
    pki = make_pki(tmp_path)
    srv = make_server(
        tls_cert_file=str(pki.server_cert), tls_key_file=str(pki.server_key), tls_client_ca_file=str(pki.ca)
    )
    put(srv.server.committer, srv.store, ["TLSRQ1", "TLSRQ2"], "task_tls_1", b"x", now_ms())
    client = ["--cli-tls-ca-file", str(pki.ca), "--cli-tls-cert-file", str(pki.client_cert)]
    client += ["--cli-tls-key-file", str(pki.client_key)]
    admin_at = f"127.0.0.1:{srv.server.admin_port}"
    one = cli("request", "task_tls_1", "--server", admin_at, *client, "--json")
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout)["generations"][0]["counts"]["pending"] == 2
    every = cli("requests", "--server", admin_at, *client, "--json")
    assert every.returncode == 0 and json.loads(every.stdout)["total"] == 1, every.stderr
    plaintext = cli("request", "task_tls_1", "--server", admin_at, "--json")
    assert plaintext.returncode == 2 and "UNAVAILABLE" in plaintext.stderr
