"""``--hypothesis-db``: where Hypothesis keeps the failing examples it found, so later runs replay them first.

A directory is private to one machine; ``redis://host:port/db`` (Hypothesis's own RedisExampleDatabase)
lets many runners share what any of them found.
"""
from __future__ import annotations

import os
from urllib.parse import urlsplit

from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

from ..core.errors import UsageError

REDIS_CONNECT_TIMEOUT_S = 5.0  # a runner that cannot reach the shared database should say so quickly


def resolve_database(value: str | None) -> ExampleDatabase | None:
    """The database named by ``value``; None keeps Hypothesis's default. Raises UsageError (one line)."""
    if value is None:
        return None
    if "://" in value:
        return _redis_database(value)
    if os.path.exists(value) and not os.path.isdir(value):
        raise UsageError(f"--hypothesis-db: {value} exists and is not a directory")
    return DirectoryBasedExampleDatabase(value)


def _redis_database(url: str) -> ExampleDatabase:
    parts = urlsplit(url)
    if parts.scheme != "redis":
        raise UsageError(f"--hypothesis-db: {url!r} is neither a directory nor a redis://host:port/db URL")
    try:
        port = parts.port or 6379
    except ValueError:
        raise UsageError(f"--hypothesis-db: bad port in {url!r}") from None
    db_text = parts.path.strip("/") or "0"
    if not parts.hostname or not db_text.isdigit() or parts.query or parts.fragment:
        raise UsageError(f"--hypothesis-db: {url!r} is not of the form redis://host:port/db")
    try:
        import redis
        from hypothesis.extra.redis import RedisExampleDatabase
    except ImportError:
        raise UsageError("--hypothesis-db: a redis:// URL needs the redis package "
                         "(pip install 'mla-verify[redis]')") from None
    client = redis.Redis(host=parts.hostname, port=port, db=int(db_text), password=parts.password,
                         username=parts.username, socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S)
    try:
        client.ping()
    except redis.RedisError as e:
        raise UsageError(f"--hypothesis-db: cannot reach redis at {parts.hostname}:{port}: {e}") from None
    return RedisExampleDatabase(client)
