"""The embedded LMDB store: one environment per host, written through a group committer.

The only package that imports `lmdb`. `store` opens the environment, `keys` knows every byte
layout, `batches`/`parked`/`queue`/`outcomes`/`cancel`/`gc` are the operations inside a write
transaction, `reads`/`writes` implement the port of storage/port.py.
"""
