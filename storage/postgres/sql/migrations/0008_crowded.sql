-- Version 8: the backlog bound counts a sample of the vehicles below half of it (sdv_over_bound in
-- ../functions/bound.sql); `crowded` lists the vehicles it counts on every new row.

-- Vehicles whose backlog was last counted at half of max_pending_per_vehicle or more.
CREATE TABLE crowded (
    vin text COLLATE "C" PRIMARY KEY
);
-- The backlogs stored before this version were never counted into `crowded`: every vehicle with 32
-- rows or more (half of the smallest sampled bound, 65) is listed now, so one already at its bound
-- is refused from its next row on and counted by the gauge. A listed vehicle under a quarter of
-- the bound in force leaves the list with its next row. One pass over the rows, here only.
INSERT INTO crowded (vin) SELECT vin FROM rows GROUP BY vin HAVING count(*) >= 32;
