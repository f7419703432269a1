-- Campaign pacing across instances (exhook_server/dispatch/pacing.py decides; these keep the
-- fleet-wide state). Called by storage/postgres/pacing.py.

-- Leases of many requests' tokens in one statement: per request id (the caller sorts them, the
-- rows' lock order) its bucket accrues p_rates[i] tokens per second (the caller's clock, epoch
-- ms) since its stamp, up to p_bursts[i], created with one token; up to p_wants[i] whole tokens
-- are taken. What each got, in order. The Python twin is exhook_server.dispatch.pacing.LocalBudget
-- (over exhook_server.dispatch.bucket.TokenBucket): a clock behind the stamp accrues nothing.
CREATE OR REPLACE FUNCTION sdv_pacing_lease(
    p_ids text[], p_rates double precision[], p_bursts double precision[], p_wants integer[], p_now bigint
) RETURNS integer[] LANGUAGE plpgsql AS $$
DECLARE
    v_tokens double precision;
    v_got integer;
    v_out integer[] := '{}';
BEGIN
    FOR i IN 1 .. coalesce(cardinality(p_ids), 0) LOOP
        INSERT INTO pacing_buckets AS b (request_id, tokens, stamp_ms)
        VALUES (p_ids[i], least(1.0, p_bursts[i]), p_now)
        ON CONFLICT (request_id) DO UPDATE SET
            tokens = least(p_bursts[i], b.tokens + greatest(0, p_now - b.stamp_ms) * p_rates[i] / 1000.0),
            stamp_ms = greatest(b.stamp_ms, p_now)
        RETURNING b.tokens INTO v_tokens;
        v_got := greatest(0, least(p_wants[i], floor(v_tokens + 1e-9)::integer));
        IF v_got > 0 THEN
            UPDATE pacing_buckets SET tokens = greatest(0.0, tokens - v_got) WHERE request_id = p_ids[i];
        END IF;
        v_out := v_out || v_got;
    END LOOP;
    RETURN v_out;
END $$;

-- The deliveries out (sent and not PUBACKed, or awaiting the answer; not voided) of each of
-- p_ids, under each request's PACING advisory lock, held to the end of the caller's transaction
-- (the caller sorts them: one lock order). A batch of vehicle events counts, decides and saves its
-- sends in that transaction, so concurrent batches on any instance see each other's sends and
-- never start more than max_in_flight together. The Python twin, in one process, is
-- exhook_server.dispatch.worker.InFlightTable.
CREATE OR REPLACE FUNCTION sdv_pacing_out(p_ids text[])
RETURNS TABLE (request_id text, n bigint) LANGUAGE plpgsql AS $$
DECLARE
    v_id text;
BEGIN
    FOREACH v_id IN ARRAY p_ids LOOP
        PERFORM pg_advisory_xact_lock(sdv_lock_class('pacing'), hashtext(v_id));
    END LOOP;
    RETURN QUERY
        SELECT i.id, (SELECT count(*) FROM vin_state s WHERE s.request_id = i.id AND NOT s.voided)
        FROM unnest(p_ids) AS i(id);
END $$;
