"""One real PostgreSQL for the run; each test gets a database of its own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .pg_server import PostgresServer, PostgresUnavailable, remove_postgres, start_postgres


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    try:
        server = start_postgres()
    except PostgresUnavailable as exc:
        pytest.fail(f"PostgreSQL unavailable: {exc}", pytrace=False)
    try:
        yield server
    finally:
        remove_postgres(server)


@pytest.fixture
def pg_dsn(postgres: PostgresServer) -> str:
    return postgres.create_database()
