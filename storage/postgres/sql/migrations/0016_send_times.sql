-- Version 16: when a delivery was first sent. `vin_state.first_sent_ms` keeps the first publish of
-- the pair out (over its re-sends), and sdv_vin_save gives it to the outcome record of that pair
-- when it ends (`outcomes.sent_ms`; NULL: never sent, or ended before this version). sdv_end_row
-- takes it as a new last argument: its old form goes first.
ALTER TABLE vin_state ADD COLUMN first_sent_ms bigint;
ALTER TABLE outcomes ADD COLUMN sent_ms bigint;
DROP FUNCTION IF EXISTS sdv_end_row(text, text, bytea, bigint, smallint, integer, bytea);
