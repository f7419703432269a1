-- Schema version 5: a batch's write as one statement.
--
-- storage/postgres/batches.py used to send a batch as about a dozen statements (BEGIN, the batch id, the
-- blob, the request lock, the cancel cut, the generation, the old rows, the backlogs, the upsert,
-- the outcomes, the counts, the receipt, COMMIT): a dozen round trips, each a wake-up of the
-- server and of the client, while the raw write of the same rows takes four. These functions do
-- the same work inside the database, so a batch costs one round trip and its own implicit
-- transaction (committed with synchronous_commit = on before the call returns). They are the only
-- implementation of these rules on PostgreSQL; ingest.py and early.py call them.
--
-- A concurrent writer that changed what a function had read (a row created after it looked, a
-- blob collected between insert and touch) makes it raise serialization_failure: the caller runs
-- the whole statement again (ingest.RACE_RETRIES times), as it did for its own transactions.
-- Locks are taken in one order everywhere: the request's advisory lock, its cancel row, its rows
-- in VIN order (byte order, COLLATE "C"), then its generation rows in sha1 order.

-- The blob `p_sha1` is referred to now: its touched_ms moves to `p_now` (for GC's grace period),
-- taking its row lock only when the last touch is older than `p_every` ms. False: it is gone.
CREATE OR REPLACE FUNCTION sdv_touch_blob(p_sha1 bytea, p_now bigint, p_every bigint)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    v_touched bigint;
BEGIN
    SELECT touched_ms INTO v_touched FROM blobs WHERE sha1 = p_sha1;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF v_touched < p_now - p_every THEN
        UPDATE blobs SET touched_ms = p_now WHERE sha1 = p_sha1;
        RETURN FOUND;
    END IF;
    RETURN true;
END $$;

-- The blob once: true when this call wrote it; a present one is touched.
CREATE OR REPLACE FUNCTION sdv_put_blob(p_sha1 bytea, p_blob bytea, p_now bigint, p_every bigint)
RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO blobs (sha1, data, created_ms, touched_ms) VALUES (p_sha1, p_blob, p_now, p_now)
        ON CONFLICT (sha1) DO NOTHING;
    IF FOUND THEN
        RETURN true;
    END IF;
    IF NOT sdv_touch_blob(p_sha1, p_now, p_every) THEN
        RAISE EXCEPTION USING ERRCODE = 'serialization_failure', MESSAGE = 'sdv: blob collected while stored again';
    END IF;
    RETURN false;
END $$;

-- A row of (each VIN, p_request_id) holding p_sha1, as storage.lmdb.batches.put_rows does on LMDB: a row of
-- another payload ends superseded (or cancelled, when a cancel of every vehicle in progress had
-- taken it, stored by its cut); a VIN with p_max_pending rows already is refused (0: no bound).
-- Outcome records and generation counts change in the same transaction.
CREATE OR REPLACE FUNCTION sdv_put_rows(
    p_vins text[], p_request_id text, p_sha1 bytea, p_size integer, p_now bigint,
    p_expires bigint, p_flags smallint, p_max_pending integer,
    OUT replaced integer, OUT superseded bytea[], OUT refused text[])
LANGUAGE plpgsql AS $$
DECLARE
    -- Outcome codes: their slots in storage.lmdb.keys.COUNT_NAMES (storage.lmdb.outcomes.Outcome).
    c_superseded CONSTANT smallint := 3;
    c_cancelled CONSTANT smallint := 4;
    v_ts bigint := p_now;
    v_cut bigint;
    v_known boolean;
    v_vins text[];
    v_stored text[];
    v_newly text[];
    v_old_vins text[];
    v_old_sha1s bytea[];
    v_old_ts bigint[];
    v_end_sha1s bytea[];
    v_end_codes smallint[];
    v_revived smallint[];
    v_taken integer;
    v_raced integer;
    v_gen record;
BEGIN
    replaced := 0;
    superseded := '{}';
    refused := '{}';
    SELECT coalesce(array_agg(DISTINCT v COLLATE "C" ORDER BY v COLLATE "C"), '{}') INTO v_vins
        FROM unnest(p_vins) AS v;
    IF cardinality(v_vins) = 0 THEN
        RETURN;
    END IF;
    -- Shared: batches of one request never wait for each other, only for the start of a cancel.
    PERFORM pg_advisory_xact_lock_shared(21316, hashtext(p_request_id));  -- ingest.REQUEST_LOCK
    -- Locked: a row replaced here may end cancelled, counted in the job's `done`.
    SELECT cut_ms INTO v_cut FROM cancels WHERE request_id = p_request_id FOR UPDATE;
    IF v_cut IS NOT NULL AND v_cut >= p_now THEN
        v_ts := v_cut + 1;  -- a cancel in progress takes the rows stored up to its cut, not these
    END IF;
    v_known := EXISTS (SELECT 1 FROM generations WHERE request_id = p_request_id AND sha1 = p_sha1);
    SELECT coalesce(array_agg(o.vin ORDER BY o.vin), '{}'), coalesce(array_agg(o.sha1 ORDER BY o.vin), '{}'),
           coalesce(array_agg(o.ts_ms ORDER BY o.vin), '{}')
        INTO v_old_vins, v_old_sha1s, v_old_ts
        FROM (SELECT vin, sha1, ts_ms FROM rows WHERE request_id = p_request_id AND vin = ANY(v_vins)
              ORDER BY vin FOR UPDATE) o;
    IF p_max_pending > 0 THEN
        -- Counted through the vehicle's queue index up to the bound: a huge backlog costs no more.
        SELECT coalesce(array_agg(v ORDER BY v COLLATE "C"), '{}') INTO refused
            FROM unnest(v_vins) AS v
            WHERE v <> ALL(v_old_vins)
              AND (SELECT count(*) FROM (SELECT 1 FROM rows r WHERE r.vin = v LIMIT p_max_pending) s) >= p_max_pending;
    END IF;
    SELECT coalesce(array_agg(v ORDER BY v COLLATE "C"), '{}') INTO v_stored
        FROM unnest(v_vins) AS v WHERE v <> ALL(refused);
    IF cardinality(v_stored) = 0 THEN
        RETURN;
    END IF;
    replaced := cardinality(v_old_vins);
    WITH written AS (
        INSERT INTO rows (vin, request_id, ts_ms, sha1, size, expires_ms, flags)
        SELECT v, p_request_id, v_ts, p_sha1, p_size, p_expires, p_flags FROM unnest(v_stored) AS v
        ON CONFLICT (vin, request_id) DO UPDATE SET ts_ms = EXCLUDED.ts_ms, sha1 = EXCLUDED.sha1,
            size = EXCLUDED.size, expires_ms = EXCLUDED.expires_ms, flags = EXCLUDED.flags
        RETURNING vin, xmax = 0 AS inserted
    )
    SELECT count(*) INTO v_raced FROM written w WHERE w.inserted = (w.vin = ANY(v_old_vins));
    IF v_raced > 0 THEN  -- a row appeared after our read: not the view the counts were made from
        RAISE EXCEPTION USING ERRCODE = 'serialization_failure', MESSAGE = 'sdv: a concurrent batch created a row';
    END IF;

    -- The old rows of another payload end: superseded, or cancelled behind a cut.
    WITH ended AS (
        SELECT o.vin, o.sha1, o.ts,
               CASE WHEN v_cut IS NOT NULL AND o.ts <= v_cut THEN c_cancelled ELSE c_superseded END AS code
        FROM unnest(v_old_vins, v_old_sha1s, v_old_ts) AS o(vin, sha1, ts) WHERE o.sha1 <> p_sha1
    ), recorded AS (
        INSERT INTO outcomes (vin, request_id, sha1, ended_ms, stored_ms, attempts, code, response)
        SELECT e.vin, p_request_id, e.sha1, v_ts, e.ts, 0, e.code, '\x'::bytea FROM ended e ORDER BY e.vin, e.sha1
        ON CONFLICT (vin, request_id, sha1) DO UPDATE SET ended_ms = EXCLUDED.ended_ms,
            stored_ms = EXCLUDED.stored_ms, attempts = EXCLUDED.attempts, code = EXCLUDED.code,
            response = EXCLUDED.response
        RETURNING sha1, code
    )
    SELECT coalesce(array_agg(r.sha1), '{}'), coalesce(array_agg(r.code), '{}') INTO v_end_sha1s, v_end_codes
        FROM recorded r;
    SELECT count(*) INTO v_taken FROM unnest(v_end_codes) AS c WHERE c = c_cancelled;
    IF v_taken > 0 THEN
        UPDATE cancels SET done = done + v_taken WHERE request_id = p_request_id;
    END IF;
    SELECT coalesce(array_agg(DISTINCT e.sha1 ORDER BY e.sha1), '{}') INTO superseded
        FROM unnest(v_end_sha1s, v_end_codes) AS e(sha1, code) WHERE e.code = c_superseded;

    -- The rows that now hold p_sha1 and did not: pending; a pair of this generation that had
    -- ended (sent, then the same again) is pending again, and `total` does not grow for it.
    SELECT coalesce(array_agg(v ORDER BY v COLLATE "C"), '{}') INTO v_newly
        FROM unnest(v_stored) AS v
        WHERE v <> ALL(v_old_vins)
           OR v IN (SELECT o.vin FROM unnest(v_old_vins, v_old_sha1s) AS o(vin, sha1) WHERE o.sha1 <> p_sha1);
    v_revived := '{}';
    IF v_known AND cardinality(v_newly) > 0 THEN
        WITH revived AS (
            DELETE FROM outcomes WHERE request_id = p_request_id AND sha1 = p_sha1 AND vin = ANY(v_newly)
            RETURNING code
        )
        SELECT coalesce(array_agg(r.code), '{}') INTO v_revived FROM revived r;
    END IF;

    -- One change per generation, in sha1 order. No floor at 0 on an existing row (changes
    -- appended to gen_deltas may be what keeps the sum up; readers and the fold floor the sums).
    FOR v_gen IN
        WITH bump(sha1, slot, n) AS (
            SELECT e.sha1, 1, -1 FROM unnest(v_end_sha1s) AS e(sha1)
            UNION ALL SELECT e.sha1, e.code::int, 1 FROM unnest(v_end_sha1s, v_end_codes) AS e(sha1, code)
            UNION ALL SELECT p_sha1, 0, cardinality(v_newly) WHERE cardinality(v_newly) > 0
            UNION ALL SELECT p_sha1, 1, cardinality(v_newly) WHERE cardinality(v_newly) > 0
            UNION ALL SELECT p_sha1, r.code::int, -1 FROM unnest(v_revived) AS r(code)
            UNION ALL SELECT p_sha1, 0, -1 FROM unnest(v_revived) AS r(code)
        )
        SELECT b.sha1,
               coalesce(sum(b.n) FILTER (WHERE b.slot = 0), 0) AS total,
               coalesce(sum(b.n) FILTER (WHERE b.slot = 1), 0) AS pending,
               coalesce(sum(b.n) FILTER (WHERE b.slot = 2), 0) AS delivered,
               coalesce(sum(b.n) FILTER (WHERE b.slot = 3), 0) AS superseded,
               coalesce(sum(b.n) FILTER (WHERE b.slot = 4), 0) AS cancelled,
               coalesce(sum(b.n) FILTER (WHERE b.slot = 5), 0) AS expired,
               coalesce(sum(b.n) FILTER (WHERE b.slot = 6), 0) AS failed,
               coalesce(sum(b.n) FILTER (WHERE b.slot = 7), 0) AS responded
        FROM bump b GROUP BY b.sha1 ORDER BY b.sha1
    LOOP
        INSERT INTO generations AS g (request_id, sha1, first_ms, last_ms, total, pending, delivered,
                                      superseded, cancelled, expired, failed, responded)
        VALUES (p_request_id, v_gen.sha1, v_ts, v_ts, greatest(0, v_gen.total), greatest(0, v_gen.pending),
                greatest(0, v_gen.delivered), greatest(0, v_gen.superseded), greatest(0, v_gen.cancelled),
                greatest(0, v_gen.expired), greatest(0, v_gen.failed), greatest(0, v_gen.responded))
        ON CONFLICT (request_id, sha1) DO UPDATE SET last_ms = v_ts,
            total = g.total + v_gen.total, pending = g.pending + v_gen.pending,
            delivered = g.delivered + v_gen.delivered, superseded = g.superseded + v_gen.superseded,
            cancelled = g.cancelled + v_gen.cancelled, expired = g.expired + v_gen.expired,
            failed = g.failed + v_gen.failed, responded = g.responded + v_gen.responded;
    END LOOP;
END $$;

-- Take `p_batch_id` for this transaction (taken true), or the receipt of whoever took it first.
-- The insert comes first: a concurrent retry of the same batch waits on it, then finds it taken.
CREATE OR REPLACE FUNCTION sdv_claim_batch_id(
    p_batch_id text, p_request_id text, p_now bigint,
    OUT taken boolean, OUT first_request_id text, OUT first_sha1 bytea, OUT first_rows integer,
    OUT first_ts bigint, OUT first_refused text[])
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO batches (batch_id, request_id, sha1, rows, ts_ms) VALUES (p_batch_id, p_request_id, NULL, 0, p_now)
        ON CONFLICT (batch_id) DO NOTHING;
    taken := FOUND;
    IF taken THEN
        RETURN;
    END IF;
    SELECT b.request_id, b.sha1, b.rows, b.ts_ms, b.refused
        INTO first_request_id, first_sha1, first_rows, first_ts, first_refused
        FROM batches b WHERE b.batch_id = p_batch_id;
    IF NOT FOUND THEN  -- collected between the two statements: the next try stores the batch
        RAISE EXCEPTION USING ERRCODE = 'serialization_failure', MESSAGE = 'sdv: batch id collected meanwhile';
    END IF;
END $$;

-- A seed-format batch (storage.lmdb.batches.store_batch): nothing if `p_batch_id` was stored (taken false,
-- and the first receipt), else the blob once and a row per VIN (sdv_put_rows) and, under a batch
-- id, its receipt.
CREATE OR REPLACE FUNCTION sdv_store_batch(
    p_vins text[], p_request_id text, p_blob bytea, p_sha1 bytea, p_now bigint, p_batch_id text,
    p_expires bigint, p_flags smallint, p_max_pending integer, p_touch_every bigint,
    OUT taken boolean, OUT first_request_id text, OUT first_sha1 bytea, OUT first_rows integer,
    OUT first_ts bigint, OUT first_refused text[],
    OUT new_blob boolean, OUT replaced integer, OUT superseded bytea[], OUT refused text[])
LANGUAGE plpgsql AS $$
BEGIN
    taken := true;
    IF p_batch_id IS NOT NULL THEN
        SELECT * INTO taken, first_request_id, first_sha1, first_rows, first_ts, first_refused
            FROM sdv_claim_batch_id(p_batch_id, p_request_id, p_now);
        IF NOT taken THEN
            RETURN;
        END IF;
    END IF;
    new_blob := sdv_put_blob(p_sha1, p_blob, p_now, p_touch_every);
    SELECT r.replaced, r.superseded, r.refused INTO replaced, superseded, refused
        FROM sdv_put_rows(p_vins, p_request_id, p_sha1, length(p_blob), p_now, p_expires, p_flags, p_max_pending) r;
    IF p_batch_id IS NOT NULL THEN
        UPDATE batches SET sha1 = p_sha1, rows = cardinality(p_vins) - cardinality(sdv_store_batch.refused),
            refused = sdv_store_batch.refused WHERE batch_id = p_batch_id;
    END IF;
END $$;
