"""The router's connection budget from its open-files limit (router/http/connection_budget.py), and
uvicorn's refusal warning thinned to one line per interval."""

from __future__ import annotations

import logging

import pytest

from router.http.connection_budget import _RefusalLogFilter, connection_budget


@pytest.mark.parametrize(("limit", "unbounded", "expected"), [
    (20_000, False, 18_750),  # reserve 1/16: 1,250
    (20_000, True, 9_375),  # a cmd/remote upstream: two descriptors per client connection
    (1_024, False, 896),  # reserve at least 128
    (160, False, 32),
    (100, False, 1),  # never below one
])
def test_budget_from_the_limit(limit: int, unbounded: bool, expected: int) -> None:
    assert connection_budget(limit, unbounded_upstreams=unbounded) == expected


def test_refusal_warnings_are_thinned_with_a_count() -> None:
    f = _RefusalLogFilter()

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, msg, None, None)

    first = record("Exceeded concurrency limit.")
    assert f.filter(first) and first.getMessage().endswith("1 connection(s) answered 503 since the last line")
    assert not any(f.filter(record("Exceeded concurrency limit.")) for _ in range(50))
    assert f.filter(record("something else"))  # other lines pass untouched
