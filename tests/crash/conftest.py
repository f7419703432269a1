"""Fixtures of the kill -9 tests: the store a `sdv-fanout serve` subprocess runs on."""

from __future__ import annotations

import itertools
import os

import pytest

#: One database per test (tests of a file may share a worker process, hence the session's cluster).
_databases = itertools.count()


@pytest.fixture(params=["lmdb", "postgresql"])
def store_env(request: pytest.FixtureRequest) -> dict[str, str]:
    """The environment that puts a subprocess server on each store in turn: none for LMDB (its
    data dir), SDV_FANOUT_STORE_URL of a fresh database for PostgreSQL."""
    if request.param == "lmdb":
        return {}
    cluster = request.getfixturevalue("pg_cluster")
    name = f"{request.module.__name__.rsplit('.', 1)[-1]}_{os.getpid()}_{next(_databases)}"
    return {"SDV_FANOUT_STORE_URL": cluster.new_database(name)}
