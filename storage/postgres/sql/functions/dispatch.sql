-- A vehicle's state under its advisory lock: sdv_vin_load reads it in one round trip, and
-- sdv_vin_save writes what the Worker rules (exhook_server/dispatch/worker.py) decided in one
-- statement (called per vehicle by sdv_vin_save_many, vehicle_batches.sql). Called by
-- storage/postgres/dispatch.py.

-- One vehicle's state under its lock, held to the end of the caller's transaction (the Admin
-- API's read; vehicle events read in batches, vehicle_batches.sql): its presence, its delivery
-- and its first deliverable rows with their payloads, read by sdv_vin_load_many after the lock
-- (each statement of a plpgsql function takes a new snapshot, so it sees everything committed
-- before the lock was granted).
CREATE OR REPLACE FUNCTION sdv_vin_load(p_vin text, p_now bigint, p_rows integer)
RETURNS TABLE (
    kind text, session text, request_id text, sha1 bytea, sent_ms bigint, attempts integer,
    await_response boolean, acked_ms bigint, cancelled boolean, voided boolean,
    ts_ms bigint, size integer, expires_ms bigint, flags smallint, data bytea
) LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(sdv_lock_class('vehicle'), hashtext(p_vin));
    RETURN QUERY SELECT l.kind, l.session, l.request_id, l.sha1, l.sent_ms, l.attempts, l.await_response,
        l.acked_ms, l.cancelled, l.voided, l.ts_ms, l.size, l.expires_ms, l.flags, l.data
        FROM sdv_vin_load_many(ARRAY[p_vin], p_now, p_rows, '{}'::text[], '{}'::text[]) l;
END
$$;

-- What a vehicle event decided, after the Worker rules ran on what sdv_vin_load_many read
-- (sdv_vin_save_many holds the vehicle's lock and checked its state is still so): its presence (p_presence 0 unchanged, 1 online
-- with p_session, 2 offline), its delivery marker (p_marker 0 unchanged, 1 the given fields,
-- 2 none; p_sender NULL keeps the recorded sender; first_sent_ms kept while the pair stays) and
-- the pairs it ended (sdv_end_row each, in the order given; the one that was out with its first
-- send time), in one statement and that order (presence, vin_state, rows). Returns, per ended
-- pair, whether it ended.
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
    v_out vin_state%ROWTYPE;
BEGIN
    IF cardinality(p_end_request_ids) > 0 THEN  -- the delivery out before this event changes it
        SELECT * INTO v_out FROM vin_state WHERE vin = p_vin;
    END IF;
    IF p_presence = 1 THEN
        INSERT INTO presence (vin, session, seen_ms) VALUES (p_vin, p_session, p_now)
            ON CONFLICT (vin) DO UPDATE SET session = excluded.session, seen_ms = excluded.seen_ms;
    ELSIF p_presence = 2 THEN
        DELETE FROM presence WHERE vin = p_vin;
    END IF;
    IF p_marker = 1 THEN
        INSERT INTO vin_state AS s (vin, request_id, sha1, session, sent_ms, attempts, await_response,
                                    acked_ms, cancelled, voided, sender, first_sent_ms)
        VALUES (p_vin, p_request_id, p_sha1, p_marker_session, p_sent_ms, p_attempts, p_await_response,
                p_acked_ms, p_cancelled, p_voided, p_sender, p_sent_ms)
        ON CONFLICT (vin) DO UPDATE SET request_id = excluded.request_id, sha1 = excluded.sha1,
            session = excluded.session, sent_ms = excluded.sent_ms, attempts = excluded.attempts,
            await_response = excluded.await_response, acked_ms = excluded.acked_ms,
            cancelled = excluded.cancelled, voided = excluded.voided,
            sender = coalesce(excluded.sender, s.sender),
            first_sent_ms = CASE WHEN s.request_id = excluded.request_id AND s.sha1 = excluded.sha1
                                 THEN coalesce(s.first_sent_ms, excluded.sent_ms) ELSE excluded.sent_ms END;
    ELSIF p_marker = 2 THEN
        DELETE FROM vin_state WHERE vin = p_vin;
    END IF;
    FOR i IN 1 .. coalesce(cardinality(p_end_request_ids), 0) LOOP
        v_done := v_done || sdv_end_row(p_vin, p_end_request_ids[i], p_end_sha1s[i], p_now, p_end_codes[i],
                                        p_end_attempts[i], p_end_responses[i],
                                        CASE WHEN v_out.request_id = p_end_request_ids[i] AND v_out.sha1 = p_end_sha1s[i]
                                             THEN v_out.first_sent_ms END);
    END LOOP;
    RETURN v_done;
END $$;
