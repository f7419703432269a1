-- The PostgreSQL store's tables, indexes and views, as a new database gets them.
--
-- storage/postgres/migrate.py runs this file on an empty database, then every file of functions/,
-- inside one transaction holding the schema's advisory lock; a database of an older release walks
-- migrations/ instead and ends with the same catalog (tests/unit/test_pg_schema.py compares them).
-- A change here is also a new numbered migration.
--
-- Times are bigint epoch milliseconds, as in the LMDB store. Text keys are COLLATE "C": byte
-- order, as LMDB sorts its keys (a vehicle's queue and a cancel's walk go in the same order on
-- both stores), and cheaper comparisons than a linguistic collation.

-- Payloads, once per sha1. touched_ms: the last write that referred to the blob (GC keeps blobs
-- touched within its grace period, and re-checks it in the transaction that deletes).
CREATE TABLE blobs (
    sha1        bytea  PRIMARY KEY,
    data        bytea  NOT NULL,
    created_ms  bigint NOT NULL,
    touched_ms  bigint NOT NULL
);

-- One pending request per (VIN, request_id): LMDB's `ids`. Its indexes replace LMDB's `expiry`,
-- `deadlines`, `by_request` and `backlogs` tables, and PostgreSQL keeps them with the row.
CREATE TABLE rows (
    vin         text COLLATE "C" NOT NULL,
    request_id  text COLLATE "C" NOT NULL,
    ts_ms       bigint   NOT NULL,
    sha1        bytea    NOT NULL,
    size        integer  NOT NULL,
    expires_ms  bigint   NOT NULL DEFAULT 0,   -- 0: never expires
    flags       smallint NOT NULL DEFAULT 0,   -- storage.model.FLAG_AWAIT_RESPONSE, FLAG_HIGH_PRIORITY
    PRIMARY KEY (vin, request_id)
);
-- The vehicle's queue, oldest first (and its backlog count for max_pending).
CREATE INDEX rows_queue ON rows (vin, ts_ms, request_id);
-- Retention walks rows oldest first.
CREATE INDEX rows_retention ON rows (ts_ms);
-- The expiry sweep walks only rows that have a deadline, soonest first.
CREATE INDEX rows_deadlines ON rows (expires_ms) WHERE expires_ms > 0;
-- A request's pending vehicles in VIN order: cancel, and a cancel of every vehicle in chunks.
CREATE INDEX rows_request ON rows (request_id, vin);
-- A vehicle's rows whose batch asked for high priority (flag 2, storage.model.FLAG_HIGH_PRIORITY),
-- oldest first: they go before its other rows (functions/vehicle_batches.sql).
CREATE INDEX rows_high ON rows (vin, ts_ms, request_id) WHERE (flags & 2) <> 0;

-- Vehicles whose backlog was last counted at half of max_pending_per_vehicle or more: the backlog
-- bound counts these on every new row, the others on a sample (functions/bound.sql).
CREATE TABLE crowded (
    vin text COLLATE "C" PRIMARY KEY
);

-- Platform data_ids of the plugin format: which blob a data_id names, and since when.
CREATE TABLE aliases (
    data_id  text COLLATE "C" PRIMARY KEY,
    sha1     bytea  NOT NULL,
    ts_ms    bigint NOT NULL
);
CREATE INDEX aliases_ts ON aliases (ts_ms);

-- Triggers that came before their data, in arrival order per data_id (bounded by the server).
CREATE TABLE early_triggers (
    data_id         text COLLATE "C" NOT NULL,
    seq             bigint GENERATED ALWAYS AS IDENTITY,
    request_id      text COLLATE "C" NOT NULL,
    vins            text[] COLLATE "C" NOT NULL,
    ts_ms           bigint   NOT NULL,
    batch_id        text COLLATE "C",
    correlation_id  text,
    expires_ms      bigint   NOT NULL DEFAULT 0,
    flags           smallint NOT NULL DEFAULT 0,
    PRIMARY KEY (data_id, seq)
);
CREATE INDEX early_triggers_ts ON early_triggers (ts_ms);

-- Counts per generation (request_id, blob sha1): how many (VIN, generation) pairs are in each
-- state (the slots of storage.model.COUNT_NAMES). Batches, cancels and expiry change them in the
-- transaction that changes the rows; a delivery's end appends its change to gen_deltas instead.
CREATE TABLE generations (
    request_id  text COLLATE "C" NOT NULL,
    sha1        bytea  NOT NULL,
    first_ms    bigint NOT NULL,
    last_ms     bigint NOT NULL,
    total       bigint NOT NULL DEFAULT 0,
    pending     bigint NOT NULL DEFAULT 0,
    delivered   bigint NOT NULL DEFAULT 0,
    superseded  bigint NOT NULL DEFAULT 0,
    cancelled   bigint NOT NULL DEFAULT 0,
    expired     bigint NOT NULL DEFAULT 0,
    failed      bigint NOT NULL DEFAULT 0,
    responded   bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (request_id, sha1)
);
-- ListRequests pages newest first by last change; GC drops old finished generations.
CREATE INDEX generations_last ON generations (last_ms);

-- Count changes appended, not applied in place: every PUBACK of a campaign ends a pair of the same
-- generation, and updating its one `generations` row would hold that row's lock to each commit,
-- so a campaign's acks would commit one after another. The leader folds them into `generations`
-- (storage.postgres.outcomes.fold); readers see both through `generation_counts`.
CREATE TABLE gen_deltas (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    request_id  text COLLATE "C" NOT NULL,
    sha1        bytea  NOT NULL,
    last_ms     bigint NOT NULL,
    total       bigint NOT NULL DEFAULT 0,
    pending     bigint NOT NULL DEFAULT 0,
    delivered   bigint NOT NULL DEFAULT 0,
    superseded  bigint NOT NULL DEFAULT 0,
    cancelled   bigint NOT NULL DEFAULT 0,
    expired     bigint NOT NULL DEFAULT 0,
    failed      bigint NOT NULL DEFAULT 0,
    responded   bigint NOT NULL DEFAULT 0
);
CREATE INDEX gen_deltas_generation ON gen_deltas (request_id, sha1, id);

-- A generation as readers see it: its folded counts plus the changes appended since; last_ms is
-- its latest change's. Sums are floored at 0 (an appended +1 not folded yet may be what keeps a
-- folded count from going below it).
CREATE VIEW generation_counts AS
SELECT g.request_id, g.sha1, g.first_ms,
       greatest(g.last_ms, coalesce(d.last_ms, 0)) AS last_ms,
       greatest(0, g.total + coalesce(d.total, 0)) AS total,
       greatest(0, g.pending + coalesce(d.pending, 0)) AS pending,
       greatest(0, g.delivered + coalesce(d.delivered, 0)) AS delivered,
       greatest(0, g.superseded + coalesce(d.superseded, 0)) AS superseded,
       greatest(0, g.cancelled + coalesce(d.cancelled, 0)) AS cancelled,
       greatest(0, g.expired + coalesce(d.expired, 0)) AS expired,
       greatest(0, g.failed + coalesce(d.failed, 0)) AS failed,
       greatest(0, g.responded + coalesce(d.responded, 0)) AS responded
FROM generations g LEFT JOIN (
    SELECT request_id, sha1, max(last_ms) AS last_ms,
           sum(total) AS total, sum(pending) AS pending, sum(delivered) AS delivered,
           sum(superseded) AS superseded, sum(cancelled) AS cancelled, sum(expired) AS expired,
           sum(failed) AS failed, sum(responded) AS responded
    FROM gen_deltas GROUP BY request_id, sha1
) d ON d.request_id = g.request_id AND d.sha1 = g.sha1;

-- How each (VIN, generation) that is no longer pending ended: code is a storage.model.Outcome.
CREATE TABLE outcomes (
    vin         text COLLATE "C" NOT NULL,
    request_id  text COLLATE "C" NOT NULL,
    sha1        bytea    NOT NULL,
    ended_ms    bigint   NOT NULL,
    stored_ms   bigint   NOT NULL,
    attempts    integer  NOT NULL,
    code        smallint NOT NULL,
    response    bytea    NOT NULL DEFAULT '\x'::bytea,   -- the vehicle's answer, for `responded`
    sent_ms     bigint,                                  -- its row's first publish; NULL: not known
    PRIMARY KEY (vin, request_id, sha1)
);
CREATE INDEX outcomes_ended ON outcomes (ended_ms);

-- The receipt of each batch stored under a batch_id (a retry stores nothing and gets it again).
-- sha1 NULL: a trigger still parked, waiting for its data.
CREATE TABLE batches (
    batch_id    text COLLATE "C" PRIMARY KEY,
    request_id  text COLLATE "C" NOT NULL,
    sha1        bytea,
    rows        integer NOT NULL,
    refused     text[] COLLATE "C" NOT NULL DEFAULT '{}',
    ts_ms       bigint  NOT NULL
);
CREATE INDEX batches_ts ON batches (ts_ms);

-- Cancels of every vehicle of a request in progress: rows stored up to cut_ms are taken, in
-- chunks walking VINs past after_vin; done counts the rows taken so far.
CREATE TABLE cancels (
    request_id      text COLLATE "C" PRIMARY KEY,
    cut_ms          bigint NOT NULL,
    after_vin       text COLLATE "C" NOT NULL DEFAULT '',
    done            bigint NOT NULL DEFAULT 0,
    correlation_id  text,
    -- Why it was started when not by a cancel message: "aborted" (a campaign's abort).
    reason          text COLLATE "C"
);

-- A request's campaign policy: its JSON as exhook_server/policy.py validated it (the store does not
-- read it) and when it was set.
CREATE TABLE policies (
    request_id  text COLLATE "C" PRIMARY KEY,
    doc         bytea  NOT NULL,
    set_ms      bigint NOT NULL,
    -- The abort of the request under this policy (criterion and counts as JSON): while it stands,
    -- sdv_store_batch refuses the request's batches; a new policy (or none) removes it.
    aborted     bytea
);

-- One row per answer whose "status" was failed or rejected (sdv_answer_failed), appended by
-- sdv_end_row in the answer's transaction (never updated: answers of one campaign do not queue on
-- a counter row); the `answer_failed` abort criterion counts them per request.
CREATE TABLE answer_failures (
    request_id  text COLLATE "C" NOT NULL,
    ended_ms    bigint NOT NULL
);
CREATE INDEX answer_failures_request ON answer_failures (request_id);
-- The delivery latencies of a generation (stored -> PUBACK, PUBACK -> answer: `stage` is the
-- index in storage.latency.STAGES) as counts in storage/latency.py's log buckets; every instance
-- adds its own (storage/postgres/latency.py); GC drops them with their generation.
CREATE TABLE gen_latency (
    request_id  text COLLATE "C" NOT NULL,
    sha1        bytea    NOT NULL,
    stage       smallint NOT NULL,
    bucket      smallint NOT NULL,
    n           bigint   NOT NULL,
    PRIMARY KEY (request_id, sha1, stage, bucket)
);

-- Who is online, and on which connection (an encoded exhook_server.dispatch.commands.Session).
-- UNLOGGED: written on every subscribe and disconnect, never worth a WAL flush; it is empty after a
-- crash or failover and fills again from the next subscribe or heartbeat of each vehicle.
CREATE UNLOGGED TABLE presence (
    vin      text COLLATE "C" PRIMARY KEY,
    session  text COLLATE "C" NOT NULL,
    seen_ms  bigint NOT NULL
);

-- The delivery out per vehicle (or voided: published, not acked, its connection gone; sent again
-- as a re-send): what a worker keeps in memory on LMDB, here so that any instance can handle any
-- hook of any vehicle. A row only while there is one.
CREATE TABLE vin_state (
    vin             text COLLATE "C" PRIMARY KEY,
    request_id      text COLLATE "C",                  -- the delivery out; NULL: nothing in flight
    sha1            bytea,
    session         text COLLATE "C",                  -- the connection it went to
    sent_ms         bigint,
    attempts        integer NOT NULL DEFAULT 0,        -- publishes of (request_id, sha1) so far
    await_response  boolean NOT NULL DEFAULT false,    -- the answer, not the PUBACK, ends it
    acked_ms        bigint,                            -- PUBACK of an awaited delivery
    cancelled       boolean NOT NULL DEFAULT false,    -- its row was cancelled while out
    voided          boolean NOT NULL DEFAULT false,
    sender          text COLLATE "C",                  -- the instance whose MQTT client sent it
    first_sent_ms   bigint                             -- the first publish of (request_id, sha1)
);
-- The in-flight sweep walks deliveries oldest first (only those out).
CREATE INDEX vin_state_sent ON vin_state (sent_ms) WHERE request_id IS NOT NULL;
-- A broker reconnect voids the deliveries its instance's client sent.
CREATE INDEX vin_state_sender ON vin_state (sender) WHERE request_id IS NOT NULL;
CREATE INDEX vin_state_acked ON vin_state (acked_ms) WHERE acked_ms IS NOT NULL;
-- max_in_flight counts a request's deliveries out (sdv_pacing_out).
CREATE INDEX vin_state_out ON vin_state (request_id) WHERE request_id IS NOT NULL AND NOT voided;

-- A paced request's fleet-wide token bucket: every instance leases its tokens from this row
-- (sdv_pacing_lease, functions/pacing.sql). Tokens accrue from stamp_ms at the rate the lease
-- gives, up to its burst.
CREATE TABLE pacing_buckets (
    request_id  text COLLATE "C" PRIMARY KEY,
    tokens      double precision NOT NULL,
    stamp_ms    bigint NOT NULL
);
