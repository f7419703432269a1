"""Dispatch over LMDB: vehicle state in the memory of the worker that owns it, events forwarded
between the processes of one host."""
