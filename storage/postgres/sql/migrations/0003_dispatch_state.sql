-- Version 3: dispatch over PostgreSQL. The per-vehicle state that a worker keeps in memory on LMDB
-- (exhook_server/dispatch/worker.py: presence, the delivery in flight, a voided one) lives here, so
-- that any instance can handle any hook of any vehicle. Its function, sdv_vin_load, is in
-- ../functions/dispatch.sql.

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
