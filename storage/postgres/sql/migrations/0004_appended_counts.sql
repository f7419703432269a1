-- Version 4: count changes of ended deliveries appended, not applied in place.
-- Every PUBACK of a campaign ends a pair of the same generation. Updating that one `generations`
-- row in each ack's transaction holds its lock until the commit (WAL flush to the synchronous
-- standby included), so a campaign's acks would commit one after another, whatever the number
-- of instances. Instead an ack appends its change here (no lock on anything shared), the
-- `generation_counts` view adds the changes not folded yet, and `fold_deltas` (any instance,
-- periodically) moves them into `generations` in one transaction per chunk. Counts stay exact at
-- every moment for whoever reads the view.
CREATE TABLE gen_deltas (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    request_id  text COLLATE "C" NOT NULL,
    sha1        bytea  NOT NULL,
    last_ms     bigint NOT NULL,
    total       bigint NOT NULL DEFAULT 0,
    pending     bigint NOT NULL DEFAULT 0,
    delivered   bigint NOT NULL DEFAULT 0,
    superseded  bigint NOT NULL DEFAULT 0,
    cancelled   bigint NOT NULL DEFAULT 0,
    expired     bigint NOT NULL DEFAULT 0,
    failed      bigint NOT NULL DEFAULT 0,
    responded   bigint NOT NULL DEFAULT 0
);
CREATE INDEX gen_deltas_generation ON gen_deltas (request_id, sha1, id);

-- A generation as readers see it: its folded counts plus the changes appended since; last_ms is
-- its latest change's.
CREATE VIEW generation_counts AS
SELECT g.request_id, g.sha1, g.first_ms,
       greatest(g.last_ms, coalesce(d.last_ms, 0)) AS last_ms,
       greatest(0, g.total + coalesce(d.total, 0)) AS total,
       greatest(0, g.pending + coalesce(d.pending, 0)) AS pending,
       greatest(0, g.delivered + coalesce(d.delivered, 0)) AS delivered,
       greatest(0, g.superseded + coalesce(d.superseded, 0)) AS superseded,
       greatest(0, g.cancelled + coalesce(d.cancelled, 0)) AS cancelled,
       greatest(0, g.expired + coalesce(d.expired, 0)) AS expired,
       greatest(0, g.failed + coalesce(d.failed, 0)) AS failed,
       greatest(0, g.responded + coalesce(d.responded, 0)) AS responded
FROM generations g LEFT JOIN (
    SELECT request_id, sha1, max(last_ms) AS last_ms,
           sum(total) AS total, sum(pending) AS pending, sum(delivered) AS delivered,
           sum(superseded) AS superseded, sum(cancelled) AS cancelled, sum(expired) AS expired,
           sum(failed) AS failed, sum(responded) AS responded
    FROM gen_deltas GROUP BY request_id, sha1
) d ON d.request_id = g.request_id AND d.sha1 = g.sha1;
