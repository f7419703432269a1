"""Assembles and runs the server: storage, the hook servicer, health and reflection on one port,
and the Admin API on another (`admin_listen`, loopback by default).

grpc.aio, because every hook handler is a coroutine that mostly waits (on the
group commit, later on dispatch queues) and asyncio gives that for free with
no thread per call; bench/grpc_flavour.py measures it against the sync server.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import prometheus_client
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from exhook_server import acks, admin, catchup, emqx_sync, events, hooks, housekeeping, memory
from exhook_server.abort import Aborts
from exhook_server.aio import Job, cancel_all, in_daemon_thread
from exhook_server.backends.backend import Backend, open_backend
from exhook_server.backends.lmdb.backend import LmdbBackend
from exhook_server.backends.lmdb.peers import Group
from exhook_server.backends.postgres.backend import PgBackend
from exhook_server.config import Config, join_host_port, split_host_port
from exhook_server.delivery import MqttDelivery
from exhook_server.dispatch.budget import DeliveryBudget
from exhook_server.dispatch.gates import Gates
from exhook_server.dispatch.pacing import Pacer
from exhook_server.dispatch.port import Dispatch, DispatchNeeds
from exhook_server.errors import ConfigError, StorageError
from exhook_server.expiry import ExpirySweep
from exhook_server.group import HOOK_SET_CONFIRMED, write_ready_file
from exhook_server.health import HealthStates
from exhook_server.hookset import HookSetWatch
from exhook_server.ingest import Ingestor
from exhook_server.latency import Latencies
from exhook_server.preflight import bind_error
from exhook_server.progress import ProgressReporter
from exhook_server.status import StatusPublisher, answer_fields
from storage.lmdb.store import Store
from storage.lmdb.writer import GroupCommitter
from storage.model import Outcome, now_ms
from storage.port import Reads
from storage.postgres.types import Pool

log = structlog.get_logger("sdv_fanout.server")

#: Headroom over a batch payload for the rest of the protobuf envelope (topic, headers, ids).
_ENVELOPE_BYTES = 1 << 20
#: A message up to this many times max_payload_bytes still reaches our validation.
_OVERSIZE_FACTOR = 4
#: How long a stop waits at most for the broker to acknowledge the status messages still held.
_STATUS_DRAIN_S = 2.0
#: Times the start-up hook-set check asks EMQX again when it could not tell (not connected yet).
_HOOK_SET_RETRIES = 30
#: VINs read per page when a request's gate opens and its rows are offered to their vehicles.
_OFFER_PAGE = 1000
_HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


def receive_limit_bytes(cfg: Config) -> int:
    """The largest ExHook message gRPC accepts: 4 x max_payload_bytes + 1 MiB (17 MiB by default).

    gRPC reads a whole request message before any handler runs, for every stream a connection has
    open, and a connection may have `grpc.max_concurrent_streams` (grpc_max_concurrent_streams)
    open at once. So per connection, what gRPC holds before our code sees a call is bounded by
    streams x the message size, at most streams x this limit; once a batch handler runs,
    `admission.IngestBudget` caps the rest. Up to the limit an oversize batch is answered with our
    reason code (`payload_too_large`, logged and counted); above it the sender is broken rather
    than mistaken, and gRPC itself answers RESOURCE_EXHAUSTED from the message's length prefix,
    without reading it. EMQX's default max_packet_size (1 MB) keeps real calls far below both.

    The stream limit cannot be made small to save memory: EMQX 5.8's ExHook client does not queue
    calls beyond it, the server refuses the excess streams and EMQX counts them failed (measured:
    limit 2, 40 concurrent batches, 39 failed). It must stay above EMQX's concurrency per pool
    connection.
    """
    return _OVERSIZE_FACTOR * cfg.max_payload_bytes + _ENVELOPE_BYTES


def server_credentials(cfg: Config) -> grpc.ServerCredentials | None:
    """TLS (and, with a client CA, mutual TLS) credentials from the configured PEM files."""
    if not cfg.tls_cert_file:
        return None
    try:
        key = Path(cfg.tls_key_file).read_bytes()
        cert = Path(cfg.tls_cert_file).read_bytes()
        ca = Path(cfg.tls_client_ca_file).read_bytes() if cfg.tls_client_ca_file else None
    except OSError as exc:
        raise ConfigError(f"cannot read TLS files: {exc}") from exc
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


def _serve_also(server: grpc.aio.Server, health_servicer: health.aio.HealthServicer, *services: str) -> None:
    """Health and reflection next to `services`: each port describes what it serves, no more."""
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*services, _HEALTH, reflection.SERVICE_NAME), server)


def _bind(
    server: grpc.aio.Server, name: str, address: str, port: int, credentials: grpc.ServerCredentials | None
) -> int:
    """Add the listening port for setting `name`, `address` (its port replaced by `port`); the
    bound port. A failure names the setting (`preflight` has found the usual ones already)."""
    target = join_host_port(split_host_port(address)[0], port)
    try:
        secure = credentials is not None
        bound = int(server.add_secure_port(target, credentials) if secure else server.add_insecure_port(target))
    except RuntimeError:  # grpc reports a failed bind this way
        bound = 0
    if not bound:
        raise ConfigError(f"{name} {address}: cannot listen (address in use or not available)")
    return bound


class FanoutServer:
    """One running sdv-fanout server process; `start()`, then `stop()`.

    With a `group` it is one of several processes (see `procs`): it binds the group's port
    with SO_REUSEPORT, forwards dispatch events to the process owning their VIN, and only
    process 0 runs the store-wide housekeeping (GC, parked-trigger sweep). The Admin API has its
    own gRPC server on `admin_listen` (shared by the group the same way): whoever reaches the
    ExHook port, EMQX's side of the network, gets UNIMPLEMENTED for it. `clock` (wall-clock ms)
    stamps what ingest stores and judges its TTLs by; tests inject one to step time.
    """

    def __init__(self, cfg: Config, group: Group | None = None, clock: Callable[[], int] = now_ms) -> None:
        self.cfg = cfg
        self.group = group
        #: The store in force and what runs over it (exhook_server/backends/).
        self.backend: Backend = open_backend(cfg, group=group)
        self.reads: Reads = self.backend.reads
        #: Receipts, progress and outcomes for the platform, published by the delivery client.
        self.status = StatusPublisher(cfg, lambda: self.delivery, clock)
        self.ingestor = Ingestor(cfg, self.backend.writes, status=self.status, clock=clock)
        #: The jobs ingest starts, and the expiry sweep.
        self.cancels = self.ingestor.cancels
        self.parked = self.ingestor.parked
        self.expiry = ExpirySweep(cfg, self.backend.writes, clock)
        self.delivery: MqttDelivery | None = None
        #: Campaign policies' gates (paused, start_at, windows: held requests' rows wait) and priorities.
        self.gates = Gates(clock, on_open=self._gate_opened)
        self.ingestor.campaigns.gates = self.gates
        #: Campaign pacing (max_per_minute, ramp, max_in_flight): blocked requests' rows wait.
        budget, cap_share = self.backend.pacing_budget(lambda: clock() / 1000)
        self.pacer = Pacer(budget, wall_ms=clock, cap_share=cap_share, on_wake=self._offer_capacity)
        self.ingestor.campaigns.pacer = self.pacer
        self.gates.on_reload = self.pacer.replace_all
        #: Campaign policies' abort criteria, judged on the outcomes of their requests.
        self.aborts = Aborts(cfg, self.reads, self.backend.writes, self.gates, self.cancels, self.status, clock)
        self.ingestor.campaigns.aborts = self.aborts
        #: A policy reaches every process of this server before its answer.
        self.ingestor.campaigns.tell_others = self.backend.tell_policy
        self.backend.on_policy = self.ingestor.campaigns.take_stored
        self.backend.on_policies = self.gates.replace_all
        #: This process's share of max_deliveries_per_s (None: off).
        self.budget = (
            DeliveryBudget(cfg.max_deliveries_per_s / cfg.process_count, lambda: clock() / 1000, self._offer_token)
            if cfg.max_deliveries_per_s
            else None
        )
        #: Deliveries' latencies per generation, written to the store every second.
        self.latencies = Latencies(self.backend.writes)
        vin_re = re.compile(cfg.vin_pattern)
        self.dispatcher: Dispatch = self.backend.dispatcher(
            DispatchNeeds(
                publisher=self,  # publishes through self.delivery once it exists (see publish)
                vin_from_clientid=(lambda c: vin_re.fullmatch(c) is not None) if cfg.vin_from_clientid else None,
                on_outcome=self._outcome,
                on_response=self._response,
                sender=self._sender,
                connected=lambda: self.delivery is not None and self.delivery.connected,
                held=self.gates.held,
                pacing=self.pacer,
                high=self.gates.high,
                budget=self.budget,
                on_latency=self.latencies.observe,
            )
        )
        self.ingestor.listeners.append(self.dispatcher.new_batch)
        self.ingestor.online_among = self.dispatcher.online_among
        self.cancels.listener = self.dispatcher.cancelled
        self.cancels.outcome_listeners.append(self.aborts.outcome)
        self.expiry.outcome_listeners.append(self.aborts.outcome)
        if cfg.status_per_vehicle:
            self.cancels.outcome_listeners.append(self._vehicle_outcome)
            self.expiry.outcome_listeners.append(self._vehicle_outcome)
        watch = HookSetWatch(cfg, dict(hooks.hook_specs(cfg)), HOOK_SET_CONFIRMED)
        self.servicer = hooks.HookServicer(cfg, self.ingestor, self.dispatcher, watch)
        self.health = health.aio.HealthServicer()
        #: What self.health answers per service name (exhook_server/health.py).
        self.health_states = HealthStates(self.health)
        limit = receive_limit_bytes(cfg)
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),  # the echo of an oversize batch included
                ("grpc.max_concurrent_streams", cfg.grpc_max_concurrent_streams),
                # By default gRPC also counts streams that finished but are not yet freed, and
                # refuses new ones beyond the limit although the client kept to it: in a flood,
                # 563 of 1,000 calls failed so (REFUSED_STREAM). Count open streams only.
                ("grpc.http.overload_protection", 0),
                # EMQX keeps its pool connections open for hours; answer its pings.
                ("grpc.keepalive_permit_without_calls", 1),
                # gRPC shares ports by default (SO_REUSEPORT): a second server started by mistake
                # on another data dir would silently take half of EMQX's calls. Fail loudly instead,
                # unless this process is one of a group that shares the port on purpose.
                ("grpc.so_reuseport", 1 if group else 0),
                ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                *(
                    [
                        ("grpc.max_connection_age_ms", round(cfg.grpc_max_connection_age_s * 1000)),
                        ("grpc.max_connection_age_grace_ms", round(cfg.ingest_timeout_s * 2000)),
                    ]
                    if cfg.grpc_max_connection_age_s
                    else []
                ),
            ]
        )
        for service, methods in hooks.method_handlers(self.servicer).items():
            self._server.add_registered_method_handlers(service, methods)
        self.admin = admin.AdminServicer(
            cfg,
            self.reads,
            self.dispatcher,
            lambda: self.delivery is not None and self.delivery.connected,
            self.ingestor,
            self.backend.writes.pending_vins,
            clock,
        )
        _serve_also(self._server, self.health, *hooks.SERVICE_NAMES)
        self.admin_health = health.aio.HealthServicer()
        self._admin_server: grpc.aio.Server | None = None
        if cfg.admin_listen:
            self._admin_server = grpc.aio.server(options=[("grpc.so_reuseport", 1 if group else 0)])
            self._admin_server.add_registered_method_handlers(admin.SERVICE_NAME, admin.method_handlers(self.admin))
            _serve_also(self._admin_server, self.admin_health, admin.SERVICE_NAME)
        self.port = 0
        self.admin_port = 0
        self.metrics_port = 0
        self._metrics_http: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        #: Set once this process's start-up `emqx sync` is over (at once where it runs none): the
        #: run-time sync must not race it.
        self._synced_at_start = asyncio.Event()

    @property
    def admin_address(self) -> str:
        """Where the Admin API answers once started (the bound port); "" without one."""
        if not self.admin_port:
            return ""
        return join_host_port(split_host_port(self.cfg.admin_listen)[0], self.admin_port)

    def _metrics_address(self) -> str:
        """Where this process serves /metrics (the bound port); "" when it does not."""
        if not self.metrics_port:
            return ""
        return join_host_port(split_host_port(self.cfg.metrics_listen)[0], self.metrics_port)

    @property
    def store(self) -> Store | None:
        """The LMDB store (tests and tools look into it); None on PostgreSQL."""
        return self.backend.store if isinstance(self.backend, LmdbBackend) else None

    @property
    def committer(self) -> GroupCommitter | None:
        """The LMDB store's group committer; None on PostgreSQL."""
        return self.backend.committer if isinstance(self.backend, LmdbBackend) else None

    @property
    def pool(self) -> Pool | None:
        """The PostgreSQL store's connection pool; None on LMDB."""
        return self.backend.pool if isinstance(self.backend, PgBackend) else None

    def _broker_connected(self, up: bool) -> None:
        self.dispatcher.broker_connected(up)
        self.health_states.delivery(up)
        if up:
            self.status.link_up()
        else:
            self.status.link_down()

    def _outcome(self, vin: str, request_id: str, sha1: bytes, outcome: Outcome, attempts: int) -> None:
        """An outcome dispatch reports: judged for its campaign's abort, and sent per vehicle when asked."""
        self.pacer.ended(vin, request_id)
        self.aborts.outcome(vin, request_id, sha1, outcome, attempts)
        if self.cfg.status_per_vehicle:
            self._vehicle_outcome(vin, request_id, sha1, outcome, attempts)

    def _vehicle_outcome(self, vin: str, request_id: str, sha1: bytes, outcome: Outcome, attempts: int) -> None:
        self.status.emit("vehicle", request_id, vin=vin, sha1=sha1.hex(), outcome=outcome.label, attempts=attempts)

    def _response(self, vin: str, request_id: str, sha1: bytes, payload: bytes, size: int) -> None:
        self.status.emit("response", request_id, vin=vin, sha1=sha1.hex(), **answer_fields(payload, size))

    def publish(self, vin: str, request_id: str, payload: bytes, expires_ms: int = 0) -> bool:
        """The dispatcher's Publisher: the MQTT delivery client, once started."""
        return self.delivery is not None and self.delivery.publish(vin, request_id, payload, expires_ms)

    def _sender(self) -> str:
        """Who sends this instance's deliveries (its MQTT clientid): recorded with each delivery
        out, so that when this client loses the broker its deliveries are known (PostgreSQL)."""
        return self.delivery.clientid if self.delivery is not None else f"sdv-fanout-{os.getpid()}"

    def _gate_opened(self, request_id: str) -> None:
        """A held request may go now: offer its rows to their vehicles (behind the caller)."""
        task = asyncio.get_running_loop().create_task(self._offer(request_id), name=f"offer-{request_id}")
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    def _offer_capacity(self, vins: list[str]) -> None:
        """A paced request may start more deliveries: offer it to these idle vehicles."""
        self.dispatcher.new_batch(vins)

    def _offer_token(self, vins: list[str]) -> None:
        """The delivery budget granted these waiting vehicles a token: offer them their next row."""
        self.dispatcher.new_batch(vins)

    async def _offer(self, request_id: str) -> None:
        after = ""
        while True:  # one page of VINs at a time: bounded reads, any number of vehicles
            try:
                vins = await self.backend.writes.pending_vins(request_id, after, _OFFER_PAGE)
            except StorageError as exc:
                log.error("campaign_offer_failed", request_id=request_id, reason=type(exc).__name__, detail=str(exc))
                return
            if not vins:
                return
            self.dispatcher.new_batch(vins, request_id)
            after = vins[-1]

    async def _resume_store_work(self) -> None:
        await self.parked.resume()
        await self.cancels.resume()
        self._tasks += [
            asyncio.create_task(self.parked.run_sweeper(), name="parked-sweeper"),
            asyncio.create_task(self.expiry.run(), name="expiry-sweeper"),
        ]

    def _leader_jobs(self) -> list[Job]:
        """The work one instance (one process of a host, or the PostgreSQL leader) does for all:
        GC, the vehicles-at-bound gauge, progress reports, `aborted` events a crash kept from the
        platform, the run-time EMQX sync, the catch-up session, and the store's
        own (`Backend.leader_jobs`: on PostgreSQL folding the count changes acks append)."""
        jobs = [
            ("backlog-gauge", housekeeping.backlog_gauge_loop(self.cfg, self.reads)),
            ("gc", housekeeping.gc_loop(self.cfg, self.reads, self.status)),
        ]
        if self.status.enabled:
            jobs.append(("progress", ProgressReporter(self.reads, self.status).run(self.cfg.progress_interval_s)))
            jobs.append(("abort-events", self.aborts.announce(self.cfg.policy_refresh_s)))
        if self.cfg.emqx_sync_on_start and self.cfg.emqx_resync_s:  # EMQX's side kept as at start
            jobs.append(("emqx-resync", self._resync()))
        if self.cfg.catchup_active:  # the deployment's one catch-up session (docs/operations.md)
            jobs.append(("catchup", catchup.CatchupSession(self.cfg, self.ingestor).hold()))
        return jobs + self.backend.leader_jobs()

    async def _store_up(self, up: bool) -> None:
        """The PostgreSQL store became unreachable for longer than store_down_grace_s, or reachable
        again: readiness ("") sees it; liveness (sdv_fanout.Process) does not."""
        await self.health_states.store(up)

    async def start(self) -> int:
        """Bind, start serving, report SERVING; returns the bound port."""
        host, port = self.cfg.host_port
        if self.group is not None:
            port = self.group.port
        await self.backend.start()
        # The policies in force before any vehicle event: a paused or paced campaign must not
        # slip out while the refresh loop has not read them yet (it retries a failure).
        try:
            self.gates.replace_all(await self.backend.writes.policies())
        except StorageError as exc:
            log.error("policies_not_loaded", reason=type(exc).__name__, detail=str(exc))
        if self.cfg.mqtt_url:
            self.delivery = MqttDelivery(
                self.cfg,
                asyncio.get_running_loop(),
                self._broker_connected,
                on_refused=self.dispatcher.refused,
                on_ack=acks.RuleAcks(self.cfg, self.dispatcher).received if self.cfg.rule_ack_topic_prefix else None,
                after_read=self.dispatcher.drain_now,
            )
            self.delivery.start()
            if self.cfg.events_over_mqtt:  # each process a member of the events group
                self._tasks.append(
                    asyncio.create_task(events.VehicleEvents(self.cfg, self.dispatcher).hold(), name="events")
                )
        else:
            log.warning("delivery_disabled", reason="mqtt_url is empty: batches are stored, not delivered")
        credentials = server_credentials(self.cfg)
        self.port = _bind(self._server, "listen", self.cfg.listen, port, credentials)
        if self._admin_server is not None:  # in a group, the parent put the group's port here
            admin_port = split_host_port(self.cfg.admin_listen)[1]
            self.admin_port = _bind(self._admin_server, "admin_listen", self.cfg.admin_listen, admin_port, credentials)
        if self.cfg.metrics_listen:
            mhost, mport = split_host_port(self.cfg.metrics_listen)
            try:
                self._metrics_http, _ = prometheus_client.start_http_server(mport, mhost)
            except OSError as exc:
                raise ConfigError(f"metrics_listen {self.cfg.metrics_listen}: {bind_error(exc)}") from None
            self.metrics_port = self._metrics_http.server_port
        await self._server.start()
        if self._admin_server is not None:
            await self._admin_server.start()
        self._tasks.append(
            asyncio.create_task(
                housekeeping.tick_loop(
                    self.dispatcher,
                    self.reads,
                    min(5.0, self.cfg.inflight_timeout_s / 4, self.cfg.response_timeout_s / 4),
                    gauges=self.backend.local_gauges,
                ),
                name="tick",
            )
        )
        self._tasks.append(asyncio.create_task(memory.trim_after_bursts(self.servicer.budget), name="malloc-trim"))
        self._tasks.append(
            asyncio.create_task(self.gates.run(self.backend.writes.policies, self.cfg.policy_refresh_s), name="gates")
        )
        self._tasks.append(asyncio.create_task(self.pacer.run(), name="pacing"))
        if self.budget is not None:
            self._tasks.append(asyncio.create_task(self.budget.run(), name="delivery-budget"))
        self._tasks.append(asyncio.create_task(self.latencies.run(), name="latency"))
        # Store-wide work: on LMDB once per data dir; on PostgreSQL every instance sweeps (their
        # statements skip what another holds) and resumes what a crash left, and one instance at
        # a time (the leader) reports progress and collects.
        if self.backend.runs_store_jobs:
            await self._resume_store_work()
        self._tasks += [
            asyncio.create_task(job, name=name) for name, job in self.backend.jobs(self._leader_jobs, self._store_up)
        ]
        await self.health_states.started()
        if self.group is None or self.group.index == 0:  # once per group: EMQX loads one of us
            self._tasks.append(asyncio.create_task(self._emqx_after_start(), name="emqx-hook-set"))
        else:
            self._synced_at_start.set()
        for service in ("", admin.SERVICE_NAME):
            await self.admin_health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "server_started",
            listen=f"{host}:{self.port}",
            tls="mutual" if self.cfg.tls_client_ca_file else ("on" if self.cfg.tls_cert_file else "off"),
            # A process of a group: its parent serves the group's /metrics (server_group_started).
            metrics=self._metrics_address() or ("parent" if self.group else "off"),
            admin=self.admin_address or "off",
            **self.backend.started_fields(),
            pid=os.getpid(),
            process=f"{self.group.index + 1}/{self.group.size}" if self.group else "1/1",
        )
        return self.port

    async def _emqx_after_start(self) -> None:
        """Serving: `emqx sync` when emqx_sync_on_start, then, hook_set_confirm_s after start,
        whether EMQX's hook list is ours (`hookset`)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        # (REST calls in daemon threads: an API that never answers must not hold up our exit)
        if self.cfg.emqx_sync_on_start:
            try:
                await in_daemon_thread(lambda: emqx_sync.sync_at_start(self.cfg))
            finally:
                self._synced_at_start.set()
        else:
            self._synced_at_start.set()
        await asyncio.sleep(max(0.0, started + self.cfg.hook_set_confirm_s - loop.time()))
        check = (lambda: emqx_sync.hook_list_differences(self.cfg)) if self.cfg.emqx_api_url else None
        watch = self.servicer.watch
        if await in_daemon_thread(lambda: watch.deadline_passed(check)):
            return
        # EMQX could not tell yet (unreachable, or still connecting to us): asked again, quietly,
        # every hook_set_confirm_s, a bounded number of times.
        for _ in range(_HOOK_SET_RETRIES):
            await asyncio.sleep(max(1.0, self.cfg.hook_set_confirm_s))
            if await in_daemon_thread(lambda: watch.deadline_passed(check, quiet=True)):
                return

    async def _resync(self) -> None:
        """The run-time `emqx sync` (emqx_resync_s), once the start-up one is over."""
        await self._synced_at_start.wait()
        await emqx_sync.resync_loop(self.cfg, self.cfg.emqx_resync_s)

    async def stop(self, grace_s: float = 5.0) -> None:
        """NOT_SERVING first, finish running calls, commit what is queued, close LMDB."""
        await self.health.enter_graceful_shutdown()
        await self.admin_health.enter_graceful_shutdown()
        await asyncio.gather(
            self._server.stop(grace_s), *([self._admin_server.stop(grace_s)] if self._admin_server else [])
        )
        # Leave the events group before dispatch stops: an answer it takes from now on is PUBACKed
        # to nobody here and EMQX gives it to another member.
        await cancel_all([t for t in self._tasks if t.get_name() == "events"])
        if self.delivery is not None:
            if self.delivery.connected:  # the last receipts, while the broker still answers
                await self.status.drain(min(grace_s, _STATUS_DRAIN_S))
            await asyncio.to_thread(self.delivery.stop)
        await self.aborts.stop()
        await self.backend.stop()
        await cancel_all(self._tasks)
        await self.latencies.flush()  # the last second's counts
        await self.ingestor.stop()
        self.status.close()
        await self.backend.close()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http.server_close()
        log.info("server_stopped")

    async def wait(self) -> None:
        await self._server.wait_for_termination()


async def serve(
    cfg: Config,
    ready_file: str | None = None,
    *,
    group: Group | None = None,
    on_ready: Callable[[int], None] | None = None,
) -> None:
    """Run until SIGTERM or SIGINT, then stop gracefully."""
    server = FanoutServer(cfg, group)
    port = await server.start()
    if ready_file:
        write_ready_file(
            ready_file,
            {"port": port, "admin_port": server.admin_port, "metrics_port": server.metrics_port, "pid": os.getpid()},
        )
    if on_ready is not None:
        on_ready(port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    bound = cfg.shutdown_timeout_s
    log.info("shutdown_requested", timeout_s=bound)
    try:
        # Half the bound for running hook calls; the rest for commits, MQTT and LMDB.
        await asyncio.wait_for(server.stop(grace_s=bound / 2), timeout=bound)
    except TimeoutError:
        log.error("shutdown_timed_out", timeout_s=bound)
