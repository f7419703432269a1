-- Version 1: the base tables, the LMDB store's tables (storage/lmdb/keys.py) as tables.
--
-- Frozen: the schema as version 1 created it, the start of the walk that brings a database of an
-- older release to the current schema (../schema.sql is that schema, for a new database). Times
-- are bigint epoch milliseconds; text keys are COLLATE "C" (byte order, as LMDB sorts its keys).

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
    flags       smallint NOT NULL DEFAULT 0,   -- storage.lmdb.keys.FLAG_AWAIT_RESPONSE
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
-- state. Changed in the transaction that changes the rows, so they equal a recount.
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

-- How each (VIN, generation) that is no longer pending ended: storage.lmdb.outcomes.Outcome values.
CREATE TABLE outcomes (
    vin         text COLLATE "C" NOT NULL,
    request_id  text COLLATE "C" NOT NULL,
    sha1        bytea    NOT NULL,
    ended_ms    bigint   NOT NULL,
    stored_ms   bigint   NOT NULL,
    attempts    integer  NOT NULL,
    code        smallint NOT NULL,
    response    bytea    NOT NULL DEFAULT '\x'::bytea,   -- the vehicle's answer, for `responded`
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
    correlation_id  text
);
