"""pytest plugin of benchmarks/gpu/check.sh: a time limit per test (SIGALRM), so that one test
stuck in a slow path cannot eat the check's budget. A test stuck inside a CUDA call is only
interrupted when the call returns; the check's outer ``timeout`` and pytest's
``faulthandler_timeout`` (tracebacks of every thread) cover that case."""

from __future__ import annotations

import os
import signal
import threading

import pytest

LIMIT = int(os.environ.get("GPUCHECK_TEST_TIMEOUT", "120"))


class TestTimeLimit(Exception):
    """A test ran past the check's per-test limit."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    use = LIMIT > 0 and hasattr(signal, "SIGALRM") and \
        threading.current_thread() is threading.main_thread()
    if use:
        def on_alarm(signum, frame):
            raise TestTimeLimit(f"{item.nodeid} ran over {LIMIT} s (the check's per-test limit)")

        old = signal.signal(signal.SIGALRM, on_alarm)
        signal.alarm(LIMIT)
    try:
        yield
    finally:
        if use:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
