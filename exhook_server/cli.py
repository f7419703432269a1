"""The `sdv-fanout` command: serve, show the configuration, and look into a store.

`stats`, `inspect`, `request`, `requests` and `gc run` read the store through its `Reads` port
(storage/port.py): PostgreSQL when store_url is set, else the LMDB environment, opened
read-only for the reads, so they work on the data dir of a running server (LMDB readers never
block its writer); with `--server` they ask the server's Admin API instead, on its admin
listener, over TLS when it has TLS. Every way prints the same numbers.
Every setting is a flag of `serve`, `check-config` and `gc` (see `flags`).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from exhook_server import __version__, flags, log
from exhook_server.backends.backend import open_backend
from exhook_server.config import ENV_PREFIX, SECRET_SETTINGS, Config, join_host_port, load, loopback, split_host_port
from exhook_server.emqx_api import EmqxApiError
from exhook_server.errors import ConfigError, StorageError
from storage.latency import STAGES, latency_ms
from storage.model import COUNT_NAMES

if TYPE_CHECKING:
    from storage.latency import Counts
    from storage.model import ApplyReport, GcReport, Generation, OutcomeRecord, PageKey, Row
    from storage.port import Reads, Writes

T = TypeVar("T")
#: Outcomes `inspect` shows: the Admin API's default too.
_INSPECT_OUTCOMES = 20

#: What `--server` needs besides the address: the client side of a TLS admin listener.
_CLIENT_SETTINGS = ("cli_tls_ca_file", "cli_tls_cert_file", "cli_tls_key_file", "cli_tls_server_name")


class _NotFound(StorageError):
    """What was asked for is not in the store (exit 1: an answer, not a failure to get one)."""


def _config_args(p: argparse.ArgumentParser, names: Sequence[str] | None = None) -> None:
    p.add_argument("--config", metavar="FILE", help=f"TOML settings file (or {ENV_PREFIX}CONFIG)")
    flags.add_setting_flags(p, names)


def _server_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--server",
        metavar="HOST:PORT",
        nargs="?",
        const="",
        help=f"{what} (the Admin API); without HOST:PORT, the admin_listen of the settings in force",
    )
    _config_args(p, ("data_dir", "store_url", *_CLIENT_SETTINGS))


def _parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="sdv-fanout", description="EMQX ExHook server for SDV request fan-out.")
    top.add_argument("--version", action="version", version=f"sdv-fanout {__version__}")
    sub = top.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the ExHook gRPC server")
    _config_args(serve)
    serve.add_argument(
        "--ready-file", metavar="FILE", help="write {port, admin_port, metrics_port, pid} as JSON here once serving"
    )

    check = sub.add_parser("check-config", help="validate and print the settings in force")
    _config_args(check)
    default = sub.add_parser("default-config", help="print every setting with its default, as TOML")
    for p in (check, default):
        p.add_argument(
            "--show-secrets",
            action="store_true",
            help=f"print passwords, API keys and secrets (masked by default: {', '.join(sorted(SECRET_SETTINGS))})",
        )
    rule = sub.add_parser(
        "ack-rule", help="the EMQX rule that brings PUBACKs to ack_topic_prefix: POST /api/v5/rules body, as JSON"
    )
    _config_args(rule, ("ack_topic_prefix", "request_topic_prefix", "mqtt_clientid_prefix"))
    rule.add_argument(
        "--emqx-before-5.8",
        dest="old_emqx",
        action="store_true",
        help="leave out direct_dispatch (EMQX 5.1 fails every action that sets it)",
    )

    emqx = sub.add_parser("emqx", help="EMQX's side of the integration, through its REST API (emqx_api_url)")
    emqx_sub = emqx.add_subparsers(dest="emqx_command", required=True)
    emqx_sync = emqx_sub.add_parser(
        "sync", help="make EMQX match these settings: ExHook entry, its hook list (reload), the ack rule"
    )
    emqx_sync.add_argument("--dry-run", action="store_true", help="print the differences; change nothing")
    _config_args(emqx_sync)
    emqx_check = emqx_sub.add_parser(
        "check", help="compare EMQX with these settings: exit 0 in sync, 1 on a difference, 2 if EMQX cannot be asked"
    )
    _config_args(emqx_check)

    stats = sub.add_parser("stats", help="rows, blobs, bytes, dedup ratio, early triggers")
    _server_arg(stats, "ask a running server instead")
    stats.add_argument("--json", action="store_true", help="one JSON object")

    inspect = sub.add_parser("inspect", help="a vehicle's pending requests in delivery order, and recent outcomes")
    inspect.add_argument("vin")
    _server_arg(inspect, "ask a running server: adds presence and in flight")
    inspect.add_argument("--json", action="store_true", help="one JSON object")

    request = sub.add_parser(
        "request", help="one request's generations (one per payload), newest first: counts per state"
    )
    request.add_argument("request_id", metavar="REQUEST_ID")
    _server_arg(request, "ask a running server instead")
    request.add_argument("--json", action="store_true", help="one JSON object")

    requests = sub.add_parser("requests", help="every request's generations, newest first by last change")
    _server_arg(requests, "ask a running server instead")
    requests.add_argument("--json", action="store_true", help="one JSON object")
    requests.add_argument(
        "--limit", type=_positive, default=50, metavar="N", help="show the N most recently changed (default 50)"
    )
    cancel = sub.add_parser(
        "cancel", help="end a request's pending rows `cancelled` (of the given vehicles, or of every vehicle)"
    )
    cancel.add_argument("request_id", metavar="REQUEST_ID")
    cancel.add_argument("--vin", action="append", metavar="VIN", help="only this vehicle (repeat for more)")
    _server_arg(cancel, "ask a running server (it also tells which deliveries were already out)")
    cancel.add_argument("--json", action="store_true", help="one JSON object")
    policy = sub.add_parser(
        "policy",
        help="set, clear or show a request's campaign policy (the flags given replace the whole policy)",
    )
    policy.add_argument("request_id", metavar="REQUEST_ID")
    policy.add_argument("--max-per-minute", type=_positive, metavar="N", help="deliveries started per minute")
    policy.add_argument(
        "--ramp", metavar="START,FACTOR,EVERY_S", help="start at START per minute, times FACTOR every EVERY_S"
    )
    policy.add_argument("--max-in-flight", type=_positive, metavar="M", help="vehicles holding a delivery at once")
    policy.add_argument(
        "--abort",
        action="append",
        metavar="OUTCOME:RATIO:MIN_FINISHED",
        help="abort when OUTCOME (failed, expired, answer_failed) reaches RATIO of MIN_FINISHED or more (repeat)",
    )
    policy.add_argument("--start-at", metavar="WHEN", help="nothing is sent before (RFC 3339 or epoch ms)")
    policy.add_argument(
        "--window",
        action="append",
        metavar="CRON|DURATION_S|TZ",
        help='deliveries start only inside: "0 2 * * *|7200|Europe/Berlin" (repeat)',
    )
    policy.add_argument("--paused", action="store_true", help="hold every delivery not yet started")
    policy.add_argument("--priority", choices=("high", "normal"), help="the request's rows before normal ones")
    policy.add_argument("--clear", action="store_true", help="clear the policy")
    policy.add_argument(
        "--preview",
        action="store_true",
        help="when the pending rows of vehicles online now will all have been sent under the policy",
    )
    _server_arg(policy, "set it through a running server (it also sends the status event)")
    policy.add_argument("--json", action="store_true", help="one JSON object")
    db = sub.add_parser("db", help="the PostgreSQL store (store_url)")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    migrate = db_sub.add_parser(
        "migrate", help="create or upgrade the schema at store_url (under an advisory lock: safe beside others)"
    )
    _config_args(migrate, ("store_url",))
    gc = sub.add_parser("gc", help="retention and garbage collection")
    gc_sub = gc.add_subparsers(dest="gc_command", required=True)
    gc_run = gc_sub.add_parser("run", help="one GC pass now (offline, or next to a running server)")
    _config_args(gc_run)
    gc_run.add_argument("--dry-run", action="store_true", help="count what would go; change nothing")
    gc_run.add_argument("--json", action="store_true", help="one JSON object")
    gc_apply = gc_sub.add_parser("apply", help="apply a plan from spark/gc_job.py, re-checking each candidate")
    gc_apply.add_argument("plan", metavar="PLAN", help="the plan directory")
    _config_args(gc_apply)
    gc_apply.add_argument("--dry-run", action="store_true", help="count the candidates; change nothing")
    gc_apply.add_argument("--json", action="store_true", help="one JSON object")

    exp = sub.add_parser(
        "export", help="one consistent snapshot as Parquet, for spark/ (from PostgreSQL when store_url is set)"
    )
    exp.add_argument("--data-dir", metavar="DIR", default=None, help="the LMDB store (when store_url is empty)")
    exp.add_argument("--out", metavar="OUT", required=True, help="output directory")
    _config_args(exp, ("store_url",))
    return top


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _load(args: argparse.Namespace) -> Config:
    path = getattr(args, "config", None) or os.environ.get(ENV_PREFIX + "CONFIG")
    return load(path, overrides=flags.overrides(args))


def _cmd_serve(args: argparse.Namespace) -> int:
    cfg = _load(args)
    log.configure(cfg.log_format, cfg.log_level)
    from exhook_server.procs import serve_main

    return serve_main(cfg, args.ready_file)


def _admin_target(cfg: Config, server: str) -> str:
    """`--server`'s address, or else the admin listener of the settings in force (dialled on
    loopback when it listens on every interface: the CLI runs next to the server)."""
    if server:
        return server
    if not cfg.admin_listen:
        raise ConfigError("admin_listen is empty: this server has no Admin API (or give --server HOST:PORT)")
    host, port = split_host_port(cfg.admin_listen)
    return join_host_port(loopback(host), port)


def _admin_channel(cfg: Config, target: str) -> Any:
    """A channel to the admin listener: TLS when the server has TLS (it serves the admin
    listener with the same certificate) or when a cli_tls_* file is set; plaintext otherwise."""
    import grpc

    if not (cfg.tls_cert_file or cfg.cli_tls_ca_file or cfg.cli_tls_cert_file):
        return grpc.insecure_channel(target)

    def read(path: str) -> bytes | None:
        try:
            return Path(path).read_bytes() if path else None
        except OSError as exc:
            raise ConfigError(f"cannot read TLS file: {exc}") from None

    credentials = grpc.ssl_channel_credentials(
        root_certificates=read(cfg.cli_tls_ca_file),
        private_key=read(cfg.cli_tls_key_file),
        certificate_chain=read(cfg.cli_tls_cert_file),
    )
    options = [("grpc.ssl_target_name_override", cfg.cli_tls_server_name)] if cfg.cli_tls_server_name else []
    return grpc.secure_channel(target, credentials, options)


def _admin_rpc(cfg: Config, server: str, method: str, request: Any) -> Any:
    """One Admin RPC to a running server (`server`, or else the configured admin listener); its
    reply message. NOT_FOUND raises `_NotFound`, any other failure `StorageError`."""
    import grpc
    from google.protobuf import message_factory

    from exhook_server._proto import admin_pb2

    server = _admin_target(cfg, server)
    output = admin_pb2.DESCRIPTOR.services_by_name["Admin"].methods_by_name[method].output_type
    response_cls: Any = message_factory.GetMessageClass(output)
    with _admin_channel(cfg, server) as channel:
        stub = channel.unary_unary(
            f"/sdv.fanout.v1.Admin/{method}",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response_cls.FromString,
        )
        try:
            return stub(request, timeout=30)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise _NotFound(str(exc.details())) from None
            raise StorageError(f"{server}: {exc.code().name}: {exc.details()}") from None


def _admin_call(cfg: Config, server: str, method: str, request: Any) -> dict[str, Any]:
    """`_admin_rpc`'s reply as a dict with every field shown."""
    from google.protobuf.json_format import MessageToDict

    shown: dict[str, Any] = MessageToDict(
        _admin_rpc(cfg, server, method, request),
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
    )
    return shown


def _iso(ms: int) -> str:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC).isoformat(timespec="milliseconds")


def _generation(
    request_id: str, sha1_hex: str, counts: Mapping[str, int], first_ms: int, last_ms: int
) -> dict[str, Any]:
    """One generation as `request` and `requests` print it, whether read from the store or from
    the Admin API (whose JSON would show its 64-bit counts as strings)."""
    return {
        "request_id": request_id,
        "sha1": sha1_hex,
        "counts": {name: int(counts[name]) for name in COUNT_NAMES},
        "first_ms": int(first_ms),
        "last_ms": int(last_ms),
    }


def _stored_generation(g: Generation) -> dict[str, Any]:
    return _generation(g.request_id, g.sha1.hex(), g.counts, g.first_ms, g.last_ms)


def _served_generation(m: Any) -> dict[str, Any]:
    """From the Admin API's `Generation` message (`exhook_server.admin.generation_message`)."""
    counts = {name: getattr(m.counts, name) for name in COUNT_NAMES}
    return _generation(m.request_id, m.sha1, counts, m.first_ms, m.last_ms)


def _with_latency(g: dict[str, Any], latency: Mapping[str, Mapping[str, int]]) -> dict[str, Any]:
    """`g` with its `latency_ms` (`request R` only, and only once a latency is counted: the
    answer of a generation without one is as it was)."""
    return {**g, "latency_ms": {s: {k: int(v) for k, v in p.items()} for s, p in latency.items()}} if latency else g


def _served_latency(m: Any) -> dict[str, dict[str, int]]:
    """The `latency_ms` of an Admin `Generation` message, by stage that has one."""
    return {
        stage: {name: getattr(getattr(m.latency_ms, stage), name) for name in ("p50", "p90", "p99")}
        for stage in STAGES
        if m.HasField("latency_ms") and getattr(m.latency_ms, stage).ByteSize()
    }


def _generation_line(g: Mapping[str, Any]) -> str:
    """A generation's counts on one line, then when it first and last changed."""
    counts = "  ".join(f"{name} {g['counts'][name]}" for name in COUNT_NAMES)
    return f"{counts}  first {_iso(g['first_ms'])}  last {_iso(g['last_ms'])}"


def _on_store(cfg: Config, read: Callable[[Reads], Coroutine[Any, Any, T]], *, writable: bool = False) -> T:
    """`read(reads)` on the store in force; the LMDB data dir opened read-only unless `writable`
    (GC deletes through a group committer)."""

    async def run() -> T:
        async with open_backend(cfg, tool=True, readonly=not writable) as backend:
            return await read(backend.reads)

    return asyncio.run(run())


def _on_store_writes(cfg: Config, work: Callable[[Writes], Coroutine[Any, Any, T]]) -> T:
    """`work(writes)` on the store in force, as a server writes it."""

    async def run() -> T:
        async with open_backend(cfg, tool=True) as backend:
            return await work(backend.writes)

    return asyncio.run(run())


def _cmd_stats(args: argparse.Namespace) -> int:
    cfg = _load(args)
    if args.server is not None:
        from exhook_server._proto import admin_pb2

        stats = _admin_call(cfg, args.server, "GetStats", admin_pb2.GetStatsRequest())
    else:

        async def read(reads: Reads) -> dict[str, Any]:
            return (await reads.stats()).as_dict()

        stats = _on_store(cfg, read)
    if args.json:
        print(json.dumps(stats))
    else:
        width = max(map(len, stats))
        for key, value in stats.items():
            print(f"{key:<{width}}  {value}")
    return 0


def _pending_entry(
    request_id: str, ts_ms: int, sha1_hex: str, size: int, expires_ms: int, wait: bool, priority: str
) -> dict[str, Any]:
    """One pending row as `inspect` shows it, read from the store or from the Admin API."""
    return {
        "request_id": request_id,
        "ts_ms": int(ts_ms),
        "time": _iso(int(ts_ms)),
        "sha1": sha1_hex,
        "size": int(size),
        "expires_at_ms": int(expires_ms) or None,
        "await_response": wait,
        "priority": priority or "normal",
    }


def _outcome_entry(
    request_id: str, sha1_hex: str, outcome: str, ts_ms: int, stored_ms: int, attempts: int, response: bytes
) -> dict[str, Any]:
    """One recent outcome as `inspect` shows it, read from the store or from the Admin API."""
    entry: dict[str, Any] = {
        "request_id": request_id,
        "sha1": sha1_hex,
        "outcome": outcome,
        "ts_ms": int(ts_ms),
        "stored_ms": int(stored_ms),
        "attempts": int(attempts),
    }
    if outcome == "responded":
        entry["response"] = response.decode(errors="replace")
    return entry


def _served_vehicle(cfg: Config, server: str, vin: str) -> dict[str, Any]:
    """`inspect`'s document from a running server: the stored part, plus what only the server
    knows (presence, the delivery in flight, the backlog bound)."""
    from google.protobuf.json_format import MessageToDict

    from exhook_server._proto import admin_pb2

    m = _admin_rpc(cfg, server, "GetVehicle", admin_pb2.GetVehicleRequest(vin=vin, outcomes_limit=_INSPECT_OUTCOMES))
    doc: dict[str, Any] = {
        "vin": vin,
        "pending": [
            _pending_entry(p.request_id, p.ts_ms, p.sha1, p.size, p.expires_at_ms, p.await_response, p.priority)
            for p in m.pending
        ],
        "outcomes": [
            _outcome_entry(o.request_id, o.sha1, o.outcome, o.ts_ms, o.stored_ms, o.attempts, o.response)
            for o in m.outcomes
        ],
        "online": m.online,
        "session": MessageToDict(m.session, preserving_proto_field_name=True) if m.online else None,
        "in_flight": None,
        "backlog": int(m.backlog),
        "at_backlog_bound": m.at_backlog_bound,
    }
    if m.HasField("in_flight"):
        f = m.in_flight
        doc["in_flight"] = {
            "request_id": f.request_id,
            "sha1": f.sha1,
            "age_ms": int(f.age_ms),
            "attempts": int(f.attempts),
            "await_response": f.await_response,
            "acked_age_ms": int(f.acked_age_ms) or None,
            "cancelled": f.cancelled,
        }
    return doc


def _stored_vehicle(cfg: Config, vin: str) -> dict[str, Any]:
    """`inspect`'s document from the store itself."""

    from exhook_server.lanes import in_delivery_order

    async def read(reads: Reads) -> tuple[list[tuple[Row, bool]], list[OutcomeRecord]]:
        rows, ended = await reads.vehicle(vin, _INSPECT_OUTCOMES)
        return await in_delivery_order(reads, rows), ended

    rows, ended = _on_store(cfg, read)
    return {
        "vin": vin,
        "pending": [
            _pending_entry(r.request_id, r.ts_ms, r.sha1.hex(), r.size, r.expires_ms, r.await_response, lane)
            for r, lane in ((r, "high" if high else "normal") for r, high in rows)
        ],
        "outcomes": [
            _outcome_entry(o.request_id, o.sha1.hex(), o.outcome.label, o.ts_ms, o.stored_ms, o.attempts, o.response)
            for o in ended
        ],
    }


def _cmd_inspect(args: argparse.Namespace) -> int:
    cfg = _load(args)
    doc = _stored_vehicle(cfg, args.vin) if args.server is None else _served_vehicle(cfg, args.server, args.vin)
    if args.json:
        print(json.dumps(doc))
        return 0
    vin, pending, recent = args.vin, doc["pending"], doc["outcomes"]
    if "online" in doc:  # what only a running server knows
        session = doc["session"] or {}
        where = f" (clientid {session.get('clientid', '?')} on {session.get('node', '?')})" if doc["online"] else ""
        bound = "  at max_pending_per_vehicle: new rows refused" if doc["at_backlog_bound"] else ""
        print(f"{vin}: {'online' if doc['online'] else 'offline'}{where}{bound}")
        if (f := doc["in_flight"]) is not None:
            state = "  cancelled" if f["cancelled"] else ""
            if f["acked_age_ms"]:
                state += f"  PUBACKed {f['acked_age_ms'] / 1000:.1f} s ago, awaiting its answer"
            print(
                f"{vin}: in flight {f['request_id']}  sha1 {f['sha1']}  sent {f['age_ms'] / 1000:.1f} s ago"
                f"  attempts {f['attempts']}{state}"
            )
    if not pending:
        print(f"{vin}: nothing pending")
    else:
        print(f"{vin}: {len(pending)} pending, in delivery order")
        for i, p in enumerate(pending, 1):
            extra = f"  expires {_iso(p['expires_at_ms'])}" if p["expires_at_ms"] else ""
            extra += "  awaits response" if p["await_response"] else ""
            extra += "  high priority" if p["priority"] == "high" else ""
            print(f"{i:>4}  {p['request_id']:<32} {p['time']}  {p['size']:>9} B  sha1 {p['sha1']}{extra}")
    if recent:
        print(f"{vin}: recent outcomes, newest first")
        for o in recent:
            print(
                f"      {o['request_id']:<32} {_iso(o['ts_ms'])}  {o['outcome']:<10}  attempts {o['attempts']}"
                f"  stored {_iso(o['stored_ms'])}  sha1 {o['sha1']}"
            )
            if "response" in o:
                print(f"        answer: {o['response'][:200]}")
    return 0


def _cmd_request(args: argparse.Namespace) -> int:
    cfg = _load(args)
    if args.server is not None:
        from exhook_server._proto import admin_pb2

        reply = _admin_rpc(cfg, args.server, "GetRequest", admin_pb2.GetRequestRequest(request_id=args.request_id))
        found = [_with_latency(_served_generation(m), _served_latency(m)) for m in reply.generations]
    else:

        async def read(reads: Reads) -> tuple[list[Generation], dict[bytes, Counts]]:
            return await reads.generations(args.request_id), await reads.latency(args.request_id)

        stored, latency = _on_store(cfg, read)
        found = [_with_latency(_stored_generation(g), latency_ms(latency.get(g.sha1, {}))) for g in stored]
        if not found:
            raise _NotFound(f"no generation of request {args.request_id!r} is stored")
    policy, aborted, pacing = _policy_in_force(cfg, args.server, args.request_id)
    if args.json:
        shown: dict[str, Any] = {"request_id": args.request_id, "generations": found}
        if policy is not None:  # only then: the answer of a request without one is as it was
            shown["policy"] = policy
        if aborted is not None:
            shown["aborted"] = aborted
        if pacing is not None:
            shown["pacing"] = pacing
        print(json.dumps(shown))
        return 0
    print(f"{args.request_id}: {len(found)} generation{'s' if len(found) > 1 else ''}, newest first")
    for g in found:
        print(f"  sha1 {g['sha1']}  {_generation_line(g)}")
        for stage, p in g.get("latency_ms", {}).items():
            print(f"    {stage} (ms): p50 {p['p50']}  p90 {p['p90']}  p99 {p['p99']}")
    if policy is not None:
        print(f"  policy in force: {json.dumps(policy)}")
    if aborted is not None:
        print(f"  aborted (batches refused until a new policy): {json.dumps(aborted)}")
    if pacing is not None:
        where = "this server" if pacing["scope"] == "group" else "this instance"
        print(
            f"  pacing now: {pacing['in_flight']} in flight, {pacing['started_last_minute']} started"
            f" in the last minute ({where})"
        )
    return 0


def _policy_in_force(
    cfg: Config, server: str | None, request_id: str
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, dict[str, Any] | None]:
    """The campaign policy of `request_id` in force, its abort and its pacing now, where known
    (pacing only from a server's Admin API, with `server`); Nones without a policy."""
    if server is not None:
        from exhook_server._proto import admin_pb2

        try:
            reply = _admin_rpc(cfg, server, "GetPolicy", admin_pb2.GetPolicyRequest(request_id=request_id))
        except _NotFound:
            return None, None, None
        return (
            json.loads(reply.policy) if reply.policy else None,
            json.loads(reply.aborted) if reply.aborted else None,
            json.loads(reply.pacing) if reply.pacing else None,
        )

    async def read(reads: Reads) -> Any:
        return await reads.policy(request_id)

    stored = _on_store(cfg, read)
    if stored is None:
        return None, None, None
    aborted = None if stored.aborted is None else dict(json.loads(stored.aborted))
    return dict(json.loads(stored.doc)), aborted, None


def _cmd_cancel(args: argparse.Namespace) -> int:
    from exhook_server.batch import BatchParser, Cancel, Kind
    from exhook_server.cancel import run_cancel
    from exhook_server.errors import BatchRejected
    from storage.model import now_ms

    cfg = _load(args)
    doc: dict[str, Any] = {"request_id": args.request_id}
    if args.vin:
        doc["ids"] = args.vin
    try:
        parsed = BatchParser(cfg).parse(Kind.CANCEL, cfg.cancel_topic, json.dumps(doc).encode())
    except BatchRejected as rej:
        print(f"sdv-fanout: {rej}", file=sys.stderr)
        return 2
    assert isinstance(parsed, Cancel)
    if args.server is not None:
        from exhook_server._proto import admin_pb2

        request = admin_pb2.CancelRequest(request_id=parsed.request_id, vins=parsed.vins or ())
        reply = _admin_rpc(cfg, args.server, "Cancel", request)
        out: dict[str, Any] = {
            "request_id": parsed.request_id,
            "cancelled": reply.cancelled,
            "in_flight": reply.in_flight,
        }
    else:
        vins = parsed.vins

        async def known(reads: Reads) -> bool:
            return bool(await reads.generations(parsed.request_id))

        if not _on_store(cfg, known):
            raise _NotFound(f"no generation of request {parsed.request_id!r} is stored")

        async def work(writes: Writes) -> int:
            return await run_cancel(writes, parsed.request_id, vins, now_ms(), cfg.cancel_rows)

        total = _on_store_writes(cfg, work)
        # Without the server nobody knows what is out for delivery; a PUBACK still amends it.
        out = {"request_id": parsed.request_id, "cancelled": total, "in_flight": None}
    if args.json:
        print(json.dumps(out))
    else:
        out_note = "" if out["in_flight"] is None else f", {out['in_flight']} of them already out for delivery"
        print(f"{parsed.request_id}: {out['cancelled']} pending row(s) cancelled{out_note}")
    return 0


def _policy_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The policy document the flags give (each flag one field; a malformed flag value is passed
    on as a string, so the policy's own validation names the field)."""
    doc: dict[str, Any] = {}
    if args.max_per_minute is not None:
        doc["max_per_minute"] = args.max_per_minute
    if args.ramp is not None:
        parts = args.ramp.split(",")
        doc["ramp"] = dict(zip(("start_per_minute", "factor", "every_s"), map(_number, parts), strict=False))
    if args.max_in_flight is not None:
        doc["max_in_flight"] = args.max_in_flight
    if args.abort:
        keys = ("outcome", "ratio", "min_finished")
        doc["abort"] = [
            dict(zip(keys, [p[0], *map(_number, p[1:])], strict=False)) for p in (a.split(":") for a in args.abort)
        ]
    if args.start_at is not None:
        doc["start_at"] = _number(args.start_at)
    if args.window:
        keys = ("cron", "duration_s", "tz")
        doc["windows"] = [
            dict(zip(keys, [p[0], *map(_number, p[1:])], strict=False)) for p in (w.split("|") for w in args.window)
        ]
    if args.paused:
        doc["paused"] = True
    if args.priority is not None:
        doc["priority"] = args.priority
    return doc


def _number(text: str) -> Any:
    """An integer or a number when `text` is one, else `text` itself."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _cmd_policy(args: argparse.Namespace) -> int:
    from exhook_server.batch import BatchParser, Kind, PolicyDoc
    from exhook_server.campaign import Campaigns
    from exhook_server.errors import BatchRejected

    cfg = _load(args)
    fields = _policy_fields(args)
    show = not fields and not args.clear
    if fields and args.clear:
        print("sdv-fanout: --clear takes no policy fields", file=sys.stderr)
        return 2
    if args.preview:
        if not show:
            print("sdv-fanout: --preview takes no policy fields", file=sys.stderr)
            return 2
        return _policy_preview(cfg, args)
    try:
        parsed = BatchParser(cfg).parse(
            Kind.POLICY, cfg.policy_topic, json.dumps({**fields, "request_id": args.request_id}).encode()
        )
    except BatchRejected as rej:
        print(f"sdv-fanout: {rej}", file=sys.stderr)
        return 2
    assert isinstance(parsed, PolicyDoc)
    if args.server is not None:
        from exhook_server._proto import admin_pb2

        if show:
            reply = _admin_rpc(cfg, args.server, "GetPolicy", admin_pb2.GetPolicyRequest(request_id=parsed.request_id))
        else:
            request = admin_pb2.SetPolicyRequest(request_id=parsed.request_id, policy=json.dumps(fields))
            reply = _admin_rpc(cfg, args.server, "SetPolicy", request)
        doc = json.loads(reply.policy) if reply.policy else None
        set_ms = reply.set_ms
        aborted = json.loads(reply.aborted) if reply.aborted else None
    else:
        if not show:

            async def work(writes: Writes) -> None:
                await Campaigns(cfg, writes).apply(parsed)

            try:
                _on_store_writes(cfg, work)
            except BatchRejected as rej:
                print(f"sdv-fanout: {rej}", file=sys.stderr)
                return 2

        async def read(reads: Reads) -> Any:
            return await reads.policy(parsed.request_id)

        stored = _on_store(cfg, read)
        doc = None if stored is None else json.loads(stored.doc)
        set_ms = 0 if stored is None else stored.set_ms
        aborted = None if stored is None or stored.aborted is None else json.loads(stored.aborted)
        if show and stored is None:
            raise _NotFound(f"request {parsed.request_id!r} has no policy in force")
    if args.json:
        shown = {"request_id": parsed.request_id, "policy": doc, "set_ms": set_ms or None}
        print(json.dumps({**shown, "aborted": aborted} if aborted is not None else shown))
    elif doc is None:
        print(f"{parsed.request_id}: no policy in force")
    else:
        print(f"{parsed.request_id}: policy set {_iso(set_ms)}: {json.dumps(doc)}")
        if aborted is not None:
            print(f"  aborted (batches refused until a new policy): {json.dumps(aborted)}")
    return 0


def _policy_preview(cfg: Config, args: argparse.Namespace) -> int:
    """`policy R --preview`: exhook_server/forecast.py, on the server (`--server`) or the store."""
    from exhook_server.forecast import forecast
    from storage.model import now_ms

    rid = args.request_id
    if args.server is not None:
        from exhook_server._proto import admin_pb2

        reply = _admin_rpc(cfg, args.server, "Forecast", admin_pb2.ForecastRequest(request_id=rid))
        shown: dict[str, Any] = {
            "request_id": rid,
            "pending": reply.pending,
            "online_now": reply.online_now,
            "completes_at_ms": reply.completes_at_ms or None,
            "policy": json.loads(reply.policy) if reply.policy else None,
            "now_ms": reply.now_ms,
        }
    else:
        now = now_ms()

        async def read(reads: Reads) -> Any:
            return await forecast(reads, rid, now)

        found = _on_store(cfg, read)
        if found is None:
            raise _NotFound(f"no generation of request {rid!r} is stored")
        shown = {
            "request_id": rid,
            "pending": found.pending,
            "online_now": found.online_now,
            "completes_at_ms": found.completes_at_ms,
            "policy": json.loads(found.policy) if found.policy else None,
            "now_ms": now,
        }
    if args.json:
        print(json.dumps(shown))
        return 0
    online = shown["online_now"]
    whose = (
        "(vehicles online now unknown without a server: every row counted)"
        if online is None
        else (f"{online} of them of vehicles online now")
    )
    print(f"{rid}: {shown['pending']} pending row(s), {whose}")
    done = shown["completes_at_ms"]
    if done is None:
        print("  not all sent under its policy as it stands (paused, or beyond the forecast's reach)")
    else:
        print(f"  under its policy all sent by {_iso(done)} (in {max(0, done - shown['now_ms']) / 1000:.0f} s)")
    return 0


def _cmd_db(args: argparse.Namespace) -> int:
    cfg = _load(args)

    applied, version = asyncio.run(open_backend(cfg, tool=True).migrate())
    done = f"applied {', '.join(map(str, applied))}" if applied else "nothing to apply"
    print(f"schema version {version} ({done})")
    return 0


def _cmd_emqx(args: argparse.Namespace) -> int:
    from exhook_server import emqx_sync
    from exhook_server.emqx_api import EmqxApi

    cfg = _load(args)
    api = EmqxApi.from_config(cfg)
    found = emqx_sync.plan(cfg, api)
    for warning in found.warnings:
        print(f"warning: {warning}")
    if args.emqx_command == "check" or args.dry_run:
        for change in found.changes:
            print(f"differs: {change.detail}")
        for problem in found.problems:
            print(f"differs: {problem}")
        if args.emqx_command == "check":
            print(f"emqx check: {'in sync' if found.in_sync else 'NOT in sync'} ({api.base})")
            return 0 if found.in_sync else 1
        print(f"emqx sync --dry-run: {len(found.changes)} change(s) to make, none made")
        return 0
    left = emqx_sync.apply(cfg, api, found, on_change=lambda c: print(f"changed: {c.detail}"))
    for problem in found.problems:
        print(f"note: {problem}")
    for problem in left:
        print(f"problem: {problem}")
    print(f"emqx sync: {len(found.changes)} change(s) made ({api.base})")
    return 1 if left else 0


def _cmd_requests(args: argparse.Namespace) -> int:
    cfg = _load(args)
    found: list[dict[str, Any]] = []
    if args.server is not None:
        from exhook_server._proto import admin_pb2

        token = ""
        while True:  # the server pages at 10,000 at most
            ask = admin_pb2.ListRequestsRequest(page_size=min(args.limit - len(found), 10_000), page_token=token)
            reply = _admin_rpc(cfg, args.server, "ListRequests", ask)
            found.extend(_served_generation(m) for m in reply.generations)
            total, token = reply.total, reply.next_page_token
            if not token or len(found) >= args.limit:
                break
    else:

        async def read(reads: Reads) -> tuple[list[Generation], PageKey | None, int]:
            return await reads.generations_page(args.limit)

        page, _, total = _on_store(cfg, read)
        found = [_stored_generation(g) for g in page]
    if args.json:
        print(json.dumps({"total": total, "generations": found}))
        return 0
    print(f"{total} generations; the {len(found)} most recently changed first")
    width = max((len(g["request_id"]) for g in found), default=0)
    for g in found:
        print(f"  {g['request_id']:<{width}}  sha1 {g['sha1'][:12]}  {_generation_line(g)}")
    return 0


def _progress(total: int | None, unit: str) -> Any:
    """A progress bar on stderr when a person is watching; silent in pipelines."""
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, disable=not sys.stderr.isatty(), file=sys.stderr)


def _cmd_gc(args: argparse.Namespace) -> int:
    from exhook_server.housekeeping import run_gc
    from storage import plan

    cfg = _load(args)
    if args.gc_command == "run":

        async def run(reads: Reads) -> GcReport:
            return await run_gc(cfg, reads, dry_run=args.dry_run)

        _print_report(_on_store(cfg, run, writable=True).as_dict(), args.json)
        return 0
    # A plan from spark/gc_job.py is applied to the store in force.
    path = Path(args.plan)
    plan.read_summary(path)  # not a plan: refused before any store is opened

    async def apply() -> ApplyReport:
        async with open_backend(cfg, tool=True) as backend:
            with _progress(plan.plan_size(path), "candidates") as bar:
                return await backend.apply_plan(path, dry_run=args.dry_run, progress=bar.update)

    _print_report(asyncio.run(apply()).as_dict(), args.json)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    cfg = _load(args)  # --data-dir is the setting's flag here too

    async def run() -> dict[str, Any]:
        async with open_backend(cfg, tool=True, readonly=True) as backend:
            with _progress(await backend.export_size(), "records") as bar:
                return await backend.export(args.out, bar.update)

    print(json.dumps(asyncio.run(run())))
    return 0


def _print_report(out: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:<18} {value}")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `sdv-fanout` console script."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _cmd_serve(args)
        if args.command == "check-config":
            print(_load(args).to_toml(show_secrets=args.show_secrets), end="")
            return 0
        if args.command == "default-config":
            print(Config().to_toml(show_secrets=args.show_secrets), end="")
            return 0
        if args.command == "ack-rule":
            from exhook_server.acks import rule_body

            print(json.dumps(rule_body(_load(args), direct_dispatch=not args.old_emqx), indent=2))
            return 0
        if args.command == "stats":
            return _cmd_stats(args)
        if args.command == "gc":
            return _cmd_gc(args)
        if args.command == "export":
            return _cmd_export(args)
        if args.command == "request":
            return _cmd_request(args)
        if args.command == "requests":
            return _cmd_requests(args)
        if args.command == "cancel":
            return _cmd_cancel(args)
        if args.command == "policy":
            return _cmd_policy(args)
        if args.command == "db":
            return _cmd_db(args)
        if args.command == "emqx":
            return _cmd_emqx(args)
        return _cmd_inspect(args)
    except _NotFound as exc:
        print(f"sdv-fanout: {exc}", file=sys.stderr)
        return 1
    except (ConfigError, StorageError, EmqxApiError) as exc:
        print(f"sdv-fanout: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
