-- Version 2: `vin_state`, the delivery out per vehicle (at most one in flight per vehicle across
-- every server instance); version 3 adds the rest of a vehicle's dispatch state to it.
CREATE TABLE vin_state (
    vin         text COLLATE "C" PRIMARY KEY,
    request_id  text COLLATE "C",          -- the delivery out; NULL: nothing in flight
    sha1        bytea,
    session     text COLLATE "C",           -- the connection it went to
    sent_ms     bigint,
    attempts    integer NOT NULL DEFAULT 0  -- publishes of (request_id, sha1) so far
);
-- The in-flight sweep walks deliveries oldest first (only those out).
CREATE INDEX vin_state_sent ON vin_state (sent_ms) WHERE request_id IS NOT NULL;
