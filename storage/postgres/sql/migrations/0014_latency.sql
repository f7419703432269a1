-- Version 14: the delivery latencies of each generation (stored -> PUBACK, PUBACK -> answer) as
-- counts in the log buckets of storage/latency.py, added to by every instance
-- (storage/postgres/latency.py) and dropped with their generation by GC.
CREATE TABLE gen_latency (
    request_id  text COLLATE "C" NOT NULL,
    sha1        bytea    NOT NULL,
    stage       smallint NOT NULL,
    bucket      smallint NOT NULL,
    n           bigint   NOT NULL,
    PRIMARY KEY (request_id, sha1, stage, bucket)
);
