"""The Admin API lives on its own listener (admin_listen), never on the ExHook port EMQX's side reaches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from testkit.harness import ExHookClient, SubprocessServer, admin_stats


def get_stats(port: int) -> Any:
    """Admin GetStats on 127.0.0.1:`port`, plaintext."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return admin_stats(channel)


def test_admin_is_unimplemented_on_the_exhook_port_and_served_on_admin_listen(make_server: Any) -> None:
    """One process: GetStats on the ExHook port gets UNIMPLEMENTED, on the admin port the store's counts."""
    srv = make_server()
    c = ExHookClient(srv.port)
    c.batch(["ADMINPORT1"], "task_ap_1", "x")
    c.close()
    assert srv.server.admin_port and srv.server.admin_port != srv.port
    assert get_stats(srv.server.admin_port).rows == 1
    with pytest.raises(grpc.RpcError) as refused:
        get_stats(srv.port)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_exhook_is_unimplemented_on_the_admin_port(make_server: Any) -> None:
    """The admin listener serves no hooks: a hook call there gets UNIMPLEMENTED."""
    srv = make_server()
    admin_side = ExHookClient(srv.server.admin_port)
    try:
        with pytest.raises(grpc.RpcError) as refused:
            admin_side.batch(["ADMINPORT2"], "task_ap_2", "x")
    finally:
        admin_side.close()
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_empty_admin_listen_serves_no_admin_api(make_server: Any) -> None:
    """admin_listen = "" binds nothing more, and the ExHook port still refuses Admin."""
    srv = make_server(admin_listen="")
    assert srv.server.admin_port == 0 and srv.server.admin_address == ""
    with pytest.raises(grpc.RpcError) as refused:
        get_stats(srv.port)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_single_process_serve_reports_and_logs_the_admin_port(tmp_path: Path) -> None:
    """`serve` with one process: the ready file carries admin_port, server_started logs it, and it answers."""
    srv = SubprocessServer(tmp_path / "lmdb", env={"SDV_FANOUT_PROCESSES": "1"})
    try:
        assert not srv.pids  # one process: no group under the parent
        assert get_stats(srv.admin_port).schema_version >= 1
        [started] = [e for e in srv.events() if e["event"] == "server_started"]
        assert started["admin"] == f"127.0.0.1:{srv.admin_port}"
        with pytest.raises(grpc.RpcError) as refused:
            get_stats(srv.port)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        assert srv.terminate() == 0
