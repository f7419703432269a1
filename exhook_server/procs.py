"""`sdv-fanout serve` with one or several server processes, and the parent that supervises them.

The parent forks N children before anything creates a gRPC object (gRPC does not survive a fork);
each runs a whole server on the same port (SO_REUSEPORT) and LMDB environment (every commit still
fsynced before its hook answers); dispatch spans them (`backends.lmdb.peers`). The parent holds the
ports (port 0: one port for all), serves /metrics for the group, forwards SIGTERM, and stops the group
with exit code 1 when a child dies (a half group would leave VINs without an owner). The children
die with the parent (PR_SET_PDEATHSIG), so `kill -9` of the parent leaves nothing serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import fcntl
import os
import secrets
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import structlog

from exhook_server import memory, preflight
from exhook_server.backends.backend import local_data_dir
from exhook_server.config import Config, join_host_port, loopback, split_host_port
from exhook_server.errors import ConfigError
from exhook_server.group import write_ready_file

log = structlog.get_logger("sdv_fanout.procs")

_PR_SET_PDEATHSIG = 1
#: How long the children may take to report ready before the parent gives up.
_START_TIMEOUT_S = 60.0
_LOCK_NAME = "server.lock"


def serve_main(cfg: Config, ready_file: str | None) -> int:
    """Run the server until SIGTERM/SIGINT; returns the exit code."""
    memory.limit_arenas()  # before any thread or child process exists
    preflight.check(cfg)  # one line naming the setting, before anything is locked, bound or forked
    data_dir = local_data_dir(cfg)
    lock = _lock_data_dir(data_dir) if data_dir is not None else None
    try:
        if cfg.process_count == 1:
            from exhook_server.server import serve  # grpc is imported only when serving

            asyncio.run(serve(cfg, ready_file=ready_file))
            return 0
        return _Supervisor(cfg, ready_file).run()
    finally:
        if lock is not None:
            lock.close()


def _lock_data_dir(data_dir: str) -> Any:
    """One server per data dir: two would both deliver every row (SO_REUSEPORT no longer makes
    a second one on the same port fail). Released by the kernel when the process dies."""
    path = Path(data_dir)
    path.mkdir(parents=True, exist_ok=True)
    handle = open(path / _LOCK_NAME, "a+")  # noqa: SIM115 - held for the life of the server
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise ConfigError(f"data_dir {path}: another sdv-fanout server is running on it") from None
    return handle


def _reserve_port(name: str, address: str) -> socket.socket:
    """Bind (not listen) the gRPC address of setting `name` with SO_REUSEPORT: it fixes the port
    number for all children when the configured port is 0, and keeps it ours while they start."""
    host, port = split_host_port(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"{name} {address}: {preflight.bind_error(exc)}") from None
    # SO_REUSEPORT would let us join another server's group on this port and silently take
    # half of EMQX's calls. Nothing of ours listens yet, so an answer means someone else does.
    with contextlib.suppress(OSError), socket.create_connection((loopback(host), sock.getsockname()[1]), timeout=1.0):
        sock.close()
        raise ConfigError(f"{name} {address}: address already in use by another server")
    return sock


class _Supervisor:
    """The parent of a group of server processes."""

    def __init__(self, cfg: Config, ready_file: str | None) -> None:
        self.cfg = cfg
        self.ready_file = ready_file
        self.children: dict[int, int] = {}  # pid → index
        self.stopping = False
        self.code = 0

    def run(self) -> int:
        n = self.cfg.process_count
        sock = _reserve_port("listen", self.cfg.listen)
        port = sock.getsockname()[1]
        try:
            admin_sock = _reserve_port("admin_listen", self.cfg.admin_listen) if self.cfg.admin_listen else None
        except ConfigError:
            sock.close()
            raise
        admin_port = admin_sock.getsockname()[1] if admin_sock else 0
        metrics_dir = tempfile.mkdtemp(prefix="sdv-fanout-metrics-") if self.cfg.metrics_listen else None
        if metrics_dir:
            # Before prometheus_client is imported anywhere: it picks its value store at import.
            assert "prometheus_client" not in sys.modules, "prometheus_client imported before the fork"
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
        # The children bind the admin port the parent reserved (the actual number when it was 0).
        admin_listen = join_host_port(split_host_port(self.cfg.admin_listen)[0], admin_port) if admin_sock else ""
        child_cfg = dataclasses.replace(self.cfg, metrics_listen="", admin_listen=admin_listen)
        key = f"{os.getpid()}-{secrets.token_hex(4)}"
        from exhook_server.backends.lmdb.peers import Group

        ready_r, ready_w = os.pipe()
        parent = os.getpid()
        for index in range(n):
            pid = os.fork()
            if pid == 0:  # child
                os.close(ready_r)
                sock.close()
                if admin_sock:
                    admin_sock.close()
                os._exit(_child(child_cfg, Group(index, n, key, port), ready_w, parent))
            self.children[pid] = index
        os.close(ready_w)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        http = None
        try:
            if not self._wait_ready(ready_r, n):
                return self._finish(1)
            metrics_port = 0
            if metrics_dir:
                try:
                    http, metrics_port = _serve_group_metrics(self.cfg.metrics_listen, metrics_dir)
                except ConfigError:
                    self._finish(2)  # stop the children before reporting the bad address
                    raise
            if self.ready_file:
                write_ready_file(
                    self.ready_file,
                    {
                        "port": port,
                        "admin_port": admin_port,
                        "metrics_port": metrics_port,
                        "pid": os.getpid(),
                        "pids": sorted(self.children),
                    },
                )
            log.info(
                "server_group_started",
                listen=f"{self.cfg.host_port[0]}:{port}",
                admin=admin_listen or "off",
                metrics=join_host_port(split_host_port(self.cfg.metrics_listen)[0], metrics_port) if http else "off",
                processes=n,
                pid=os.getpid(),
            )
            return self._finish(0)
        finally:
            os.close(ready_r)
            sock.close()
            if admin_sock:
                admin_sock.close()
            if http is not None:
                http.shutdown()
                http.server_close()
            if metrics_dir:
                shutil.rmtree(metrics_dir, ignore_errors=True)

    # -- parent side -------------------------------------------------------------
    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self.stopping:
            log.info("shutdown_requested", signal=signal.Signals(signum).name, processes=len(self.children))
        self._stop_children()

    def _stop_children(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        # The children bound their own drain by shutdown_timeout_s; this is the backstop.
        killer = threading.Timer(self.cfg.shutdown_timeout_s + 5.0, self._kill_children)
        killer.daemon = True
        killer.start()

    def _kill_children(self) -> None:
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _reaped(self, pid: int, status: int) -> None:
        index = self.children.pop(pid, None)
        if index is None:
            return
        code = os.waitstatus_to_exitcode(status)
        with contextlib.suppress(Exception):
            from prometheus_client import multiprocess

            multiprocess.mark_process_dead(pid)  # type: ignore[no-untyped-call]
        if not self.stopping:
            log.error("server_process_died", process=index, pid=pid, exit_code=code)
            self.code = 1
            self._stop_children()
        elif code not in (0, -signal.SIGTERM):
            self.code = self.code or 1

    def _wait_ready(self, ready_r: int, n: int) -> bool:
        """Until every child reported ready; False if one died first or start-up timed out."""
        ready: set[bytes] = set()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while len(ready) < n:
            if self.stopping or time.monotonic() > deadline:
                self._stop_children()
                return False
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid:
                    self._reaped(pid, status)
                    return False
            readable, _, _ = select.select([ready_r], [], [], 0.2)
            if readable:
                data = os.read(ready_r, 4096)
                if not data:
                    return False
                ready.update(data.split())
        return True

    def _finish(self, code: int) -> int:
        """Wait for every child to exit (stopping them first when `code` is an error)."""
        if code:
            self.code = code
            self._stop_children()
        while self.children:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
            self._reaped(pid, status)
        log.info("server_group_stopped", exit_code=self.code)
        return self.code


def _serve_group_metrics(listen: str, metrics_dir: str) -> tuple[Any, int]:
    """/metrics for the whole group: prometheus-client sums the children's value files."""
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=metrics_dir)  # type: ignore[no-untyped-call]
    host, port = split_host_port(listen)
    try:
        http, _ = start_http_server(port, host, registry=registry)
    except OSError as exc:
        raise ConfigError(f"metrics_listen {listen}: {preflight.bind_error(exc)}") from None
    return http, int(http.server_port)


# -- child side -----------------------------------------------------------------
def _child(cfg: Config, group: Any, ready_w: int, parent: int) -> int:
    """One server process of the group; returns its exit code."""
    # Die with the parent, whatever kills it; then check it did not die before this line.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        return 1
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)  # the child's event loop installs its own
    structlog.contextvars.bind_contextvars(process=group.index)  # on every log line of this process
    try:
        from exhook_server.server import serve

        def ready(port: int) -> None:
            os.write(ready_w, b"%d\n" % group.index)
            os.close(ready_w)

        asyncio.run(serve(cfg, group=group, on_ready=ready))
        return 0
    except ConfigError as exc:
        log.error("server_process_failed", process=group.index, reason="config", detail=str(exc))
        return 2
    except BaseException:
        log.exception("server_process_failed", process=group.index, reason="error")
        return 1
