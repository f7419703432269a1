"""The PostgreSQL store (issue 14): the LMDB store's tables and write operations over asyncpg.

`migrate` creates or upgrades the schema (`schema.sql` is version 1); `ingest` holds the write
operations, one transaction each, with the results of their LMDB twins in `storage.ops` and
`storage.cancel`; `counts` keeps the generation counts and outcome records. Design notes and open
questions: docs/postgresql.md.
"""
