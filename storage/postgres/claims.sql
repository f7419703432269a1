-- Schema version 2: at most one delivery in flight per vehicle across every server instance.
-- A claim sets a vehicle's marker from its oldest deliverable row only when none is set (or the
-- one set is older than the in-flight timeout); the instance that gets the row back publishes it.
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
