"""LMDB storage of sdv-fanout: content-addressed blobs, per-vehicle rows, group commit.

The only package that imports `lmdb`.
"""
