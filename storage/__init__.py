"""Storage of sdv-fanout: two stores behind one port.

`model` (the values both stores share), `errors` (the one tree of storage errors), `port` (what
the server asks of a store), `export_format` and `plan` import neither `lmdb` nor `asyncpg`.
`storage.lmdb` is the embedded store, `storage.postgres` the shared one; both have the same
module names for the same jobs (batches, queue, outcomes, gc, export, plan, reads, writes).
"""
