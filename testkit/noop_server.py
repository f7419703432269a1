"""A no-op ExHook HookProvider server, as grpc.aio or as the sync thread-pool server.

Used by bench/grpc_flavour.py to measure what the gRPC flavour alone costs: every
RPC parses its request with the project's generated v3 classes and answers like
a provider without an opinion (IGNORE for valued hooks, EmptySuccess for the
rest, an empty hook list for OnProviderLoaded). No storage, no logging.

    python -m testkit.noop_server --flavour aio|sync --ready-file FILE [--listen 127.0.0.1:0]

Writes {"port", "pid", "flavour"} to the ready file once serving; stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import message_factory

from exhook_server._proto import exhook_v3_pb2 as pb
from testkit.harness import ROOT

SERVICE = "emqx.exhook.v3.HookProvider"

#: The same channel options as exhook_server/server.py, so only the flavour differs.
OPTIONS = [
    ("grpc.max_receive_message_length", 2 * (4 << 20) + (1 << 20)),
    ("grpc.max_send_message_length", 2 * (4 << 20) + (1 << 20)),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
]

_EMPTY = pb.EmptySuccess()
_IGNORE = pb.ValuedResponse(type=pb.ValuedResponse.IGNORE)
_LOADED = pb.LoadedResponse()


def _methods() -> Iterator[tuple[str, Any, Any]]:
    for method in pb.DESCRIPTOR.services_by_name["HookProvider"].methods:
        yield (
            method.name,
            message_factory.GetMessageClass(method.input_type),
            message_factory.GetMessageClass(method.output_type),
        )


def _answer(response_cls: Any) -> Any:
    if response_cls is pb.ValuedResponse:
        return _IGNORE
    if response_cls is pb.LoadedResponse:
        return _LOADED
    return _EMPTY


def _sync_handler(answer: Any) -> Callable[[Any, grpc.ServicerContext], Any]:
    def handle(request: Any, context: grpc.ServicerContext) -> Any:
        return answer

    return handle


def _aio_handler(answer: Any) -> Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Any]:
    async def handle(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return answer

    return handle


def generic_handler(flavour: str) -> grpc.GenericRpcHandler:
    make = _aio_handler if flavour == "aio" else _sync_handler
    methods = {
        name: grpc.unary_unary_rpc_method_handler(
            make(_answer(response_cls)),
            request_deserializer=request_cls.FromString,
            response_serializer=response_cls.SerializeToString,
        )
        for name, request_cls, response_cls in _methods()
    }
    return grpc.method_handlers_generic_handler(SERVICE, methods)


def _write_ready(path: str, port: int, flavour: str) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps({"port": port, "pid": os.getpid(), "flavour": flavour}))
    tmp.replace(path)


async def _serve_aio(listen: str, ready_file: str) -> None:
    server = grpc.aio.server(options=OPTIONS)
    server.add_generic_rpc_handlers((generic_handler("aio"),))
    port = server.add_insecure_port(listen)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    _write_ready(ready_file, port, "aio")
    await stop.wait()
    await server.stop(1.0)


def _serve_sync(listen: str, ready_file: str) -> None:
    server = grpc.server(ThreadPoolExecutor(max_workers=10), options=OPTIONS)
    server.add_generic_rpc_handlers((generic_handler("sync"),))
    port = server.add_insecure_port(listen)
    server.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    _write_ready(ready_file, port, "sync")
    while not stop.wait(0.5):
        pass
    server.stop(1.0).wait(5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavour", choices=("aio", "sync"), required=True)
    parser.add_argument("--listen", default="127.0.0.1:0", help="loopback address (default 127.0.0.1:0)")
    parser.add_argument("--ready-file", required=True, help='{"port", "pid"} as JSON once serving')
    args = parser.parse_args()
    if not args.listen.startswith(("127.0.0.1:", "[::1]:", "localhost:")):
        parser.error("--listen must be a loopback address")
    if args.flavour == "aio":
        asyncio.run(_serve_aio(args.listen, args.ready_file))
    else:
        _serve_sync(args.listen, args.ready_file)
    return 0


def wait_ready(
    proc: subprocess.Popen[bytes],
    ready: Path,
    log_path: Path,
    log: Any,
    name: str,
    stop: Any,
    timeout_s: float = 30.0,
) -> dict[str, Any]:
    """The JSON a started server writes to its ready file, polled until it is there; a server
    that exits first (its log closed and quoted) or takes longer than timeout_s (stopped) raises."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            log.close()
            raise RuntimeError(f"{name} exited:\n{log_path.read_text(errors='replace')[-3000:]}")
        try:
            return json.loads(ready.read_text())  # type: ignore[no-any-return]
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        if time.monotonic() > deadline:
            stop()
            raise RuntimeError(f"{name} did not start within {timeout_s:.0f} s")
        time.sleep(0.02)  # polling a file another process writes; bounded by the deadline


class NoopServer:
    """testkit/noop_server.py as a child process."""

    def __init__(self, flavour: str, tmp: Path) -> None:
        self.flavour = flavour
        ready = tmp / f"{flavour}.ready.json"
        self.log_path = tmp / f"{flavour}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "testkit.noop_server", "--flavour", flavour, "--ready-file", str(ready)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        info = wait_ready(self.proc, ready, self.log_path, self._log, f"{flavour} server", self.stop)
        self.port: int = info["port"]
        self.pid: int = self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


if __name__ == "__main__":
    sys.exit(main())
