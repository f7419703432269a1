-- Version 13: campaign pacing (exhook_server/dispatch/pacing.py, storage/postgres/pacing.py).

-- A paced request's fleet-wide token bucket: every instance leases its tokens from this row
-- (sdv_pacing_lease, ../functions/pacing.sql). Tokens accrue from stamp_ms at the rate the
-- lease gives, up to its burst.
CREATE TABLE pacing_buckets (
    request_id  text COLLATE "C" PRIMARY KEY,
    tokens      double precision NOT NULL,
    stamp_ms    bigint NOT NULL
);

-- max_in_flight counts a request's deliveries out (sdv_pacing_out).
CREATE INDEX vin_state_out ON vin_state (request_id) WHERE request_id IS NOT NULL AND NOT voided;
