-- Version 10: vehicle events pass over the rows of requests their campaign policy holds:
-- sdv_vin_load_many takes the held request ids (../functions/vehicle_batches.sql). The
-- three-argument form goes first (a call with three arguments would otherwise name two functions).
-- No table changed.
DROP FUNCTION IF EXISTS sdv_vin_load_many(text[], bigint, integer);
