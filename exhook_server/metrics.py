"""Counters the server keeps (prometheus-client), named sdv_fanout_*.

prometheus-client gives thread-safe counters and the standard exposition
format for free; the HTTP endpoint is started by the server when asked.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

HOOK_CALLS = Counter("sdv_fanout_hook_calls_total", "ExHook RPCs answered, by hook and outcome", ["hook", "outcome"])
HOOK_SECONDS = Histogram(
    "sdv_fanout_hook_seconds",
    "Time to answer an ExHook RPC (EMQX waits this long in the client's connection)",
    ["hook"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0),
)
BATCHES_STORED = Counter("sdv_fanout_batches_stored_total", "Batches durably stored, by ingest format", ["format"])
BATCHES_DUPLICATE = Counter(
    "sdv_fanout_batches_duplicate_total", "Batches whose batch_id was stored before: nothing written, receipt again"
)
BATCHES_PREVIEWED = Counter(
    "sdv_fanout_batches_previewed_total", 'Batches with "dry_run": true: reported what they would store, stored nothing'
)
ROWS_STORED = Counter("sdv_fanout_rows_stored_total", "(VIN, request_id) rows written")
ROWS_REPLACED = Counter("sdv_fanout_rows_replaced_total", "Rows that replaced an older row of the same VIN and request")
BLOBS_NEW = Counter("sdv_fanout_blobs_written_total", "Payload blobs written (first sighting)")
DEDUP_HITS = Counter("sdv_fanout_dedup_hits_total", "Payloads already stored under their sha1")
REJECTED = Counter("sdv_fanout_batches_rejected_total", "Batch messages rejected, by reason code", ["reason"])
EARLY_PARKED = Counter("sdv_fanout_early_triggers_parked_total", "Triggers stored before their data arrived")
EARLY_COMPLETED = Counter("sdv_fanout_early_triggers_completed_total", "Parked triggers completed by their data")
EARLY_EXPIRED = Counter("sdv_fanout_early_triggers_expired_total", "Parked triggers whose data never came")
STORAGE_ERRORS = Counter("sdv_fanout_storage_errors_total", "Ingests that failed in storage, by kind", ["kind"])
INGEST_SECONDS = Histogram(
    "sdv_fanout_ingest_seconds",
    "Time from receiving a batch message to its durable commit",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)

DELIVERIES_SENT = Counter("sdv_fanout_deliveries_sent_total", "Deliveries published (first send)")
DELIVERIES_RESENT = Counter(
    "sdv_fanout_deliveries_resent_total", "Deliveries published again (in-flight timeout or lost connection)"
)
DELIVERIES_ACKED = Counter(
    "sdv_fanout_deliveries_acked_total",
    "PUBACKs of our deliveries; deleted = row removed, kept = row was replaced or already gone",
    ["result"],
)
ACKS_IGNORED = Counter(
    "sdv_fanout_acks_ignored_total",
    "PUBACKs of our deliveries that ended nothing, by reason (not_the_vehicle = from a client other "
    "than the vehicle the delivery was meant for)",
    ["reason"],
)
RULE_ACKS = Counter(
    "sdv_fanout_rule_acks_total",
    "Messages on the ack topic (ack_topic_prefix): ok = a PUBACK handed to dispatch, else why one was ignored",
    ["outcome"],
)
DELIVERIES_REFUSED = Counter(
    "sdv_fanout_deliveries_refused_total",
    "Deliveries the broker refused (puback_* = a PUBACK reason >= 0x80, link_dropped = our link "
    "dropped while it was unacknowledged)",
    ["reason"],
)
DELIVERIES_FAILED = Counter(
    "sdv_fanout_deliveries_failed_total",
    "Rows that ended failed: broker_refused (refused delivery_max_refusals times), max_attempts, response_timeout,"
    " cancelled_unacked (cancelled while out and never PUBACKed)",
    ["reason"],
)
STATUS_PUBLISHED = Counter("sdv_fanout_status_published_total", "Status messages the broker acknowledged (PUBACK)")
STATUS_DROPPED = Counter(
    "sdv_fanout_status_dropped_total",
    "Status messages dropped, by event (kind) and reason: queue_count / queue_bytes (status_queue_max /"
    " status_queue_max_bytes full), too_large (alone over status_queue_max_bytes), refused (PUBACK >= 0x80),"
    " link_dropped (unacknowledged at delivery_max_refusals link drops), shutdown (held when the process stopped)",
    ["kind", "reason"],
)
OUTCOMES = Counter(
    "sdv_fanout_outcomes_total",
    "(VIN, request) pairs that ended, by outcome (a pair cancelled while out counts cancelled, then again as what"
    " its delivery became: the stored counts move it)",
    ["outcome"],
)
# Gauges say how to combine the server processes' values (prometheus-client's multiprocess
# mode, used when processes > 1; ignored with one process).
ONLINE_VEHICLES = Gauge(
    "sdv_fanout_online_vehicles", "VINs with a live session known to dispatch", multiprocess_mode="livesum"
)
IN_FLIGHT = Gauge("sdv_fanout_in_flight", "Deliveries waiting for their PUBACK", multiprocess_mode="livesum")
CAMPAIGNS_PACED = Gauge(
    "sdv_fanout_campaigns_paced",
    "Requests that may not start a delivery now for their rate (max_per_minute, ramp) or max_in_flight",
    multiprocess_mode="max",
)
PACED_STARTS = Counter(
    "sdv_fanout_paced_starts_total", "Deliveries started of requests whose policy bounds their rate or concurrency"
)
DELIVERIES_DEFERRED = Counter(
    "sdv_fanout_deliveries_deferred_total",
    "Delivery starts deferred by max_deliveries_per_s (a vehicle then waits for a token of this process)",
)
DELIVERIES_WAITING = Gauge(
    "sdv_fanout_delivery_budget_waiting",
    "Online vehicles waiting for a token of max_deliveries_per_s to start their next delivery",
    multiprocess_mode="livesum",
)
PACING_IDLE_VEHICLES = Gauge(
    "sdv_fanout_pacing_idle_vehicles",
    "Online vehicles with nothing to send while a paced request waits for capacity (offered it when it returns)",
    multiprocess_mode="livesum",
)
CAMPAIGNS_HELD = Gauge(
    "sdv_fanout_campaigns_held",
    "Requests whose campaign policy holds their deliveries now (paused, before start_at, outside its windows)",
    multiprocess_mode="max",
)
MQTT_CONNECTED = Gauge(
    "sdv_fanout_mqtt_connected",
    "1 while the delivery client of every server process is connected to the broker",
    multiprocess_mode="livemin",
)
FORWARDED = Counter(
    "sdv_fanout_dispatch_forwarded_total", "Dispatch events handed to the server process that owns their VIN"
)
DISPATCH_DROPPED = Counter(
    "sdv_fanout_dispatch_dropped_total",
    "Dispatch events not queued because the instance's queue was full (PostgreSQL mode; the"
    " vehicle's next heartbeat or the timeout sweep recovers them), by event",
    ["event"],
)
DISPATCH_EVENT_FAILURES = Counter(
    "sdv_fanout_dispatch_event_failures_total",
    "Vehicle events whose database transaction failed or timed out (PostgreSQL mode)",
)
DB_ROUND_TRIPS = Counter(
    "sdv_fanout_db_round_trips_total",
    "Database round trips of dispatch (PostgreSQL mode), by purpose: heartbeat_filter (one per"
    " gathered group of heartbeats), batch_filter, event (vehicle events, all their statements)",
    ["purpose"],
)
STALLED_SESSIONS_ENDED = Counter(
    "sdv_fanout_stalled_sessions_ended_total",
    "Database sessions of a stalled instance ended because they held a vehicle's lock or the lead"
    " for too long (PostgreSQL mode; see pgmode.end_stalled)",
)
HEARTBEATS = Counter(
    "sdv_fanout_heartbeats_total", "Heartbeat messages seen (the message.publish hook, or our events subscription)"
)
VEHICLE_EVENTS = Counter(
    "sdv_fanout_vehicle_events_total",
    "Messages on our shared events subscription (vehicle_events = mqtt): heartbeat, answer, or ignored"
    " (a topic that is neither)",
    ["kind"],
)
EVENTS_SUBSCRIBED = Gauge(
    "sdv_fanout_events_subscribed",
    "1 while this process is a member of the events shared subscription (vehicle_events = mqtt)",
    multiprocess_mode="livesum",
)
HEARTBEAT_EVENTS = Counter(
    "sdv_fanout_heartbeat_events_total",
    "Heartbeats that needed a vehicle event (PostgreSQL mode: new connection, or work and a free slot)",
)
DB_UP = Gauge(
    "sdv_fanout_db_up",
    "1 while the instance reaches its PostgreSQL store (PostgreSQL mode)",
    multiprocess_mode="livemin",
)
GC_RUNS = Counter("sdv_fanout_gc_runs_total", "Garbage collection passes, by outcome", ["outcome"])
GC_DELETED = Counter("sdv_fanout_gc_deleted_total", "What GC removed, by kind (rows, aliases, blobs, early)", ["kind"])
PENDING_ROWS = Gauge(
    "sdv_fanout_pending_rows", "(VIN, request_id) rows waiting for delivery", multiprocess_mode="livemostrecent"
)
MAP_USAGE = Gauge(
    "sdv_fanout_lmdb_map_usage_ratio",
    "Used pages / LMDB map size (the map grows when full)",
    multiprocess_mode="livemostrecent",
)
INGEST_INFLIGHT_BYTES = Gauge(
    "sdv_fanout_ingest_inflight_bytes",
    "Payload bytes of batch calls being validated or committed (capped by max_ingest_inflight_bytes)",
    multiprocess_mode="livesum",
)
REFUSED_CALLS = Counter(
    "sdv_fanout_batches_refused_total", "Batch calls answered RESOURCE_EXHAUSTED: max_ingest_inflight_bytes was full"
)
REFUSED_BYTES = Counter("sdv_fanout_batches_refused_bytes_total", "Payload bytes of the refused batch calls")
MALFORMED_CALLS = Counter(
    "sdv_fanout_malformed_calls_total", "ExHook calls whose request was not valid protobuf, by hook", ["hook"]
)
# -- request lifecycle (cancel, expiry, backlogs, attempts, responses) ----------------------------
ROWS_REFUSED = Counter(
    "sdv_fanout_rows_refused_total",
    "Rows a batch named but did not store, by reason (vehicle_backlog_full)",
    ["reason"],
)
VEHICLES_AT_BOUND = Gauge(
    "sdv_fanout_vehicles_at_backlog_bound",
    "Vehicles holding max_pending_per_vehicle pending rows (new rows for them are refused)",
    multiprocess_mode="livemostrecent",
)
CANCELS = Counter("sdv_fanout_cancels_total", "Cancels finished (their rows ended cancelled)")
ABORTS = Counter(
    "sdv_fanout_aborts_total", "Campaigns aborted by an abort criterion of their policy (counted where recorded)"
)
POLICIES_SET = Counter(
    "sdv_fanout_policies_total", "Campaign policy messages applied, by change (set, cleared)", ["change"]
)
POLICY_PROPAGATION = Counter(
    "sdv_fanout_policy_propagation_total",
    "Policies stored on PostgreSQL, by how the other instances confirmed them before the answer"
    " (confirmed, timeout, unconfirmed: this instance's listener was down)",
    ["outcome"],
)
DELIVERY_LATENCY = Histogram(
    "sdv_fanout_delivery_latency_seconds",
    "Per delivery: stage delivered = its row stored -> the vehicle's PUBACK; answered = PUBACK -> its answer",
    ["stage"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 14400.0, 86400.0),
)
LATENCY_DROPPED = Counter(
    "sdv_fanout_latency_dropped_total", "Latency samples not counted: MAX_KEYS counters waiting for the store"
)
RESPONSES = Counter(
    "sdv_fanout_responses_total",
    "Vehicle answers on the response topic, by result (accepted, late, forged, not_awaited)",
    ["result"],
)
AWAITING_RESPONSE = Gauge(
    "sdv_fanout_awaiting_response",
    "Deliveries PUBACKed and waiting for the vehicle's answer",
    multiprocess_mode="livesum",
)
CATCHUP_MESSAGES = Counter(
    "sdv_fanout_catchup_messages_total",
    "Batch messages the catch-up session received (EMQX routed them: no hook call answered), by outcome",
    ["outcome"],
)
CATCHUP_HELD = Gauge(
    "sdv_fanout_catchup_session_held",
    "1 while this process holds the catch-up session (one process of the deployment)",
    multiprocess_mode="livesum",
)
HOOK_SET_MISMATCH = Counter(
    "sdv_fanout_hook_set_mismatch_total",
    "Signs that EMQX holds another hook list than this server asks for (a call for a hook or topic not"
    " asked for, or a difference `emqx check` found), by hook: run `sdv-fanout emqx sync`",
    ["hook"],
)
EMQX_DRIFT_HEALED = Counter(
    "sdv_fanout_emqx_drift_healed_total",
    "What the run-time EMQX sync (emqx_resync_s) found drifted and put back, by change kind",
    ["kind"],
)
HOOK_SET_CONFIRMED = Gauge(
    "sdv_fanout_hook_set_confirmed",
    "1 once EMQX loaded this server (OnProviderLoaded) or its hook list was found equal to ours since start",
    multiprocess_mode="livemax",
)
