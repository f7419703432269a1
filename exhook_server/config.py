"""The server's settings: one frozen object, validated once at start-up.

Sources, later ones winning: the defaults below, a TOML file, ``SDV_FANOUT_*``
environment variables, then command-line flags. Units are in the field names;
every default carries the reason it was chosen.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import socket
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from exhook_server.cpus import usable_cpus
from exhook_server.errors import ConfigError
from exhook_server.servicelinks import is_service_link
from exhook_server.topics import RequestTopics, TopicTemplate, name_problem, template_problem

ENV_PREFIX = "SDV_FANOUT_"

#: Longest VIN and data_id in UTF-8 bytes, whatever the patterns allow: with the longest
#: request id they keep every LMDB key (`VIN \0 request_id` behind an 8-byte time) under
#: LMDB's 511-byte key limit.
MAX_VIN_BYTES = 200
MAX_DATA_ID_BYTES = 256
MAX_REQUEST_ID_BYTES = 256
#: Where the ack rule republishes when vehicle events come over MQTT and ack_topic_prefix is "".
DEFAULT_ACK_TOPIC_PREFIX = "$SDV-FANOUT/acked"
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
    """Everything the server needs to know, with defaults an EMQX operator expects."""

    # -- network --------------------------------------------------------------
    # EMQX's own ExHook examples listen on 9000. Loopback unless told otherwise: the ExHook port
    # believes its caller, so reaching it from the network is a choice (the container image and
    # the Kubernetes manifests set 0.0.0.0:9000; a pod must).
    listen: str = "127.0.0.1:9000"
    # TLS for the gRPC port (EMQX's exhook url `https://...`): PEM files; empty = plaintext.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # With a CA bundle here, clients must present a certificate it signed (mutual TLS).
    tls_client_ca_file: str = ""
    # Prometheus /metrics (plain HTTP, its own port as scrapers expect); "" = off. Loopback unless
    # told otherwise, like `listen` (the image and the manifests set 0.0.0.0:9100 for scrapers).
    metrics_listen: str = "127.0.0.1:9100"
    # The Admin API (requeue, GC, vehicle state) on its own listener, loopback only by default:
    # whoever reaches the ExHook port must not become an operator. Same TLS files as `listen`;
    # "" = no Admin API.
    admin_listen: str = "127.0.0.1:9001"
    # How `sdv-fanout stats|inspect --server` reach a TLS admin listener (TLS is on when
    # tls_cert_file or any cli_tls_* file is set): the CA that signed the server's certificate;
    # empty = the system trust store.
    cli_tls_ca_file: str = ""
    # The client certificate a mutual-TLS listener (tls_client_ca_file) asks the CLI for.
    cli_tls_cert_file: str = ""
    # Its private key.
    cli_tls_key_file: str = ""
    # The name the server's certificate is checked against when it is not the dialled host (in a
    # pod the CLI dials 127.0.0.1, the certificate names the Service); empty = the dialled host.
    cli_tls_server_name: str = ""
    # HTTP/2 streams one EMQX pool connection may have open at once: with the receive limit it
    # bounds what gRPC buffers before any handler runs. EMQX does not queue beyond it, it fails
    # the call (failed_action applies): 128 x pool_size calls in progress is far above what a
    # fleet needs (rate x latency), while 1 MB batches on every stream stay in the pod's limit.
    grpc_max_concurrent_streams: int = 128
    # Close each EMQX connection after this long (gRPC GOAWAY; calls in progress finish, EMQX
    # reconnects): with several instances behind one Service, new instances get their share of
    # EMQX's long-lived pool connections. 0 = never (one instance: nothing to rebalance).
    grpc_max_connection_age_s: float = 0.0

    # Server processes sharing the port (SO_REUSEPORT) and the LMDB environment; 0 = one per
    # CPU this process may use (affinity, capped by a cgroup CPU limit): a Python process answers
    # hooks on one core, so this is how the server uses them all. In a pod, set it to the CPU
    # request (deploy/k8s does): a pod without a limit would otherwise count the node's CPUs.
    processes: int = 0

    # Whole SIGTERM drain, below Kubernetes' default 30 s terminationGracePeriodSeconds.
    shutdown_timeout_s: float = 20.0

    # -- storage --------------------------------------------------------------
    # Where requests are stored: "" = the embedded LMDB environment in data_dir (the default: one
    # host, nothing to run beside it); postgresql://user:pass@host:port/db (several hosts
    # comma-separated, with ?target_session_attrs=read-write) = a shared PostgreSQL, any number of
    # instances on it (docs/operations.md, "PostgreSQL mode").
    store_url: str = ""
    # PostgreSQL mode: connections each server process keeps to the database; all but two may run
    # vehicle-event batches at once (they wait on the database, not the CPU, so this, not
    # `workers`); ingest and housekeeping share them. max_connections: instances x processes x this.
    store_pool_size: int = 16
    # PostgreSQL mode: heartbeats are gathered this long, then asked about in one statement: at
    # 1,000 heartbeats/s per server process 20 ms is 0.05 database round trips per heartbeat; a
    # vehicle's delivery waits at most this much longer (only heartbeats are gathered).
    heartbeat_window_ms: float = 20.0
    # PostgreSQL mode: vehicle events (acks, subscribes, sends) are gathered this long and run as
    # one batch: two statements (load, save) for all of them. At 1,000 events/s per process 5 ms
    # gathers about 8 (with the statements' own time: under 0.3 round trips each); every vehicle
    # event waits up to this much longer.
    dispatch_batch_window_ms: float = 5.0
    # PostgreSQL mode: at most this many vehicles' events per batch: its save holds their rows'
    # locks until it commits, and 200 keeps one statement to a few milliseconds.
    dispatch_batch_max: int = 200
    # PostgreSQL mode: the database unreachable this long turns health NOT_SERVING (a blip does
    # not: hooks that need it answer UNAVAILABLE within ingest_timeout_s meanwhile).
    store_down_grace_s: float = 10.0
    # PostgreSQL mode: how long a statement may wait for a lock (a row another session holds, a
    # vehicle's or a request's advisory lock) before it gives up; the batch then answers
    # UNAVAILABLE and its connection is free at once. Our own transactions hold locks for
    # milliseconds, so a longer wait means someone else holds them, and waiting up to the ingest
    # timeout would tie up a connection per batch. 0: a quarter of ingest_timeout_s (1 s).
    store_lock_timeout_s: float = 0.0
    # Relative to the working directory, so `make run` works from a checkout.
    data_dir: str = "./var/lmdb"
    # Initial LMDB map: 1 GiB of address space (sparse on disk); grows by doubling.
    map_size_bytes: int = 1 << 30
    # Growth stops here; beyond it ingest fails with `storage_full` instead of crashing.
    map_max_bytes: int = 1 << 40
    # Ops committed together in one write transaction (one fsync) at most.
    group_commit_max_ops: int = 1024
    # Answer EMQX before its default 5 s request_timeout expires, with a clear error.
    ingest_timeout_s: float = 4.0
    # Payload bytes of batch calls being validated or committed at once; beyond it a call is
    # answered RESOURCE_EXHAUSTED at once (EMQX counts it as failed, the platform retries), so
    # a flood of large batches cannot take the pod past its memory limit.
    max_ingest_inflight_bytes: int = 128 << 20
    # Rows one housekeeping transaction writes or deletes at most (completing parked triggers,
    # GC chunks): a batch waiting behind it waits for one chunk, tens of milliseconds.
    max_rows_per_commit: int = 10_000
    # Rows one transaction of a cancel of every vehicle ends (the first in the hook's answer, the
    # rest behind it): ending a row costs several times writing one (index entries, an outcome
    # record, counts), so a batch arriving during a 200,000-row cancel waits for one such chunk,
    # about 20 ms of the writer here, instead of one of max_rows_per_commit (bench/cancel_wait.py).
    # max_rows_per_commit, when smaller, bounds it too.
    cancel_chunk_rows: int = 500
    # Row deletes after a vehicle's PUBACK wait up to this long to share one commit (they join
    # any ingest commit sooner). A crash loses at most this window of deletes: those requests
    # are delivered once more, which QoS 1 allows. Delivery attempts (and PUBACKs of deliveries
    # awaiting their answer) are kept the same way: a crash forgets at most this window of them,
    # so a row re-sent in it may go once more than max_attempts. 0 = commit each at once.
    ack_commit_delay_ms: float = 50.0

    # -- topics ---------------------------------------------------------------
    # Seed 000's one-message batch topic.
    batch_topic: str = "$SDV-FANOUT"
    # EMQX SDV plugin 0.4.x: raw payload on <prefix>/<data_id> ...
    data_topic_prefix: str = "$SDV-FANOUT/data"
    # ... then {ids, request_id, data_id} on this topic.
    trigger_topic: str = "$SDV-FANOUT/trigger"
    # {request_id, ids?} here cancels the request's pending rows (all vehicles without ids);
    # intercepted like batches, publisher_allowlist applies.
    cancel_topic: str = "$SDV-FANOUT/cancel"
    # {request_id, ...fields} here sets a request's campaign policy ({request_id} alone clears
    # it); intercepted like batches, publisher_allowlist applies. Beside cancel: same publishers.
    policy_topic: str = "$SDV-FANOUT/policy"

    # -- validation -----------------------------------------------------------
    # 17-character VINs plus test/fleet ids; never a topic separator or wildcard.
    vin_pattern: str = r"[A-Za-z0-9_-]{1,64}"
    # The plugin's tests use millisecond timestamps; UUIDs and hex digests fit too.
    data_id_pattern: str = r"[A-Za-z0-9_.:-]{1,128}"
    # `task_<type>_<n>` is short; the bound keeps keys and topics small.
    max_request_id_bytes: int = 128
    # The platform sends 200 VINs per batch; 50x headroom, still a bounded transaction.
    max_ids_per_batch: int = 10_000
    # Above EMQX's default 1 MB max_packet_size, so the broker limit bites first.
    max_payload_bytes: int = 4 << 20
    # Empty: any publisher; else only these clientids or usernames may send batches.
    publisher_allowlist: tuple[str, ...] = ()
    # Pending rows one vehicle may hold (EMQX keeps 1,000 messages per session by default): a
    # batch that would take a VIN over it stores nothing for that VIN and lists it in its
    # receipt's `refused` (vehicle_backlog_full). 0 = unbounded.
    max_pending_per_vehicle: int = 1000

    # -- retention and garbage collection -------------------------------------
    # The in-broker plugin's default: a request nobody picked up in a week is stale.
    retention_s: float = 7 * 24 * 3600.0
    # How often the embedded GC runs; 0 = never (run `sdv-fanout gc run` or the Spark job instead).
    gc_interval_s: float = 3600.0
    # Blobs created or referenced this recently are never collected (covers in-flight ingests).
    gc_grace_s: float = 3600.0

    # -- early triggers (trigger before its data) -----------------------------
    # Bounded so a platform bug cannot fill the disk with orphans ...
    early_max_count: int = 10_000
    # ... in triggers and in the rows they name (one trigger may name max_ids_per_batch VINs).
    early_max_rows: int = 1_000_000
    # Campaign policies in force at once (one per request id, set on policy_topic): beyond it a
    # new request id's policy is refused `policies_full`. A campaign is a fleet rollout, not a
    # single command: ten thousand concurrent ones is far more than a platform runs, and the
    # bound keeps the table (read by dispatch) small whatever a publisher sends.
    max_policies: int = 10_000
    # How often every process re-reads the campaign policies: the safety net behind the telling
    # (a group's links, PostgreSQL's NOTIFY) for a process that missed a change; one small read
    # per second per process, against a pause that must hold within about a second.
    policy_refresh_s: float = 1.0
    # PostgreSQL: how long storing a policy waits for every other live instance to confirm it is
    # in force (each hears it at once through LISTEN/NOTIFY) before the publish is answered.
    # Twice policy_refresh_s's default: by then even an instance that missed the notice has
    # re-read it. Never more than half of ingest_timeout_s (the hook's own bound) is waited. 0:
    # answer without waiting (the others follow within milliseconds, unconfirmed).
    policy_propagation_timeout_s: float = 2.0
    # Data normally follows within milliseconds; five minutes covers broker hiccups.
    early_ttl_s: float = 300.0
    # How often orphaned early triggers are looked for.
    early_sweep_interval_s: float = 10.0

    # -- status: what the platform gets back ------------------------------------
    # Receipts, progress and outcomes go QoS 1 to <prefix>/<request_id> (rejections without a
    # usable request id to <prefix>/_rejected), published by the delivery client; "" = off.
    status_topic_prefix: str = "$SDV-FANOUT/status"
    # Status messages held until the broker acknowledges them (they pile up while the link is
    # down); beyond it progress reports are dropped first, then the oldest (counted): the Admin
    # queries always tell the truth, the topic is a convenience.
    status_queue_max: int = 10_000
    # ... and the bytes they hold at most (payload, topic and about 380 B of overhead each). A
    # receipt listing 2,000 refused VINs is 120 KB: by count alone 10,000 of them would hold
    # 1.2 GB of a pod limited to 2 GiB. 64 MiB per process adds 128 MiB to the
    # shipped pod (2 processes, about 850 MiB at its peak under a batch flood), still well inside
    # the limit, and is never reached by 10,000 ordinary receipts (about 0.5 KB each).
    status_queue_max_bytes: int = 64 << 20
    # A changing generation reports its counts at most this often (a 200,000-vehicle campaign
    # would otherwise send one message per delivery).
    progress_interval_s: float = 5.0
    # Also one status message per vehicle outcome (delivered, failed): one per delivery.
    status_per_vehicle: bool = False
    # Outcome records, and the counts of generations with nothing pending, are kept this long
    # after their last change; 0 = retention_s.
    outcome_retention_s: float = 0.0

    # -- dispatch -------------------------------------------------------------
    # Delivery topic is <prefix with the VIN>/<request_id>; vehicles subscribe <prefix>/+.
    request_topic_prefix: str = "agent/{VIN}/proxy/request"
    # Publishes on these prove the vehicle is online (and repair state after a restart).
    heartbeat_topics: tuple[str, ...] = ("ecp/{VIN}/online", "ecp/{VIN}/heartbeat")
    # Worker partitions of the VIN space; 0 = one per CPU.
    workers: int = 0
    # An unacknowledged delivery older than this is sent again on the next trigger.
    inflight_timeout_s: float = 60.0
    # Deliveries of one request to one vehicle (first send, and re-sends after a timeout, a
    # lost connection or a broker link drop); after that many the row ends `failed` and the
    # vehicle's next request goes, so one command a vehicle never takes blocks nothing. 0 = no limit.
    max_attempts: int = 10
    # Default of a batch's `await_response`: the vehicle's answer on the response topic, not its
    # PUBACK, ends the row (outcome `responded`).
    await_response: bool = False
    # Vehicles answer on <prefix with the VIN>/<request_id>; registered as a message.publish
    # filter and routed on (the platform may subscribe too). "" = responses off.
    response_topic_prefix: str = "agent/{VIN}/proxy/response"
    # A vehicle that PUBACKed a request awaiting its answer and said nothing for this long: the
    # row ends `failed` and its next request goes.
    response_timeout_s: float = 300.0
    # The first bytes of an answer kept in the outcome record and sent on the status topic.
    max_response_bytes: int = 4096
    # How often rows past their expires_at are ended `expired` (a vehicle's queue skips them
    # at once anyway; this only makes the outcome and counts prompt).
    expiry_sweep_interval_s: float = 1.0
    # Delivery starts per second of this instance at most (its processes share it evenly), so a
    # reconnect storm of a whole fleet turns into deliveries at a rate the broker and the
    # vehicles' backends take; when it binds, high priority goes first and request ids take
    # turns. 0 = off: the broker's own limits and one in flight per vehicle bound it already.
    max_deliveries_per_s: float = 0.0
    # Vehicles conventionally use their VIN as MQTT clientid: resolve session.resumed by it
    # when no subscription of that client has been seen since start-up.
    vin_from_clientid: bool = True

    # -- MQTT delivery ---------------------------------------------------------
    # The broker we publish deliveries to (EMQX's listener); mqtts:// for TLS; "" = store only.
    mqtt_url: str = "mqtt://127.0.0.1:1883"
    mqtt_username: str = ""
    mqtt_password: str = ""
    # CA bundle for mqtts://; empty = the system's trust store.
    mqtt_ca_file: str = ""
    # Acks count only for messages whose publisher clientid starts with this.
    mqtt_clientid_prefix: str = "sdv-fanout-"
    # The delivery client's in-flight window (deliveries written, not yet PUBACKed by the broker):
    # larger windows collapse throughput (paho and EMQX alike).
    mqtt_max_inflight: int = 50
    # A delivery the broker refused (PUBACK reason >= 0x80, or our link dropped while it was
    # the oldest unacknowledged publish) this many times is parked, so one bad row cannot
    # keep dropping the link every other vehicle's deliveries share. A status message that was
    # unacknowledged at this many link drops (or refused once) is dropped and counted likewise.
    delivery_max_refusals: int = 3
    # MQTT 5 Message-Expiry-Interval on deliveries; 0 = none.
    mqtt_message_expiry_s: int = 0
    mqtt_keepalive_s: int = 30
    # Where PUBACKs of deliveries reach us: "" = EMQX's message.acked ExHook call (one gRPC call
    # per delivery, its costliest step); a topic prefix = an EMQX rule republishes each PUBACK
    # to <prefix>/<delivery clientid> (`emqx sync` installs it), about a sixth of the CPU.
    # Without that rule no delivery is ever acknowledged. With vehicle_events = mqtt, "" means
    # $SDV-FANOUT/acked (the topic deploy/emqx/acl.conf names): acks then always take the rule.
    ack_topic_prefix: str = ""
    # How heartbeats, answers and PUBACKs reach us: `hooks` = an ExHook call each (synchronous,
    # inside the vehicle's connection); `mqtt` = heartbeats and answers over our own MQTT
    # connection through a shared subscription, PUBACKs through the ack rule, and the hook list
    # keeps only batches and session lifecycle (a stopped server no longer holds a vehicle's
    # heartbeat up). `auto` = mqtt when emqx_api_url and mqtt_url are set (`emqx sync` provisions
    # what mqtt needs), else hooks.
    vehicle_events: str = "auto"
    # The shared-subscription group our processes and instances join for vehicle events
    # ($share/<group>/...): one group per deployment, so each event reaches one of them.
    events_share_group: str = "sdv-fanout"
    # After reading vehicle events, wait this long before reading again, so what arrives meanwhile
    # is handled in one wake-up: at fleet rates each heartbeat arrives alone, and a wake-up per
    # message cost more than the message. Heartbeats and answers are late by at most this; 0 = off.
    events_gather_ms: float = 10.0
    # EMQX's failed_action cannot stop a publish: while no hook call of ours answers (a restart,
    # a crash, a stopped process) EMQX PUBACKs a batch and routes it. With this on (and mqtt_url
    # set) one process of the deployment keeps a persistent MQTT session subscribed to the batch
    # topics and stores what EMQX queued there (catchup.py); a batch without batch_id is then
    # idempotent on its exact topic and payload, so one both paths saw is stored once.
    catchup_enabled: bool = True
    # That session's MQTT client id: the same for every process and restart of the deployment, or
    # EMQX would keep an orphaned session and start an empty one. "" = mqtt_clientid_prefix +
    # "catchup"; set it when two deployments share a broker and a prefix.
    catchup_clientid: str = ""
    # How long EMQX keeps the session (and queues batches for it, up to its mqtt.max_mqueue_len)
    # while no process holds it: a week outlasts a weekend's outage of every instance.
    catchup_session_expiry_s: int = 604_800

    # -- EMQX provisioning (`sdv-fanout emqx sync|check`, emqx_sync_on_start) --
    # EMQX's REST API: the dashboard listener's base URL (http://emqx:18083; /api/v5 is
    # appended). "" = not configured: `emqx sync` refuses, nothing is synced at start-up.
    emqx_api_url: str = ""
    # An EMQX API key and its secret (HTTP basic auth; the key needs the administrator role or
    # the scopes for ExHooks, rules and authorization settings). Never logged or printed.
    emqx_api_key: str = ""
    emqx_api_secret: str = ""
    # The same, read from files (a mounted Kubernetes Secret): they win over the two above.
    emqx_api_key_file: str = ""
    emqx_api_secret_file: str = ""
    # How EMQX reaches this server's ExHook port, e.g. http://sdv-fanout.sdv.svc:9000 (https://
    # with tls_cert_file). "" = from `listen`: its host, or this machine's hostname when it
    # listens on every interface (set it explicitly behind a Kubernetes Service).
    emqx_exhook_url: str = ""
    # The ExHook entry's name in EMQX (one entry per server deployment).
    emqx_exhook_name: str = "sdv-fanout"
    # EMQX's gRPC connections to us per EMQX node; 0 = 8 (EMQX's default) with LMDB, 32 with
    # store_url (a call waits for its database commit: at 8 the database sits partly idle).
    emqx_exhook_pool_size: int = 0
    # EMQX's ExHook request_timeout: its default, above ingest_timeout_s, so a slow store gives
    # our clear UNAVAILABLE rather than an EMQX timeout.
    emqx_exhook_request_timeout_s: float = 5.0
    # What EMQX does when a call to us fails: `ignore` lets other ExHook servers in the chain
    # still run (for message.publish `deny` would not stop the message anyway).
    emqx_exhook_failed_action: str = "ignore"
    # How soon EMQX retries loading us after a failed load; EMQX's own 60 s default makes every
    # restart of ours a minute without hooks.
    emqx_exhook_auto_reconnect_s: float = 2.0
    # TLS (when tls_cert_file is set): PEM files as paths ON THE EMQX NODES (e.g. a mounted
    # Secret): the CA that signed our certificate (empty = EMQX does not verify it) ...
    emqx_exhook_tls_ca_file: str = ""
    # ... and EMQX's client certificate and key, which tls_client_ca_file checks (mutual TLS).
    emqx_exhook_tls_cert_file: str = ""
    emqx_exhook_tls_key_file: str = ""
    # The name EMQX checks our certificate against (its SNI) when that is not the URL's host
    # (Erlang's check fails a certificate's IP address against a URL's IP); empty = the host.
    emqx_exhook_tls_server_name: str = ""
    # Run `emqx sync` once this server is serving; a failure is logged, serving goes on (EMQX
    # keeps what it had). Off by default: it needs the API settings above.
    emqx_sync_on_start: bool = False
    # With emqx_sync_on_start, the deployment's leader looks again this often and puts back what
    # drifted (a rule disabled or deleted by hand, an entry edited or removed, an older hook list):
    # without the ack rule no delivery is ever acknowledged. 0 = at start only.
    emqx_resync_s: float = 60.0
    # A server that got no OnProviderLoaded this long after start checks EMQX's hook list (with
    # emqx_api_url) or logs that it cannot confirm it: EMQX does not load a restarted server
    # again, it keeps the list it loaded earlier. A minute covers EMQX's load after our start.
    hook_set_confirm_s: float = 60.0

    # -- logging --------------------------------------------------------------
    # `console` for people, `json` (one object per line) for log pipelines.
    log_format: str = "console"
    log_level: str = "info"

    # ------------------------------------------------------------------------
    def __post_init__(self) -> None:
        _validate(self)

    @property
    def cancel_rows(self) -> int:
        """Rows one transaction of a cancel of every vehicle ends: cancel_chunk_rows, at most
        max_rows_per_commit."""
        return min(self.cancel_chunk_rows, self.max_rows_per_commit)

    @property
    def lock_timeout_s(self) -> float:
        """Seconds a PostgreSQL statement waits for a lock: store_lock_timeout_s, or a quarter of
        ingest_timeout_s when 0."""
        return self.store_lock_timeout_s or self.ingest_timeout_s / 4

    @property
    def outcome_retention(self) -> float:
        """Seconds outcome records are kept: outcome_retention_s, or retention_s when 0."""
        return self.outcome_retention_s or self.retention_s

    @property
    def catchup_active(self) -> bool:
        """Whether a catch-up session is kept (catchup_enabled with a broker to keep it on)."""
        return self.catchup_enabled and bool(self.mqtt_url)

    @property
    def events_over_mqtt(self) -> bool:
        """Whether heartbeats, answers and PUBACKs come over MQTT (vehicle_events, `auto` resolved)."""
        if self.vehicle_events == "auto":
            return bool(self.emqx_api_url and self.mqtt_url)
        return self.vehicle_events == "mqtt"

    @property
    def rule_ack_topic_prefix(self) -> str:
        """Where the ack rule republishes PUBACKs: ack_topic_prefix, or its default when vehicle
        events come over MQTT; "" = acks through the message.acked hook."""
        if self.ack_topic_prefix or not self.events_over_mqtt:
            return self.ack_topic_prefix
        return DEFAULT_ACK_TOPIC_PREFIX

    @property
    def catchup_session_clientid(self) -> str:
        """The catch-up session's client id: catchup_clientid, or mqtt_clientid_prefix + "catchup"."""
        return self.catchup_clientid or self.mqtt_clientid_prefix + "catchup"

    @property
    def process_count(self) -> int:
        """Server processes actually started: `processes`, or one per CPU this process may use
        (its affinity, capped by a cgroup CPU quota)."""
        return self.processes or usable_cpus()

    @property
    def worker_count(self) -> int:
        """Workers actually started: `workers`, or one per CPU."""
        return self.workers or os.cpu_count() or 1

    @property
    def host_port(self) -> tuple[str, int]:
        """The listen address split into host and port."""
        return split_host_port(self.listen)

    @property
    def exhook_url(self) -> str:
        """How EMQX reaches our ExHook port: emqx_exhook_url, or else `listen` with the wildcard
        host replaced by this machine's hostname; https:// when the listener has TLS."""
        if self.emqx_exhook_url:
            return self.emqx_exhook_url.rstrip("/")
        host, port = self.host_port
        if host in ("0.0.0.0", "::"):
            host = socket.gethostname()
        scheme = "https" if self.tls_cert_file else "http"
        return f"{scheme}://{join_host_port(host, port)}"

    @property
    def exhook_pool_size(self) -> int:
        """EMQX's pool size for us: emqx_exhook_pool_size, or 8 with LMDB and 32 with store_url."""
        return self.emqx_exhook_pool_size or (32 if self.store_url else 8)

    def as_dict(self) -> dict[str, Any]:
        """Plain values, in declaration order, for printing."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def to_toml(self, *, show_secrets: bool = False) -> str:
        """Render as a TOML file that `load` reads back to the same object: with `show_secrets`;
        otherwise the secrets (SECRET_SETTINGS) are masked, each such line saying so."""
        lines = []
        for key, value in self.as_dict().items():
            shown = value if show_secrets else masked(key, value)
            note = "  # masked (--show-secrets prints it)" if shown != value else ""
            lines.append(f"{key} = {json.dumps(shown)}{note}")
        return "\n".join(lines) + "\n"


#: Names that make a setting a secret: never printed or logged unless asked for
#: (`check-config --show-secrets`). Paths to files holding secrets (`*_file`) are not secrets.
_SECRET_SUFFIXES = ("_password", "_secret", "_api_key", "_token")
#: Settings whose values are masked wherever settings are shown: every setting named like a
#: secret (_SECRET_SUFFIXES, whoever adds it), and store_url, whose password is masked in place.
SECRET_SETTINGS: frozenset[str] = frozenset(
    [f.name for f in dataclasses.fields(Config) if f.name.endswith(_SECRET_SUFFIXES)] + ["store_url"]
)
_MASK = "********"
#: `scheme://user:PASSWORD@` in a URL, and `password=` among its query parameters.
_URL_PASSWORD = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/@:]*:)[^/@]*(?=@)")
_QUERY_PASSWORD = re.compile(r"(?P<head>[?&]password=)[^&]*")


def masked(name: str, value: Any) -> Any:
    """`value` of setting `name` as it may be shown: a secret's value masked (an empty one stays
    empty, so "not set" still shows), the password inside a URL setting masked in place."""
    if name not in SECRET_SETTINGS or not isinstance(value, str) or not value:
        return value
    if "://" not in value:
        return _MASK
    value = _URL_PASSWORD.sub(lambda m: m["head"] + _MASK, value)
    return _QUERY_PASSWORD.sub(lambda m: m["head"] + _MASK, value)


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def split_host_port(address: str) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 as ``[::1]:port``) and check the port."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"listen address {address!r} is not HOST:PORT")
    return host.strip("[]") or "0.0.0.0", int(port)


def join_host_port(host: str, port: int) -> str:
    """The inverse of `split_host_port`: brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def loopback(host: str) -> str:
    """The host a local client dials for a listen host: the wildcard means this machine."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


#: The settings that take one of a few words (the CLI offers them as choices).
CHOICES: dict[str, tuple[str, ...]] = {
    "emqx_exhook_failed_action": ("ignore", "deny"),
    "log_format": ("console", "json"),
    "vehicle_events": ("auto", "mqtt", "hooks"),
    "log_level": ("debug", "info", "warning", "error"),
}


def _validate(cfg: Config) -> None:
    cfg.host_port  # noqa: B018 - raises ConfigError when malformed
    if cfg.metrics_listen:
        split_host_port(cfg.metrics_listen)
    if cfg.admin_listen:
        split_host_port(cfg.admin_listen)
    if bool(cfg.tls_cert_file) != bool(cfg.tls_key_file):
        raise ConfigError("tls_cert_file and tls_key_file go together")
    if cfg.tls_client_ca_file and not cfg.tls_cert_file:
        raise ConfigError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
    if bool(cfg.cli_tls_cert_file) != bool(cfg.cli_tls_key_file):
        raise ConfigError("cli_tls_cert_file and cli_tls_key_file go together")
    # A blank allowlist entry would match every publisher without a username; a blank topic is
    # no topic. `a, ,b` in an environment variable must be an error, not a wildcard.
    for field in dataclasses.fields(cfg):
        items = getattr(cfg, field.name)
        if isinstance(items, tuple) and any(not item.strip() for item in items):
            raise ConfigError(f"{field.name} has a blank entry: {list(items)!r}")
    for name in ("vin_pattern", "data_id_pattern"):
        try:
            re.compile(getattr(cfg, name))
        except re.error as exc:
            raise ConfigError(f"{name} is not a regular expression: {exc}") from exc
    for name in ("batch_topic", "data_topic_prefix", "trigger_topic", "cancel_topic", "policy_topic"):
        topic = getattr(cfg, name)
        problem = name_problem(topic + "/data_id" if name == "data_topic_prefix" else topic)
        if problem:
            raise ConfigError(f"{name} {topic!r} is not a usable topic name: {problem}")
    topics = {cfg.batch_topic, cfg.data_topic_prefix, cfg.trigger_topic, cfg.cancel_topic, cfg.policy_topic}
    if len(topics) != 5:
        raise ConfigError("batch_topic, data_topic_prefix, trigger_topic, cancel_topic and policy_topic must differ")
    for name in ("cancel_topic", "policy_topic"):
        if getattr(cfg, name).startswith(cfg.data_topic_prefix + "/"):
            raise ConfigError(f"{name} must not lie under data_topic_prefix")
    if cfg.status_topic_prefix:
        status = cfg.status_topic_prefix
        if problem := name_problem(status + "/request_id"):
            raise ConfigError(f"status_topic_prefix {status!r} is not a usable topic name: {problem}")
        # Status messages must never be taken for batches (we intercept those topics).
        for batch in (cfg.batch_topic, cfg.trigger_topic, cfg.data_topic_prefix, cfg.cancel_topic, cfg.policy_topic):
            if batch == status or batch.startswith(status + "/") or status.startswith(cfg.data_topic_prefix + "/"):
                raise ConfigError(f"status_topic_prefix {status!r} overlaps the batch topics ({batch!r})")
    if cfg.outcome_retention_s < 0:
        raise ConfigError("outcome_retention_s must not be negative (0 = retention_s)")
    if cfg.trigger_topic.startswith(cfg.data_topic_prefix + "/"):
        raise ConfigError("trigger_topic must not lie under data_topic_prefix")
    positive = (
        "shutdown_timeout_s",
        "map_size_bytes",
        "map_max_bytes",
        "group_commit_max_ops",
        "ingest_timeout_s",
        "max_request_id_bytes",
        "max_ids_per_batch",
        "max_payload_bytes",
        "early_max_count",
        "early_max_rows",
        "max_policies",
        "max_ingest_inflight_bytes",
        "max_rows_per_commit",
        "cancel_chunk_rows",
        "grpc_max_concurrent_streams",
        "delivery_max_refusals",
        "early_ttl_s",
        "status_queue_max",
        "status_queue_max_bytes",
        "progress_interval_s",
        "early_sweep_interval_s",
        "response_timeout_s",
        "expiry_sweep_interval_s",
        "policy_refresh_s",
        "store_pool_size",
        "store_down_grace_s",
    )
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name} must be positive")
    if not 0 < cfg.max_request_id_bytes <= MAX_REQUEST_ID_BYTES:
        raise ConfigError(f"max_request_id_bytes must be 1..{MAX_REQUEST_ID_BYTES} (LMDB's key limit)")
    # The request id is one more level of the delivery topic.
    if problem := template_problem(cfg.request_topic_prefix, levels_after=1):
        raise ConfigError(f"request_topic_prefix {cfg.request_topic_prefix!r}: {problem}")
    for topic in cfg.heartbeat_topics:
        if problem := template_problem(topic):
            raise ConfigError(f"heartbeat topic {topic!r}: {problem}")
    if cfg.response_topic_prefix:
        if problem := template_problem(cfg.response_topic_prefix, levels_after=1):
            raise ConfigError(f"response_topic_prefix {cfg.response_topic_prefix!r}: {problem}")
        if cfg.response_topic_prefix == cfg.request_topic_prefix:
            raise ConfigError("response_topic_prefix must differ from request_topic_prefix")
    elif cfg.await_response:
        raise ConfigError("await_response needs a response_topic_prefix (vehicles answer there)")
    if not 0 <= cfg.dispatch_batch_window_ms <= 1000 or not 1 <= cfg.dispatch_batch_max <= 10_000:
        raise ConfigError("dispatch_batch_window_ms must be 0..1000 and dispatch_batch_max 1..10000")
    if cfg.heartbeat_window_ms < 0 or cfg.grpc_max_connection_age_s < 0:
        raise ConfigError("heartbeat_window_ms and grpc_max_connection_age_s must not be negative")
    if not 0 <= cfg.policy_propagation_timeout_s <= 60:
        raise ConfigError("policy_propagation_timeout_s must be 0 (no wait) up to 60")
    if not 0 <= cfg.store_lock_timeout_s < cfg.ingest_timeout_s:
        raise ConfigError("store_lock_timeout_s must be 0 (a quarter of ingest_timeout_s) or below ingest_timeout_s")
    if cfg.store_url and not cfg.store_url.startswith(("postgresql://", "postgres://")):
        raise ConfigError("store_url must be empty (LMDB in data_dir) or a postgresql:// URL")
    if cfg.max_pending_per_vehicle < 0 or cfg.max_attempts < 0:
        raise ConfigError("max_pending_per_vehicle and max_attempts must be >= 0 (0 = no limit)")
    if not 0 <= cfg.max_response_bytes <= 1 << 20:
        raise ConfigError("max_response_bytes must be 0..1048576")
    if cfg.processes < 0:
        raise ConfigError("processes must be >= 0 (0 = one per CPU)")
    if not (math.isfinite(cfg.max_deliveries_per_s) and 0 <= cfg.max_deliveries_per_s <= 1_000_000):
        raise ConfigError("max_deliveries_per_s must be 0 (off) up to 1000000")
    if not 0 <= cfg.ack_commit_delay_ms <= 10_000:
        raise ConfigError("ack_commit_delay_ms must be between 0 and 10000")
    if cfg.workers < 0 or cfg.mqtt_max_inflight <= 0 or cfg.inflight_timeout_s <= 0:
        raise ConfigError("workers must be >= 0; mqtt_max_inflight and inflight_timeout_s positive")
    if cfg.mqtt_url and not cfg.mqtt_url.startswith(("mqtt://", "mqtts://")):
        raise ConfigError("mqtt_url must start with mqtt:// or mqtts:// (or be empty: no delivery)")
    if not cfg.mqtt_clientid_prefix:
        raise ConfigError("mqtt_clientid_prefix must not be empty (acks are matched by it)")
    if cfg.vehicle_events not in CHOICES["vehicle_events"]:
        raise ConfigError("vehicle_events must be auto, mqtt or hooks")
    if cfg.vehicle_events == "mqtt" and not cfg.mqtt_url:
        raise ConfigError("vehicle_events = mqtt needs mqtt_url (the events arrive over our MQTT connection)")
    if not 0 <= cfg.events_gather_ms <= 1000:
        raise ConfigError("events_gather_ms must be 0..1000")
    if not _PLAIN_NAME.fullmatch(cfg.events_share_group):
        raise ConfigError("events_share_group must be 1-64 letters, digits, '_' or '-' (an MQTT share name)")
    if cfg.rule_ack_topic_prefix:
        _check_ack_topic_prefix(cfg)
    if not 1 <= cfg.catchup_session_expiry_s <= 0xFFFF_FFFF:
        raise ConfigError("catchup_session_expiry_s must be 1..4294967295 (MQTT's Session Expiry Interval)")
    if len(cfg.catchup_clientid.encode()) > 256 or "\x00" in cfg.catchup_clientid:
        raise ConfigError("catchup_clientid must be at most 256 bytes, without NUL")
    if cfg.retention_s <= 0 or cfg.gc_interval_s < 0:
        raise ConfigError("retention_s must be positive and gc_interval_s not negative")
    if cfg.gc_grace_s < 60:
        raise ConfigError("gc_grace_s must be at least 60: it must outlast any ingest still committing")
    if cfg.max_ingest_inflight_bytes < cfg.max_payload_bytes:
        raise ConfigError("max_ingest_inflight_bytes must be at least max_payload_bytes (else no batch fits)")
    if cfg.max_rows_per_commit < cfg.max_ids_per_batch:
        raise ConfigError("max_rows_per_commit must be at least max_ids_per_batch (a batch is one transaction)")
    if cfg.map_max_bytes < cfg.map_size_bytes:
        raise ConfigError("map_max_bytes must be at least map_size_bytes")
    _check_emqx(cfg)
    if cfg.log_format not in CHOICES["log_format"]:
        raise ConfigError("log_format must be 'console' or 'json'")
    if cfg.log_level.lower() not in CHOICES["log_level"]:
        raise ConfigError("log_level must be debug, info, warning or error")


def _check_emqx(cfg: Config) -> None:
    """The EMQX provisioning settings: usable URLs and durations EMQX accepts."""
    if cfg.emqx_api_url and not re.fullmatch(r"https?://[^/\s]+(/\S*)?", cfg.emqx_api_url):
        raise ConfigError(f"emqx_api_url {cfg.emqx_api_url!r} must be http(s)://host[:port] (e.g. http://emqx:18083)")
    if cfg.emqx_exhook_url and not re.fullmatch(r"https?://[^/\s]+/?", cfg.emqx_exhook_url):
        raise ConfigError(f"emqx_exhook_url {cfg.emqx_exhook_url!r} must be http(s)://host:port")
    if cfg.emqx_resync_s < 0:
        raise ConfigError("emqx_resync_s must be >= 0 (0: sync at start only)")
    if cfg.emqx_sync_on_start and not cfg.emqx_api_url:
        raise ConfigError("emqx_sync_on_start needs emqx_api_url (and an API key)")
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", cfg.emqx_exhook_name):
        raise ConfigError("emqx_exhook_name must be 1-64 letters, digits, '_' or '-'")
    if not 0 <= cfg.emqx_exhook_pool_size <= 1024:
        raise ConfigError("emqx_exhook_pool_size must be 0..1024 (0 = 8, or 32 with store_url)")
    if cfg.emqx_exhook_failed_action not in CHOICES["emqx_exhook_failed_action"]:
        raise ConfigError("emqx_exhook_failed_action must be 'ignore' or 'deny'")
    for name in ("emqx_exhook_request_timeout_s", "emqx_exhook_auto_reconnect_s", "hook_set_confirm_s"):
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{name} must be positive")
    if bool(cfg.emqx_exhook_tls_cert_file) != bool(cfg.emqx_exhook_tls_key_file):
        raise ConfigError("emqx_exhook_tls_cert_file and emqx_exhook_tls_key_file go together")


def _check_ack_topic_prefix(cfg: Config) -> None:
    """The ack topics must be plain topic names no hook of ours and no rule matches: an ack
    message counted as a batch, a heartbeat or a delivery (whose PUBACK the rule would
    republish again, for ever) would be worse than no ack."""
    prefix = cfg.rule_ack_topic_prefix
    sample = prefix + "/" + cfg.mqtt_clientid_prefix + "host-1"
    if problem := name_problem(sample):
        raise ConfigError(f"ack_topic_prefix {prefix!r} is not a usable topic prefix: {problem}")
    ours = (cfg.batch_topic, cfg.trigger_topic)
    if sample in ours or prefix in ours or sample.startswith(cfg.data_topic_prefix + "/"):
        raise ConfigError("ack_topic_prefix must not be a batch, data or trigger topic (nor lie under one)")
    if RequestTopics(cfg.request_topic_prefix).parse_delivery(sample) is not None or any(
        TopicTemplate(t).vin(sample) is not None for t in cfg.heartbeat_topics
    ):
        raise ConfigError("ack_topic_prefix must not match request_topic_prefix or a heartbeat topic")


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
_HINTS = typing.get_type_hints(Config)


def _coerce(name: str, raw: Any, *, from_text: bool) -> Any:
    """Convert one raw value (TOML value or environment string) to the field's type."""
    kind = _HINTS[name]
    try:
        if kind is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if kind is int:
            if isinstance(raw, bool):
                raise ValueError(raw)
            return int(raw) if not isinstance(raw, str) else int(raw.replace("_", ""))
        if kind is float:
            if isinstance(raw, bool):
                raise ValueError(raw)
            return float(raw)
        if kind is str:
            if not isinstance(raw, str):
                raise ValueError(raw)
            return raw
        # tuple[str, ...]: a TOML array, or a comma-separated / JSON list in the environment.
        if isinstance(raw, str) and from_text:
            text = raw.strip()
            items = json.loads(text) if text.startswith("[") else [p for p in text.split(",") if p]
        else:
            items = raw
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ValueError(raw)
        return tuple(i.strip() for i in items)
    except (ValueError, TypeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{name}: cannot use {raw!r} as {kind}") from exc


def _did_you_mean(name: str, prefix: str = "") -> str:
    """A hint naming the closest setting to a misspelt one ("" when none is close)."""
    close = difflib.get_close_matches(name, _FIELDS, n=1)
    return f" (did you mean {(prefix + close[0]).upper() if prefix else close[0]}?)" if close else ""


def load(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build the config from defaults, then `path` (TOML), then `env`, then `overrides`."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            table = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not TOML: {exc}") from exc
        for key, raw in table.items():
            if key not in _FIELDS:
                raise ConfigError(f"unknown setting {key!r} in {path}{_did_you_mean(key)}")
            values[key] = _coerce(key, raw, from_text=False)
    for key, raw in (os.environ if env is None else env).items():
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX) :].lower()
        if name == "config":  # the file path itself, handled by the CLI
            continue
        if name not in _FIELDS:
            if is_service_link(key, raw):  # the kubelet's, for a Service named sdv-fanout[-...]
                continue
            raise ConfigError(f"unknown setting in environment variable {key}{_did_you_mean(name, ENV_PREFIX)}")
        values[name] = _coerce(name, raw, from_text=True)
    for key, raw in (overrides or {}).items():
        if raw is None:
            continue
        if key not in _FIELDS:
            raise ConfigError(f"unknown setting {key!r}")
        values[key] = _coerce(key, raw, from_text=True)
    return Config(**values)
