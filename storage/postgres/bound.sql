-- Schema version 8: the backlog bound counts a sample of the vehicles below half of it.
--
-- Version 6 counted, for every new row, its vehicle's queue up to max_pending entries: an index
-- descent and a heap visit per entry, about a quarter of the database CPU of a whole batch, to
-- learn what is nearly always "far below the bound". Here a vehicle's queue is counted when the
-- vehicle is listed in `crowded` (its last count reached half the bound) and otherwise with
-- probability 64 / max_pending per new row. A vehicle that climbs from half the bound to the
-- bound gets max_pending / 2 new rows on the way, about 32 of them counted: the chance that none
-- is, and that the vehicle passes the bound unlisted, is below 1e-13 (and then each further row
-- is counted with the same probability). A listed vehicle is counted on every new row and
-- refused exactly as before; its listing ends when a count finds it below a quarter of the bound.
-- A bound of 64 or less counts every vehicle on every new row, as version 6 did. Near the bound
-- the decisive count runs under the vehicle's listing locked, so concurrent batches cannot pass it
-- together (version 6 let each of them add a row).
-- sdv_put_rows is version 6's with its probe replaced by a call of sdv_over_bound.

-- Vehicles whose backlog was last counted at half of max_pending_per_vehicle or more.
CREATE TABLE crowded (
    vin text COLLATE "C" PRIMARY KEY
);
-- The backlogs stored before this version were never counted into `crowded`: every vehicle with 32
-- rows or more (half of the smallest sampled bound, 65) is listed now, so one already at its bound
-- is refused from its next row on and counted by the gauge. A listed vehicle under a quarter of
-- the bound in force leaves the list with its next row. One pass over the rows, here only.
INSERT INTO crowded (vin) SELECT vin FROM rows GROUP BY vin HAVING count(*) >= 32;

-- The VINs of p_vins (each just given a new row) now holding more than p_max_pending rows, in VIN
-- order; `crowded` updated with what the counts found. Called by sdv_put_rows, whose settings it
-- runs under (no bitmap scans: a count walks a few index entries per VIN, less than a bitmap
-- scan's setup; no JIT); settings of its own would cost more per call than the sampled counts.
CREATE OR REPLACE FUNCTION sdv_over_bound(p_vins text[], p_max_pending integer) RETURNS text[]
LANGUAGE plpgsql AS $$
DECLARE
    c_counted CONSTANT double precision := 64;  -- counts per max_pending new rows of a vehicle
    v_rate double precision := least(1.0, c_counted / p_max_pending);
    v_listed text[] := '{}';
    v_near text[];
    v_unlist text[];
    v text;
BEGIN
    IF EXISTS (SELECT 1 FROM crowded) THEN  -- usually empty: no lookup per VIN then
        SELECT coalesce(array_agg(c.vin), '{}') INTO v_listed FROM crowded c WHERE c.vin = ANY(p_vins);
    END IF;
    -- Counted up to the bound + 1: a huge backlog costs no more than one at the bound. random()
    -- is below 1: a bound of 64 or less counts every VIN.
    SELECT coalesce(array_agg(q.v ORDER BY q.v COLLATE "C") FILTER (WHERE q.n * 2 >= p_max_pending), '{}'),
           coalesce(array_agg(q.v) FILTER (WHERE q.listed AND q.n * 4 < p_max_pending), '{}')
        INTO v_near, v_unlist
        FROM (SELECT u.v, u.v = ANY(v_listed) AS listed,
                     (SELECT count(*) FROM (SELECT 1 FROM rows r WHERE r.vin = u.v LIMIT p_max_pending + 1) e) AS n
              FROM unnest(p_vins) AS u(v)
              WHERE u.v = ANY(v_listed) OR random() < v_rate) q;
    IF cardinality(v_unlist) > 0 THEN
        DELETE FROM crowded WHERE vin = ANY(v_unlist);
    END IF;
    IF cardinality(v_near) = 0 THEN
        RETURN '{}';
    END IF;
    -- Listed, and each listing locked, in VIN order. Two batches adding to one vehicle at the same
    -- time each see their own new row and the committed ones, not the other's: both could pass a
    -- bound one row short. Near the bound the second waits here (on the first one's insert or its
    -- lock) until the first commits, and the count that decides runs after, in a snapshot of its
    -- own (READ COMMITTED, the store's): it sees the first one's row. A row lock, not an advisory
    -- lock: a batch may lock 200 vehicles, and advisory locks fill the shared lock table.
    FOREACH v IN ARRAY v_near LOOP
        INSERT INTO crowded (vin) VALUES (v) ON CONFLICT DO NOTHING;
        PERFORM 1 FROM crowded c WHERE c.vin = v FOR UPDATE;
    END LOOP;
    RETURN ARRAY(SELECT u.v FROM unnest(v_near) AS u(v)
                 WHERE EXISTS (SELECT 1 FROM rows r WHERE r.vin = u.v OFFSET p_max_pending LIMIT 1)
                 ORDER BY u.v COLLATE "C");
END $$;

CREATE OR REPLACE FUNCTION sdv_put_rows(
    p_vins text[], p_request_id text, p_sha1 bytea, p_size integer, p_now bigint,
    p_expires bigint, p_flags smallint, p_max_pending integer,
    OUT replaced integer, OUT superseded bytea[], OUT refused text[])
-- As in version 6: no bitmap scans (the reads of a few pairs by VIN), no JIT.
LANGUAGE plpgsql SET enable_bitmapscan = off SET jit = off AS $$
DECLARE
    -- Outcome codes: their slots in storage.lmdb.keys.COUNT_NAMES (storage.lmdb.outcomes.Outcome).
    c_superseded CONSTANT smallint := 3;
    c_cancelled CONSTANT smallint := 4;
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
    PERFORM pg_advisory_xact_lock_shared(21316, hashtext(p_request_id));  -- ingest.REQUEST_LOCK
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

-- The vehicles holding p_bound pending rows or more, for the vehicles-at-bound gauge. With a bound
-- above 64 a vehicle gets there only through a count that listed it (at half the bound), so only
-- listed vehicles are counted: O(listed x bound), not a pass over every row. A bound of 64 or
-- less lists nobody: every vehicle's rows are counted.
CREATE OR REPLACE FUNCTION sdv_vehicles_at(p_bound integer) RETURNS bigint
LANGUAGE sql STABLE SET enable_bitmapscan = off AS $$
    SELECT CASE WHEN p_bound > 64 THEN
        (SELECT count(*) FROM crowded c
         WHERE EXISTS (SELECT 1 FROM rows r WHERE r.vin = c.vin OFFSET p_bound - 1 LIMIT 1))
    ELSE
        (SELECT count(*) FROM (SELECT 1 FROM rows GROUP BY vin HAVING count(*) >= p_bound) v)
    END
$$;
