-- Version 11: a vehicle's high-priority rows go before its normal ones. A row its batch asked
-- for high priority carries flag 2 (storage.model.FLAG_HIGH_PRIORITY); the partial index finds a
-- vehicle's such rows oldest first without walking its whole queue. sdv_vin_load_many takes the
-- request ids whose policy says high (../functions/vehicle_batches.sql): the four-argument form
-- goes first (a call with four arguments would otherwise name two functions).
CREATE INDEX rows_high ON rows (vin, ts_ms, request_id) WHERE (flags & 2) <> 0;
DROP FUNCTION IF EXISTS sdv_vin_load_many(text[], bigint, integer, text[]);
