"""Store tests run on both ledger engines: ``new_ledger()`` gives a fresh, empty ledger of the test's engine (a
SQLite file's path, or the URL of a new database of the session's real PostgreSQL), ``ledger`` one of them."""

from __future__ import annotations

import itertools

import pytest

ENGINES = ["sqlite", "postgresql"]


@pytest.fixture(params=ENGINES)
def engine(request) -> str:
    return request.param


@pytest.fixture
def new_ledger(engine, tmp_path, request):
    names = itertools.count()

    def make():
        if engine == "sqlite":
            return tmp_path / f"ledger{next(names)}.sqlite"
        return request.getfixturevalue("postgres_server").new_database()

    return make


@pytest.fixture
def ledger(new_ledger):
    return new_ledger()

