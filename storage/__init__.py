"""Storage of sdv-fanout: the two stores behind one port.

`model` (the values both stores share), `errors` (the one tree of storage errors), `port` (what
the server asks of a store) and `export_format` import neither `lmdb` nor `asyncpg`. The LMDB
store is the other modules of this package; the PostgreSQL store is `storage.pg`.
"""
