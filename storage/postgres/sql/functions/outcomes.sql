-- A pending pair's end (storage.postgres.batches.delete_row_if, and each pair sdv_vin_save ends):
-- the same rules as storage.lmdb.batches.delete_row_if and the same lock order (the row, then its
-- outcome record; gen_deltas and answer_failures are appended to, never locked).

-- Whether an answer is a JSON object whose "status" is "failed" or "rejected"; one that does not
-- parse (cut at max_response_bytes, not UTF-8, not JSON) is not. Twin: storage.model.answer_failed.
CREATE OR REPLACE FUNCTION sdv_answer_failed(p_response bytea)
RETURNS boolean LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    v_doc jsonb;
BEGIN
    IF p_response IS NULL OR length(p_response) = 0 THEN
        RETURN false;
    END IF;
    v_doc := convert_from(p_response, 'UTF8')::jsonb;
    RETURN jsonb_typeof(v_doc -> 'status') = 'string' AND v_doc ->> 'status' IN ('failed', 'rejected');
EXCEPTION WHEN others THEN
    RETURN false;
END $$;

-- End the pending pair (p_vin, p_request_id, p_sha1) with outcome p_code (a slot of
-- storage.model.COUNT_NAMES, storage.model.Outcome), recorded at p_now (0: when its row was
-- stored), its row first published at p_sent_ms (NULL: never, or not known); or, when a cancel
-- took its row while the delivery was out, give that `cancelled` record this outcome instead.
-- True when either happened.
CREATE OR REPLACE FUNCTION sdv_end_row(
    p_vin text, p_request_id text, p_sha1 bytea, p_now bigint, p_code smallint, p_attempts integer,
    p_response bytea, p_sent_ms bigint DEFAULT NULL)
RETURNS boolean LANGUAGE plpgsql SET jit = off AS $$
DECLARE
    c_pending CONSTANT smallint := sdv_count_slot('pending');
    c_cancelled CONSTANT smallint := sdv_count_slot('cancelled');
    c_responded CONSTANT smallint := sdv_count_slot('responded');
    v_stored bigint;
    v_when bigint := p_now;
    v_from smallint := c_pending;
    v_change bigint[] := '{0,0,0,0,0,0,0,0}';  -- per count slot, the columns of gen_deltas
BEGIN
    DELETE FROM rows WHERE vin = p_vin AND request_id = p_request_id AND sha1 = p_sha1 RETURNING ts_ms INTO v_stored;
    IF FOUND THEN
        IF p_now = 0 THEN
            v_when := v_stored;
        END IF;
        -- DO UPDATE, as LMDB's outcomes.end: a stale record of the pair (none is expected) is replaced.
        INSERT INTO outcomes (vin, request_id, sha1, ended_ms, stored_ms, attempts, code, response, sent_ms)
        VALUES (p_vin, p_request_id, p_sha1, v_when, v_stored, p_attempts, p_code, p_response, p_sent_ms)
        ON CONFLICT (vin, request_id, sha1) DO UPDATE SET ended_ms = EXCLUDED.ended_ms,
            stored_ms = EXCLUDED.stored_ms, attempts = EXCLUDED.attempts, code = EXCLUDED.code,
            response = EXCLUDED.response, sent_ms = EXCLUDED.sent_ms;
    ELSE
        IF p_code = c_cancelled THEN
            RETURN false;
        END IF;
        UPDATE outcomes SET ended_ms = p_now, attempts = greatest(attempts, p_attempts), code = p_code,
            response = p_response, sent_ms = coalesce(sent_ms, p_sent_ms)
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
    IF p_code = c_responded AND sdv_answer_failed(p_response) THEN
        INSERT INTO answer_failures (request_id, ended_ms) VALUES (p_request_id, v_when);
    END IF;
    RETURN true;
END $$;
