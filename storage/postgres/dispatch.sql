-- Schema version 3: dispatch over PostgreSQL. The per-vehicle state that a worker keeps in memory
-- on LMDB (exhook_server/dispatch/worker.py: presence, the delivery in flight, a voided one) lives
-- here, so that any instance can handle any hook of any vehicle; the vehicle's advisory lock
-- (taken by sdv_vin_load) makes each event's read-decide-write atomic across instances.

-- Who is online, and on which connection (an encoded exhook_server.dispatch.commands.Session).
-- UNLOGGED: written on every subscribe and disconnect, never worth a WAL flush; it is empty after a
-- crash or failover and fills again from the next subscribe or heartbeat of each vehicle.
CREATE UNLOGGED TABLE presence (
    vin      text COLLATE "C" PRIMARY KEY,
    session  text COLLATE "C" NOT NULL,
    seen_ms  bigint NOT NULL
);

-- The delivery out (or voided: published, not acked, its connection gone; sent again as a re-send).
ALTER TABLE vin_state
    ADD COLUMN await_response boolean NOT NULL DEFAULT false,  -- the answer, not the PUBACK, ends it
    ADD COLUMN acked_ms       bigint,                          -- PUBACK of an awaited delivery
    ADD COLUMN cancelled      boolean NOT NULL DEFAULT false,  -- its row was cancelled while out
    ADD COLUMN voided         boolean NOT NULL DEFAULT false,
    ADD COLUMN sender         text COLLATE "C";                -- the instance whose MQTT client sent it
CREATE INDEX vin_state_sender ON vin_state (sender) WHERE request_id IS NOT NULL;
CREATE INDEX vin_state_acked ON vin_state (acked_ms) WHERE acked_ms IS NOT NULL;

-- One round trip per vehicle event: take the vehicle's lock (held to the end of the transaction),
-- then read its presence, its state and its first deliverable rows with their payloads (also when
-- it is offline: the event may be the one that brings it online). In a plpgsql function each
-- statement takes a new snapshot, so the reads after the lock see everything committed before it
-- was granted.
CREATE FUNCTION sdv_vin_load(p_vin text, p_now bigint, p_rows integer)
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
