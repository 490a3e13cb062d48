"""--hypothesis-db: directory and Redis databases; two runs sharing a failure through a real redis-server."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
import unittest

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase

from mla_verify.core.errors import UsageError
from mla_verify.draw.hypothesis_db import resolve_database

THRESHOLD = 1000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (Debian package redis-server; .ci/run installs it)")
    pytest.importorskip("redis", reason="the redis Python package is not installed (extra mla-verify[redis])")
    import redis

    port = _free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(workdir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.fail(f"redis-server did not start on port {port}")
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _run(database, phases) -> list[int]:
    """One 'run' of a property that fails for x >= THRESHOLD; returns the examples it tried, in order."""
    seen: list[int] = []

    @settings(database=database, phases=phases, max_examples=200, deadline=None)
    @given(st.integers(min_value=0, max_value=10**6))
    def prop(x: int) -> None:
        seen.append(x)
        assert x < THRESHOLD

    try:
        prop()
    except AssertionError:
        pass
    except unittest.SkipTest:  # Hypothesis's answer when the phases allowed left nothing to run
        assert seen == []
    return seen


def test_two_runs_share_a_failure_through_redis(redis_url):
    run1 = _run(resolve_database(f"{redis_url}/0"), phases=list(Phase))
    assert any(x >= THRESHOLD for x in run1), "run 1 should find the failure"
    # Run 2: a fresh database object on the same URL, and no generation at all: only the examples the
    # database hands back are tried, so the failure can only come from what run 1 saved.
    run2 = _run(resolve_database(f"{redis_url}/0"), phases=[Phase.reuse])
    assert run2[:1] == [THRESHOLD], f"run 2 should replay the shrunk failure first, tried {run2[:5]}"
    # Control: an empty database (another db number) replays nothing.
    assert _run(resolve_database(f"{redis_url}/1"), phases=[Phase.reuse]) == []


def test_directory_database(tmp_path):
    db = resolve_database(str(tmp_path / "db"))
    assert isinstance(db, DirectoryBasedExampleDatabase)
    _run(db, phases=list(Phase))
    assert _run(resolve_database(str(tmp_path / "db")), phases=[Phase.reuse])[:1] == [THRESHOLD]


def test_none_keeps_default():
    assert resolve_database(None) is None


@pytest.mark.parametrize("value", ["http://host:1/0", "redis://:notaport/0", "redis://host:1/zero",
                                   "redis:///0", "redis://host:1/0?x=1"])
def test_bad_urls_are_usage_errors(value):
    with pytest.raises(UsageError, match="--hypothesis-db"):
        resolve_database(value)


def test_unreachable_redis_is_a_usage_error():
    pytest.importorskip("redis", reason="the redis Python package is not installed (extra mla-verify[redis])")
    with pytest.raises(UsageError, match="cannot reach redis"):
        resolve_database(f"redis://127.0.0.1:{_free_port()}/0")


def test_file_is_not_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UsageError, match="not a directory"):
        resolve_database(str(f))
