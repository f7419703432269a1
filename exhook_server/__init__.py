"""sdv-fanout: an EMQX ExHook server that stores SDV fan-out batches in LMDB and delivers them."""

__version__ = "0.1.0"
