"""The `sdv-fanout` command: serve, show the configuration, and look into a store.

`stats` and `inspect` open the LMDB environment read-only, so they work on the
data dir of a running server (LMDB readers never block its writer); with `--server`
they ask the server's Admin API instead, on its admin listener, over TLS when it has TLS.
Every setting is a flag of `serve`, `check-config` and `gc` (see `flags`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from exhook_server import __version__, flags, log
from exhook_server.config import ENV_PREFIX, Config, join_host_port, load, loopback, split_host_port
from exhook_server.errors import ConfigError, StorageError

#: What `--server` needs besides the address: the client side of a TLS admin listener.
_CLIENT_SETTINGS = ("cli_tls_ca_file", "cli_tls_cert_file", "cli_tls_key_file", "cli_tls_server_name")


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
    _config_args(p, ("data_dir", *_CLIENT_SETTINGS))


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
    sub.add_parser("default-config", help="print every setting with its default, as TOML")
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

    stats = sub.add_parser("stats", help="rows, blobs, bytes, dedup ratio, early triggers")
    _server_arg(stats, "ask a running server instead")
    stats.add_argument("--json", action="store_true", help="one JSON object")

    inspect = sub.add_parser("inspect", help="a vehicle's pending requests in delivery order")
    inspect.add_argument("vin")
    _server_arg(inspect, "ask a running server: adds presence and in flight")
    inspect.add_argument("--json", action="store_true", help="one JSON object")
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

    exp = sub.add_parser("export", help="one consistent snapshot as Parquet, for spark/")
    exp.add_argument("--data-dir", metavar="DIR", default=None)
    exp.add_argument("--out", metavar="OUT", required=True, help="output directory")
    return top


def _load(args: argparse.Namespace) -> Config:
    path = getattr(args, "config", None) or os.environ.get(ENV_PREFIX + "CONFIG")
    return load(path, overrides=flags.overrides(args))


def _data_dir(args: argparse.Namespace) -> str:
    return args.data_dir or os.environ.get(ENV_PREFIX + "DATA_DIR") or Config().data_dir


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


def _admin_call(cfg: Config, server: str, method: str, request: Any) -> dict[str, Any]:
    """One Admin RPC to a running server (`server`, or else the configured admin listener), as a
    dict with every field shown."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from exhook_server._proto import admin_pb2

    server = _admin_target(cfg, server)
    response_cls: Any = {"GetStats": admin_pb2.Stats, "GetVehicle": admin_pb2.Vehicle}[method]
    with _admin_channel(cfg, server) as channel:
        stub = channel.unary_unary(
            f"/sdv.fanout.v1.Admin/{method}",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response_cls.FromString,
        )
        try:
            reply = stub(request, timeout=30)
        except grpc.RpcError as exc:
            raise StorageError(f"{server}: {exc.code().name}: {exc.details()}") from None
    shown: dict[str, Any] = MessageToDict(
        reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return shown


def _cmd_stats(args: argparse.Namespace) -> int:
    from storage.store import Store

    cfg = _load(args)
    if args.server is not None:
        from exhook_server._proto import admin_pb2

        stats = _admin_call(cfg, args.server, "GetStats", admin_pb2.GetStatsRequest())
    else:
        with Store(cfg.data_dir, readonly=True) as store:
            stats = store.stats().as_dict()
    if args.json:
        print(json.dumps(stats))
    else:
        width = max(map(len, stats))
        for key, value in stats.items():
            print(f"{key:<{width}}  {value}")
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from storage.store import Store

    cfg = _load(args)
    if args.server is not None:
        from exhook_server._proto import admin_pb2

        vehicle = _admin_call(cfg, args.server, "GetVehicle", admin_pb2.GetVehicleRequest(vin=args.vin))
        print(json.dumps(vehicle, indent=None if args.json else 2))
        return 0
    with Store(cfg.data_dir, readonly=True) as store:
        rows = store.pending(args.vin)
    pending: list[dict[str, Any]] = [
        {
            "request_id": r.request_id,
            "ts_ms": r.ts_ms,
            "time": dt.datetime.fromtimestamp(r.ts_ms / 1000, dt.UTC).isoformat(timespec="milliseconds"),
            "sha1": r.sha1.hex(),
            "size": r.size,
        }
        for r in rows
    ]
    if args.json:
        print(json.dumps({"vin": args.vin, "pending": pending}))
    elif not pending:
        print(f"{args.vin}: nothing pending")
    else:
        print(f"{args.vin}: {len(pending)} pending, in delivery order")
        for i, p in enumerate(pending, 1):
            print(f"{i:>4}  {p['request_id']:<32} {p['time']}  {p['size']:>9} B  sha1 {p['sha1']}")
    return 0


def _progress(total: int, unit: str) -> Any:
    """A progress bar on stderr when a person is watching; silent in pipelines."""
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, disable=not sys.stderr.isatty(), file=sys.stderr)


def _cmd_gc(args: argparse.Namespace) -> int:
    from exhook_server.housekeeping import run_gc
    from storage import plan
    from storage.store import Store
    from storage.writer import GroupCommitter

    cfg = _load(args)
    with Store(cfg.data_dir, map_size_bytes=cfg.map_size_bytes, map_max_bytes=cfg.map_max_bytes) as store:
        committer = GroupCommitter(store)
        try:
            if args.gc_command == "run":
                report: Any = run_gc(cfg, store, committer, dry_run=args.dry_run)
            else:
                path = Path(args.plan)
                total = sum(plan.count(path, t) for t in ("expired_rows", "expired_aliases", "garbage_blobs"))
                with _progress(total, "candidates") as bar:
                    report = plan.apply_plan(store, committer.submit, path, dry_run=args.dry_run, progress=bar.update)
        finally:
            committer.close()
    _print_report(report.as_dict(), args.json)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from storage.export import export
    from storage.store import Store

    with Store(_data_dir(args), readonly=True) as store:
        n = store.counts()
        with _progress(n["ids"] + n["data"] + n["aliases"], "records") as bar:
            manifest = export(store, args.out, progress=bar.update)
    print(json.dumps(manifest))
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
            print(_load(args).to_toml(), end="")
            return 0
        if args.command == "default-config":
            print(Config().to_toml(), end="")
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
        return _cmd_inspect(args)
    except (ConfigError, StorageError) as exc:
        print(f"sdv-fanout: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
