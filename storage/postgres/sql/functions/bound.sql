-- The backlog bound (max_pending_per_vehicle) counts a sample of the vehicles below half of it.
--
-- Counting a vehicle's queue is an index descent and a heap visit per entry; done for every new
-- row it costs about a quarter of a batch's database CPU, to learn what is nearly always "far
-- below the bound". So a vehicle's queue is counted when the vehicle is listed in `crowded` (its
-- last count reached half the bound) and otherwise with probability 64 / max_pending per new
-- row. A vehicle that climbs from half the bound to the bound gets max_pending / 2 new rows on the
-- way, about 32 of them counted: the chance that none is, and that the vehicle passes the bound
-- unlisted, is below 1e-13 (and then each further row is counted with the same probability). A
-- listed vehicle is counted on every new row and refused exactly; its listing ends when a count
-- finds it below a quarter of the bound. A bound of 64 or less counts every vehicle on every new
-- row. Near the bound the decisive count runs under the vehicle's listing locked, so concurrent
-- batches cannot pass it together.

-- The VINs of p_vins (each just given a new row) now holding more than p_max_pending rows, in VIN
-- order; `crowded` updated with what the counts found. Called by sdv_put_rows, whose settings it
-- runs under (no bitmap scans: a count walks a few index entries per VIN, less than a bitmap
-- scan's setup; no JIT); settings of its own would cost more per call than the sampled counts.
CREATE OR REPLACE FUNCTION sdv_over_bound(p_vins text[], p_max_pending integer) RETURNS text[]
LANGUAGE plpgsql AS $$
DECLARE
    c_counted CONSTANT double precision := 64;  -- counts per max_pending new rows of a vehicle
    v_rate double precision := least(1.0, c_counted / p_max_pending);
    v_listed text[] := '{}';
    v_near text[];
    v_unlist text[];
    v text;
BEGIN
    IF EXISTS (SELECT 1 FROM crowded) THEN  -- usually empty: no lookup per VIN then
        SELECT coalesce(array_agg(c.vin), '{}') INTO v_listed FROM crowded c WHERE c.vin = ANY(p_vins);
    END IF;
    -- Counted up to the bound + 1: a huge backlog costs no more than one at the bound. random()
    -- is below 1: a bound of 64 or less counts every VIN.
    SELECT coalesce(array_agg(q.v ORDER BY q.v COLLATE "C") FILTER (WHERE q.n * 2 >= p_max_pending), '{}'),
           coalesce(array_agg(q.v) FILTER (WHERE q.listed AND q.n * 4 < p_max_pending), '{}')
        INTO v_near, v_unlist
        FROM (SELECT u.v, u.v = ANY(v_listed) AS listed,
                     (SELECT count(*) FROM (SELECT 1 FROM rows r WHERE r.vin = u.v LIMIT p_max_pending + 1) e) AS n
              FROM unnest(p_vins) AS u(v)
              WHERE u.v = ANY(v_listed) OR random() < v_rate) q;
    IF cardinality(v_unlist) > 0 THEN
        DELETE FROM crowded WHERE vin = ANY(v_unlist);
    END IF;
    IF cardinality(v_near) = 0 THEN
        RETURN '{}';
    END IF;
    -- Listed, and each listing locked, in VIN order. Two batches adding to one vehicle at the same
    -- time each see their own new row and the committed ones, not the other's: both could pass a
    -- bound one row short. Near the bound the second waits here (on the first one's insert or its
    -- lock) until the first commits, and the count that decides runs after, in a snapshot of its
    -- own (READ COMMITTED, the store's): it sees the first one's row. A row lock, not an advisory
    -- lock: a batch may lock 200 vehicles, and advisory locks fill the shared lock table.
    FOREACH v IN ARRAY v_near LOOP
        INSERT INTO crowded (vin) VALUES (v) ON CONFLICT DO NOTHING;
        PERFORM 1 FROM crowded c WHERE c.vin = v FOR UPDATE;
    END LOOP;
    RETURN ARRAY(SELECT u.v FROM unnest(v_near) AS u(v)
                 WHERE EXISTS (SELECT 1 FROM rows r WHERE r.vin = u.v OFFSET p_max_pending LIMIT 1)
                 ORDER BY u.v COLLATE "C");
END $$;

-- The vehicles holding p_bound pending rows or more, for the vehicles-at-bound gauge. With a bound
-- above 64 a vehicle gets there only through a count that listed it (at half the bound), so only
-- listed vehicles are counted: O(listed x bound), not a pass over every row. A bound of 64 or
-- less lists nobody: every vehicle's rows are counted.
CREATE OR REPLACE FUNCTION sdv_vehicles_at(p_bound integer) RETURNS bigint
LANGUAGE sql STABLE SET enable_bitmapscan = off AS $$
    SELECT CASE WHEN p_bound > 64 THEN
        (SELECT count(*) FROM crowded c
         WHERE EXISTS (SELECT 1 FROM rows r WHERE r.vin = c.vin OFFSET p_bound - 1 LIMIT 1))
    ELSE
        (SELECT count(*) FROM (SELECT 1 FROM rows GROUP BY vin HAVING count(*) >= p_bound) v)
    END
$$;
