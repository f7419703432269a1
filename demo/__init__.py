"""`make demo`: the whole product on one machine, end to end (see demo/README.md)."""
