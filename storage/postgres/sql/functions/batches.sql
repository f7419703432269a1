-- A batch's write as one statement: its batch id, its blob, its rows (sdv_put_rows, rows.sql) and
-- its receipt, in the caller's transaction (one round trip for the seed format; parked.py calls the
-- parts inside its own transactions for the plugin format). The only implementation of these rules
-- on PostgreSQL; storage/postgres/batches.py and parked.py call them.
--
-- A concurrent writer that changed what a function had read (a row created after it looked, a
-- blob collected between insert and touch) makes it raise serialization_failure: the caller runs
-- the whole statement again (batches.RACE_RETRIES times). Locks are taken in one order
-- everywhere: the request's advisory lock, its cancel row, its rows in VIN order (byte order,
-- COLLATE "C"), then its generation rows in sha1 order.

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

-- A batch of a request whose campaign was aborted is refused (SQLSTATE SDVAB, RequestAborted in
-- Python; twin: storage.lmdb.policies.refuse_aborted). Under the request's shared lock, as
-- sdv_put_rows takes it: an abort (batches.abort, exclusive) either committed before, and is seen
-- here, or waits for this batch, whose rows its cancel then takes.
CREATE OR REPLACE FUNCTION sdv_refuse_aborted(p_request_id text)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock_shared(sdv_lock_class('request'), hashtext(p_request_id));
    IF EXISTS (SELECT 1 FROM policies WHERE request_id = p_request_id AND aborted IS NOT NULL) THEN
        RAISE EXCEPTION USING ERRCODE = 'SDVAB', MESSAGE = 'sdv: request aborted by its campaign policy';
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
    PERFORM sdv_refuse_aborted(p_request_id);
    new_blob := sdv_put_blob(p_sha1, p_blob, p_now, p_touch_every);
    SELECT r.replaced, r.superseded, r.refused INTO replaced, superseded, refused
        FROM sdv_put_rows(p_vins, p_request_id, p_sha1, length(p_blob), p_now, p_expires, p_flags, p_max_pending) r;
    IF p_batch_id IS NOT NULL THEN
        UPDATE batches SET sha1 = p_sha1, rows = cardinality(p_vins) - cardinality(sdv_store_batch.refused),
            refused = sdv_store_batch.refused WHERE batch_id = p_batch_id;
    END IF;
END $$;
