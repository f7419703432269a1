-- Vehicle events in batches: many vehicles' events in two statements and no explicit
-- transaction. sdv_vin_load_many reads their state without a lock, the Worker rules
-- (exhook_server/dispatch/worker.py) decide in the instance, and sdv_vin_save_many writes what they
-- decided for each vehicle whose state is still what the load read (checked under the vehicle's
-- lock, in the save's own transaction). A vehicle whose lock is held right now, or that another
-- instance changed in between, is left untouched and its event runs again: the lock is tried,
-- never waited for, so vehicles' locks cannot deadlock. Called by storage/postgres/dispatch.py.
-- Its state can change and come back between the load and the save (nothing out, then a send
-- and its PUBACK elsewhere, then nothing out again): a send is therefore also checked to find
-- its row still pending, or the vehicle would get that row a second time.

-- A vehicle's recorded delivery as text: what its event's decision depended on, besides its
-- presence and its rows (rows are not the vehicle lock's to protect, see docs/postgresql.md; but
-- a send's own row is checked, sdv_vin_save_many).
CREATE OR REPLACE FUNCTION sdv_marker_token(p_vin text) RETURNS text LANGUAGE sql STABLE AS $$
    SELECT (s.request_id, s.sha1, s.session, s.sent_ms, s.attempts, s.await_response, s.acked_ms,
            s.cancelled, s.voided)::text
    FROM vin_state s WHERE s.vin = p_vin AND s.request_id IS NOT NULL
$$;

-- sdv_vin_load's reads for many vehicles in one snapshot, without a lock: per vehicle its
-- presence ('p'), its first p_rows deliverable rows with payloads in delivery order ('r') and its
-- delivery ('s', with its token). Delivery order: high priority first (flag 2, FLAG_HIGH_PRIORITY
-- of storage/model.py: its batch asked it; or its request id in p_high: its policy says so),
-- oldest first, then by request id. Rows of the request ids p_held names are passed over: their
-- campaign policy holds them (exhook_server/dispatch/gates.py). One index probe per vehicle and
-- lane (LATERAL ... LIMIT keeps the planner from hashing whole tables; flagged rows through the
-- partial index rows_high, p_high's by a probe per request id; the normal lane's flag test is
-- written "<> 2" so that the planner expects most rows to pass and walks rows_queue in order).
CREATE OR REPLACE FUNCTION sdv_vin_load_many(
    p_vins text[], p_now bigint, p_rows integer, p_held text[], p_high text[])
RETURNS TABLE (
    vin text, kind text, session text, request_id text, sha1 bytea, sent_ms bigint, attempts integer,
    await_response boolean, acked_ms bigint, cancelled boolean, voided boolean,
    ts_ms bigint, size integer, expires_ms bigint, flags smallint, data bytea, token text
) LANGUAGE sql STABLE SET jit = off AS $$
    SELECT v.vin, 'p'::text, p.session::text, NULL::text, NULL::bytea, NULL::bigint, NULL::integer,
           NULL::boolean, NULL::bigint, NULL::boolean, NULL::boolean,
           NULL::bigint, NULL::integer, NULL::bigint, NULL::smallint, NULL::bytea, NULL::text
    FROM unnest(p_vins) AS v(vin)
    CROSS JOIN LATERAL (SELECT p.session FROM presence p WHERE p.vin = v.vin LIMIT 1) p
    UNION ALL
    SELECT v.vin, 'r', NULL, r.request_id::text, r.sha1, NULL, NULL, NULL, NULL, NULL, NULL,
           r.ts_ms, r.size, r.expires_ms, r.flags, r.data, NULL
    FROM unnest(p_vins) AS v(vin)
    CROSS JOIN LATERAL (
        SELECT q.* FROM (
            (SELECT 0 AS lane, r.request_id, r.sha1, r.ts_ms, r.size, r.expires_ms, r.flags, b.data
             FROM rows r JOIN blobs b ON b.sha1 = r.sha1 LEFT JOIN cancels c ON c.request_id = r.request_id
             WHERE r.vin = v.vin AND (r.flags & 2) <> 0
                AND NOT (r.expires_ms > 0 AND r.expires_ms <= p_now)
                AND (c.cut_ms IS NULL OR r.ts_ms > c.cut_ms) AND NOT (r.request_id = ANY (p_held))
             ORDER BY r.ts_ms, r.request_id LIMIT p_rows)
            UNION ALL
            (SELECT 0, r.request_id, r.sha1, r.ts_ms, r.size, r.expires_ms, r.flags, b.data
             FROM unnest(p_high) AS h(request_id)
             JOIN rows r ON r.vin = v.vin AND r.request_id = h.request_id
             JOIN blobs b ON b.sha1 = r.sha1 LEFT JOIN cancels c ON c.request_id = r.request_id
             WHERE (r.flags & 2) <> 2
                AND NOT (r.expires_ms > 0 AND r.expires_ms <= p_now)
                AND (c.cut_ms IS NULL OR r.ts_ms > c.cut_ms) AND NOT (r.request_id = ANY (p_held)))
            UNION ALL
            (SELECT 1, r.request_id, r.sha1, r.ts_ms, r.size, r.expires_ms, r.flags, b.data
             FROM rows r JOIN blobs b ON b.sha1 = r.sha1 LEFT JOIN cancels c ON c.request_id = r.request_id
             WHERE r.vin = v.vin AND (r.flags & 2) <> 2 AND NOT (r.request_id = ANY (p_high))
                AND NOT (r.expires_ms > 0 AND r.expires_ms <= p_now)
                AND (c.cut_ms IS NULL OR r.ts_ms > c.cut_ms) AND NOT (r.request_id = ANY (p_held))
             ORDER BY r.ts_ms, r.request_id LIMIT p_rows)
        ) q ORDER BY q.lane, q.ts_ms, q.request_id LIMIT p_rows) r
    UNION ALL
    SELECT v.vin, 's', s.session::text, s.request_id::text, s.sha1, s.sent_ms, s.attempts,
           s.await_response, s.acked_ms, s.cancelled, s.voided, NULL, NULL, NULL, NULL, NULL,
           sdv_marker_token(v.vin)
    FROM unnest(p_vins) AS v(vin)
    CROSS JOIN LATERAL (SELECT * FROM vin_state s WHERE s.vin = v.vin AND s.request_id IS NOT NULL LIMIT 1) s
$$;

-- What many vehicle events decided, in one transaction (the statement's own). Per event k (the
-- caller gives them in VIN order, one per vehicle: rows are then deleted in VIN order, the
-- store's lock order): try the vehicle's lock; held elsewhere, verdict 1 (busy). Its presence or
-- delivery no longer what the load read (p_seen_presence, p_seen_marker: sdv_marker_token), or
-- the event sends a row (p_marker 3: the given fields, a publish of their pair) that is no longer
-- pending (another instance sent it and saw it PUBACKed since the load, say), verdict 2 (changed).
-- Otherwise verdict 0: sdv_vin_save with the event's fields (p_marker 3 written as 1) and its
-- p_end_counts[k] pairs of the flattened p_end_* arrays, and which of them ended.
CREATE OR REPLACE FUNCTION sdv_vin_save_many(
    p_now bigint, p_vins text[], p_seen_presence text[], p_seen_marker text[],
    p_presence smallint[], p_session text[],
    p_marker smallint[], p_request_id text[], p_sha1 bytea[], p_marker_session text[], p_sent_ms bigint[],
    p_attempts integer[], p_await_response boolean[], p_acked_ms bigint[], p_cancelled boolean[],
    p_voided boolean[], p_sender text[],
    p_end_counts integer[], p_end_request_ids text[], p_end_sha1s bytea[], p_end_codes smallint[],
    p_end_attempts integer[], p_end_responses bytea[])
RETURNS TABLE (ev integer, verdict smallint, done boolean[]) LANGUAGE plpgsql SET jit = off AS $$
DECLARE
    k integer;
    v_first integer := 1;
    v_last integer;
BEGIN
    FOR k IN 1 .. coalesce(cardinality(p_vins), 0) LOOP
        ev := k;
        done := '{}';
        v_last := v_first + p_end_counts[k] - 1;
        IF NOT pg_try_advisory_xact_lock(sdv_lock_class('vehicle'), hashtext(p_vins[k])) THEN
            verdict := 1;
        ELSIF (SELECT p.session FROM presence p WHERE p.vin = p_vins[k]) IS DISTINCT FROM p_seen_presence[k]
                OR sdv_marker_token(p_vins[k]) IS DISTINCT FROM p_seen_marker[k]
                OR (p_marker[k] = 3 AND NOT EXISTS (
                    SELECT 1 FROM rows r
                    WHERE r.vin = p_vins[k] AND r.request_id = p_request_id[k] AND r.sha1 = p_sha1[k])) THEN
            verdict := 2;
        ELSE
            verdict := 0;
            done := sdv_vin_save(
                p_vins[k], p_now, p_presence[k], p_session[k],
                CASE WHEN p_marker[k] = 3 THEN 1::smallint ELSE p_marker[k] END, p_request_id[k], p_sha1[k],
                p_marker_session[k], p_sent_ms[k], p_attempts[k], p_await_response[k], p_acked_ms[k],
                p_cancelled[k], p_voided[k], p_sender[k],
                p_end_request_ids[v_first:v_last], p_end_sha1s[v_first:v_last], p_end_codes[v_first:v_last],
                p_end_attempts[v_first:v_last], p_end_responses[v_first:v_last]);
        END IF;
        v_first := v_last + 1;
        RETURN NEXT;
    END LOOP;
END $$;
