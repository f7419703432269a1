"""The PostgreSQL store: the LMDB store's tables and operations over asyncpg.

The only package that imports `asyncpg`. `connect` opens pools and connections, `migrate`
creates or upgrades the schema, `batches` holds the write operations (one transaction each, with
the results of `storage.lmdb.batches`), `outcomes` the generation counts and outcome records,
`reads`/`writes` implement the port of storage/port.py. Design notes: docs/postgresql.md.
"""
