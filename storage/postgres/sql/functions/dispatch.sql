-- What a vehicle event reads and writes, under the vehicle's advisory lock: sdv_vin_load reads
-- its state in one round trip, the Worker rules (exhook_server/dispatch/worker.py) decide in
-- Python, and sdv_vin_save writes what they decided in one statement. Called by
-- storage/postgres/dispatch.py.

-- One round trip per vehicle event: take the vehicle's lock (held to the end of the transaction),
-- then read its presence, its state and its first deliverable rows with their payloads (also when
-- it is offline: the event may be the one that brings it online). In a plpgsql function each
-- statement takes a new snapshot, so the reads after the lock see everything committed before it
-- was granted.
CREATE OR REPLACE FUNCTION sdv_vin_load(p_vin text, p_now bigint, p_rows integer)
RETURNS TABLE (
    kind text, session text, request_id text, sha1 bytea, sent_ms bigint, attempts integer,
    await_response boolean, acked_ms bigint, cancelled boolean, voided boolean,
    ts_ms bigint, size integer, expires_ms bigint, flags smallint, data bytea
) LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(21318, hashtext(p_vin));
    RETURN QUERY SELECT 'p'::text, p.session::text, NULL::text, NULL::bytea, p.seen_ms, NULL::integer,
        NULL::boolean, NULL::bigint, NULL::boolean, NULL::boolean,
        NULL::bigint, NULL::integer, NULL::bigint, NULL::smallint, NULL::bytea
        FROM presence p WHERE p.vin = p_vin;
    RETURN QUERY SELECT 'r'::text, NULL::text, r.request_id::text, r.sha1, NULL::bigint, NULL::integer,
            NULL::boolean, NULL::bigint, NULL::boolean, NULL::boolean,
            r.ts_ms, r.size, r.expires_ms, r.flags, b.data
            FROM rows r JOIN blobs b ON b.sha1 = r.sha1 LEFT JOIN cancels c ON c.request_id = r.request_id
            WHERE r.vin = p_vin AND NOT (r.expires_ms > 0 AND r.expires_ms <= p_now)
                AND (c.cut_ms IS NULL OR r.ts_ms > c.cut_ms)
            ORDER BY r.ts_ms, r.request_id LIMIT p_rows;
    RETURN QUERY SELECT 's'::text, s.session::text, s.request_id::text, s.sha1, s.sent_ms, s.attempts,
        s.await_response, s.acked_ms, s.cancelled, s.voided,
        NULL::bigint, NULL::integer, NULL::bigint, NULL::smallint, NULL::bytea
        FROM vin_state s WHERE s.vin = p_vin AND s.request_id IS NOT NULL;
END
$$;

-- What a vehicle event decided, after the Worker rules ran on what sdv_vin_load read (the
-- caller's transaction holds the vehicle's lock): its presence (p_presence 0 unchanged, 1 online
-- with p_session, 2 offline), its delivery marker (p_marker 0 unchanged, 1 the given fields,
-- 2 none; p_sender NULL keeps the recorded sender) and the pairs it ended (sdv_end_row each, in
-- the order given), in one statement and that order (presence, vin_state, rows). Returns, per
-- ended pair, whether it ended.
CREATE OR REPLACE FUNCTION sdv_vin_save(
    p_vin text, p_now bigint, p_presence smallint, p_session text,
    p_marker smallint, p_request_id text, p_sha1 bytea, p_marker_session text, p_sent_ms bigint,
    p_attempts integer, p_await_response boolean, p_acked_ms bigint, p_cancelled boolean,
    p_voided boolean, p_sender text,
    p_end_request_ids text[], p_end_sha1s bytea[], p_end_codes smallint[], p_end_attempts integer[],
    p_end_responses bytea[])
RETURNS boolean[] LANGUAGE plpgsql SET jit = off AS $$
DECLARE
    v_done boolean[] := '{}';
    i integer;
BEGIN
    IF p_presence = 1 THEN
        INSERT INTO presence (vin, session, seen_ms) VALUES (p_vin, p_session, p_now)
            ON CONFLICT (vin) DO UPDATE SET session = excluded.session, seen_ms = excluded.seen_ms;
    ELSIF p_presence = 2 THEN
        DELETE FROM presence WHERE vin = p_vin;
    END IF;
    IF p_marker = 1 THEN
        INSERT INTO vin_state AS s (vin, request_id, sha1, session, sent_ms, attempts, await_response,
                                    acked_ms, cancelled, voided, sender)
        VALUES (p_vin, p_request_id, p_sha1, p_marker_session, p_sent_ms, p_attempts, p_await_response,
                p_acked_ms, p_cancelled, p_voided, p_sender)
        ON CONFLICT (vin) DO UPDATE SET request_id = excluded.request_id, sha1 = excluded.sha1,
            session = excluded.session, sent_ms = excluded.sent_ms, attempts = excluded.attempts,
            await_response = excluded.await_response, acked_ms = excluded.acked_ms,
            cancelled = excluded.cancelled, voided = excluded.voided,
            sender = coalesce(excluded.sender, s.sender);
    ELSIF p_marker = 2 THEN
        DELETE FROM vin_state WHERE vin = p_vin;
    END IF;
    FOR i IN 1 .. coalesce(cardinality(p_end_request_ids), 0) LOOP
        v_done := v_done || sdv_end_row(p_vin, p_end_request_ids[i], p_end_sha1s[i], p_now, p_end_codes[i],
                                        p_end_attempts[i], p_end_responses[i]);
    END LOOP;
    RETURN v_done;
END $$;
