-- Version 12: campaign aborts. A policy records the abort of its request (`aborted`, the criterion
-- and counts as JSON) and sdv_store_batch refuses the request's batches while it stands; a cancel
-- job keeps why it was started (`reason`: "aborted"); sdv_end_row appends a row to
-- `answer_failures` for each answer whose "status" is failed or rejected (sdv_answer_failed).
ALTER TABLE policies ADD COLUMN aborted bytea;
ALTER TABLE cancels ADD COLUMN reason text COLLATE "C";
CREATE TABLE answer_failures (
    request_id  text COLLATE "C" NOT NULL,
    ended_ms    bigint NOT NULL
);
CREATE INDEX answer_failures_request ON answer_failures (request_id);
