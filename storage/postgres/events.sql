-- Schema version 7: a vehicle event saves what it decided in one statement.
--
-- storage/postgres/batches.py's end_row_in sent three statements per ended pair inside a vehicle event
-- (the delete of its row, the outcome record or the amendment of a cancelled one, the appended
-- count changes): three of the seven round trips of an ack. sdv_end_row does the same in one, with
-- the same rules as storage.lmdb.batches.delete_row_if (LMDB) and the same lock order (the row, then its
-- outcome record; gen_deltas is appended to, never locked).

-- End the pending pair (p_vin, p_request_id, p_sha1) with outcome p_code (a slot of
-- storage.lmdb.keys.COUNT_NAMES, storage.lmdb.outcomes.Outcome), recorded at p_now (0: when its row was
-- stored); or, when a cancel took its row while the delivery was out, give that `cancelled`
-- record this outcome instead. True when either happened.
CREATE OR REPLACE FUNCTION sdv_end_row(
    p_vin text, p_request_id text, p_sha1 bytea, p_now bigint, p_code smallint, p_attempts integer,
    p_response bytea)
RETURNS boolean LANGUAGE plpgsql SET jit = off AS $$
DECLARE
    c_pending CONSTANT smallint := 1;
    c_cancelled CONSTANT smallint := 4;
    v_stored bigint;
    v_when bigint := p_now;
    v_from smallint := c_pending;
    v_change bigint[] := '{0,0,0,0,0,0,0,0}';
BEGIN
    DELETE FROM rows WHERE vin = p_vin AND request_id = p_request_id AND sha1 = p_sha1 RETURNING ts_ms INTO v_stored;
    IF FOUND THEN
        IF p_now = 0 THEN
            v_when := v_stored;
        END IF;
        -- DO UPDATE, as LMDB's outcomes.end: a stale record of the pair (none is expected) is replaced.
        INSERT INTO outcomes (vin, request_id, sha1, ended_ms, stored_ms, attempts, code, response)
        VALUES (p_vin, p_request_id, p_sha1, v_when, v_stored, p_attempts, p_code, p_response)
        ON CONFLICT (vin, request_id, sha1) DO UPDATE SET ended_ms = EXCLUDED.ended_ms,
            stored_ms = EXCLUDED.stored_ms, attempts = EXCLUDED.attempts, code = EXCLUDED.code,
            response = EXCLUDED.response;
    ELSE
        IF p_code = c_cancelled THEN
            RETURN false;
        END IF;
        UPDATE outcomes SET ended_ms = p_now, attempts = greatest(attempts, p_attempts), code = p_code,
            response = p_response
            WHERE vin = p_vin AND request_id = p_request_id AND sha1 = p_sha1 AND code = c_cancelled;
        IF NOT FOUND THEN
            RETURN false;
        END IF;
        v_from := c_cancelled;
    END IF;
    -- Appended, not applied: the acks of one campaign must not queue on its generation row.
    v_change[v_from + 1] := v_change[v_from + 1] - 1;
    v_change[p_code + 1] := v_change[p_code + 1] + 1;
    INSERT INTO gen_deltas (request_id, sha1, last_ms, total, pending, delivered, superseded, cancelled,
                            expired, failed, responded)
    VALUES (p_request_id, p_sha1, v_when, v_change[1], v_change[2], v_change[3], v_change[4], v_change[5],
            v_change[6], v_change[7], v_change[8]);
    RETURN true;
END $$;

-- What a vehicle event decided, after the Worker rules ran on what sdv_vin_load read (the
-- caller's transaction holds the vehicle's lock): its presence (p_presence 0 unchanged, 1 online
-- with p_session, 2 offline), its delivery marker (p_marker 0 unchanged, 1 the given fields,
-- 2 none; p_sender NULL keeps the recorded sender) and the pairs it ended (sdv_end_row each, in
-- the order given), in one statement and that order (presence, vin_state, rows): what
-- storage/postgres/dispatch.py's save_presence, save_marker and end_row_in did in one round trip each.
-- Returns, per ended pair, whether it ended.
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
