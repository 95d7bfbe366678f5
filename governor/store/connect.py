"""Connections to the state database: the DSN from an environment variable, bounded
connect and keepalive times (a dead peer is noticed in seconds), and a retry backoff."""

from __future__ import annotations

import os

import psycopg

from governor.secrets import StartupRefused

# Sessions notice a vanished server or network within seconds instead of TCP's minutes.
CONNECT_OPTIONS = {"connect_timeout": 3, "keepalives": 1, "keepalives_idle": 5,
                   "keepalives_interval": 2, "keepalives_count": 2, "tcp_user_timeout": 5000}
# Errors after which the outcome is retried on a new connection.
TRANSIENT = (psycopg.OperationalError, psycopg.InterfaceError)


def first_line(exc: BaseException) -> str:
    """libpq's messages run over several lines; logs and answers get the first."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def dsn_from_env(name: str) -> str:
    dsn = os.environ.get(name, "").strip()
    if not dsn:
        raise StartupRefused(f"[state] backend = \"postgres\" needs the DSN in ${name}; "
                             f"it is not set")
    return dsn


def connect(dsn: str, autocommit: bool = False) -> psycopg.Connection:
    return psycopg.connect(dsn, autocommit=autocommit, application_name="fak-governor",
                           **CONNECT_OPTIONS)  # type: ignore[arg-type]


class Backoff:
    """Retry delays: `first` doubling up to `most` seconds; `reset` after a success."""

    def __init__(self, first: float = 0.05, most: float = 1.0) -> None:
        self.first, self.most = first, most
        self.delay = first

    def next(self) -> float:
        delay = self.delay
        self.delay = min(self.most, self.delay * 2)
        return delay

    def reset(self) -> None:
        self.delay = self.first
