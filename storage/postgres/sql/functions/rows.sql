-- A batch's rows: one per (VIN, request), the payload it names, under the backlog bound
-- (sdv_over_bound, bound.sql). Called by sdv_store_batch (batches.sql) and by the plugin format's
-- trigger completion (storage/postgres/parked.py).

-- A row of (each VIN, p_request_id) holding p_sha1, as storage.lmdb.batches.put_rows does on LMDB: a row of
-- another payload ends superseded (or cancelled, when a cancel of every vehicle in progress had
-- taken it, stored by its cut); a VIN with p_max_pending rows already is refused (0: no bound).
-- Outcome records and generation counts change in the same transaction.
CREATE OR REPLACE FUNCTION sdv_put_rows(
    p_vins text[], p_request_id text, p_sha1 bytea, p_size integer, p_now bigint,
    p_expires bigint, p_flags smallint, p_max_pending integer,
    OUT replaced integer, OUT superseded bytea[], OUT refused text[])
-- No bitmap scans: reading a few index entries per VIN costs less than a bitmap scan's setup. No
-- JIT, whoever calls: the estimates over a table without statistics pass jit_above_cost, and
-- compiling took longer than the batch's whole write.
LANGUAGE plpgsql SET enable_bitmapscan = off SET jit = off AS $$
DECLARE
    c_total CONSTANT smallint := sdv_count_slot('total');
    c_pending CONSTANT smallint := sdv_count_slot('pending');
    c_superseded CONSTANT smallint := sdv_count_slot('superseded');
    c_cancelled CONSTANT smallint := sdv_count_slot('cancelled');
    v_ts bigint := p_now;
    v_cut bigint;
    v_known boolean;
    v_vins text[];
    v_fresh boolean;
    v_new text[];
    v_rest text[];
    v_newly text[];
    v_old_vins text[];
    v_old_sha1s bytea[];
    v_old_ts bigint[];
    v_end_sha1s bytea[];
    v_end_codes smallint[];
    v_revived smallint[];
    v_taken integer;
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
    PERFORM pg_advisory_xact_lock_shared(sdv_lock_class('request'), hashtext(p_request_id));
    -- Locked: a row replaced here may end cancelled, counted in the job's `done`.
    SELECT cut_ms INTO v_cut FROM cancels WHERE request_id = p_request_id FOR UPDATE;
    IF v_cut IS NOT NULL AND v_cut >= p_now THEN
        v_ts := v_cut + 1;  -- a cancel in progress takes the rows stored up to its cut, not these
    END IF;
    v_known := EXISTS (SELECT 1 FROM generations WHERE request_id = p_request_id AND sha1 = p_sha1);

    -- The new pairs, in VIN order (a concurrent batch inserting the same pair waits for this one).
    -- Usually every pair is new (a campaign's next VINs): a plain INSERT, whose unique check is
    -- part of its index insert, costs about a third less than ON CONFLICT's speculative insertion
    -- (a probe before each row, a lock and a confirming WAL record after). It runs in a
    -- subtransaction (the EXCEPTION block): when a pair exists after all, its rows are undone and
    -- the ON CONFLICT form runs. A batch whose first pair exists (the same VINs again) goes
    -- there directly.
    v_fresh := NOT EXISTS (SELECT 1 FROM rows WHERE vin = v_vins[1] AND request_id = p_request_id);
    IF v_fresh THEN
        BEGIN
            INSERT INTO rows (vin, request_id, ts_ms, sha1, size, expires_ms, flags)
            SELECT v, p_request_id, v_ts, p_sha1, p_size, p_expires, p_flags FROM unnest(v_vins) AS v;
            v_new := v_vins;
        EXCEPTION WHEN unique_violation THEN
            v_fresh := false;
        END;
    END IF;
    IF NOT v_fresh THEN
        WITH written AS (
            INSERT INTO rows (vin, request_id, ts_ms, sha1, size, expires_ms, flags)
            SELECT v, p_request_id, v_ts, p_sha1, p_size, p_expires, p_flags FROM unnest(v_vins) AS v
            ON CONFLICT (vin, request_id) DO NOTHING
            RETURNING vin
        )
        SELECT coalesce(array_agg(w.vin ORDER BY w.vin COLLATE "C"), '{}') INTO v_new FROM written w;
    END IF;
    IF p_max_pending > 0 AND cardinality(v_new) > 0 THEN
        refused := sdv_over_bound(v_new, p_max_pending);
        IF cardinality(refused) > 0 THEN
            DELETE FROM rows WHERE request_id = p_request_id AND vin = ANY(refused);
            v_new := ARRAY(SELECT v FROM unnest(v_new) AS v WHERE v <> ALL(refused) ORDER BY v COLLATE "C");
        END IF;
    END IF;

    -- The pairs that existed: locked and read, then replaced (the bound does not apply to them).
    IF cardinality(v_new) + cardinality(refused) < cardinality(v_vins) THEN
        v_rest := ARRAY(SELECT v FROM unnest(v_vins) AS v WHERE v <> ALL(v_new) AND v <> ALL(refused)
                        ORDER BY v COLLATE "C");
        SELECT coalesce(array_agg(o.vin ORDER BY o.vin), '{}'), coalesce(array_agg(o.sha1 ORDER BY o.vin), '{}'),
               coalesce(array_agg(o.ts_ms ORDER BY o.vin), '{}')
            INTO v_old_vins, v_old_sha1s, v_old_ts
            FROM (SELECT vin, sha1, ts_ms FROM rows WHERE request_id = p_request_id AND vin = ANY(v_rest)
                  ORDER BY vin FOR UPDATE) o;
        IF cardinality(v_old_vins) <> cardinality(v_rest) THEN  -- deleted since the insert saw it
            RAISE EXCEPTION USING ERRCODE = 'serialization_failure', MESSAGE = 'sdv: a concurrent write ended a row';
        END IF;
        UPDATE rows SET ts_ms = v_ts, sha1 = p_sha1, size = p_size, expires_ms = p_expires, flags = p_flags
            WHERE request_id = p_request_id AND vin = ANY(v_old_vins);
        replaced := cardinality(v_old_vins);

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
        -- Pending now and not before: the new pairs, and those that held another payload.
        v_newly := v_new || ARRAY(SELECT o.vin FROM unnest(v_old_vins, v_old_sha1s) AS o(vin, sha1)
                                  WHERE o.sha1 <> p_sha1);
    ELSE
        v_end_sha1s := '{}';
        v_end_codes := '{}';
        v_newly := v_new;
    END IF;

    -- A pair of this generation that had ended (sent, then the same again) is pending again, and
    -- `total` does not grow for it.
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
            SELECT e.sha1, c_pending, -1 FROM unnest(v_end_sha1s) AS e(sha1)
            UNION ALL SELECT e.sha1, e.code, 1 FROM unnest(v_end_sha1s, v_end_codes) AS e(sha1, code)
            UNION ALL SELECT p_sha1, c_total, cardinality(v_newly) WHERE cardinality(v_newly) > 0
            UNION ALL SELECT p_sha1, c_pending, cardinality(v_newly) WHERE cardinality(v_newly) > 0
            UNION ALL SELECT p_sha1, r.code, -1 FROM unnest(v_revived) AS r(code)
            UNION ALL SELECT p_sha1, c_total, -1 FROM unnest(v_revived) AS r(code)
        )
        SELECT b.sha1,
               coalesce(sum(b.n) FILTER (WHERE b.slot = sdv_count_slot('total')), 0) AS total,
               coalesce(sum(b.n) FILTER (WHERE b.slot = sdv_count_slot('pending')), 0) AS pending,
               coalesce(sum(b.n) FILTER (WHERE b.slot = sdv_count_slot('delivered')), 0) AS delivered,
               coalesce(sum(b.n) FILTER (WHERE b.slot = sdv_count_slot('superseded')), 0) AS superseded,
               coalesce(sum(b.n) FILTER (WHERE b.slot = sdv_count_slot('cancelled')), 0) AS cancelled,
               coalesce(sum(b.n) FILTER (WHERE b.slot = sdv_count_slot('expired')), 0) AS expired,
               coalesce(sum(b.n) FILTER (WHERE b.slot = sdv_count_slot('failed')), 0) AS failed,
               coalesce(sum(b.n) FILTER (WHERE b.slot = sdv_count_slot('responded')), 0) AS responded
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
