-- Version 9: campaign policies, one per request id (storage/postgres/policies.py).

-- A request's campaign policy: its JSON as exhook_server/policy.py validated it (the store does not
-- read it) and when it was set.
CREATE TABLE policies (
    request_id  text COLLATE "C" PRIMARY KEY,
    doc         bytea  NOT NULL,
    set_ms      bigint NOT NULL
);
