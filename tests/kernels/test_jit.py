"""CompileWatch: it sees Numba compile, and sees nothing when the on-disk cache is warm."""

import json
import os
import subprocess
import sys
import textwrap

from numba import njit

from minidl.kernels.jit import CompileWatch


def test_watch_reports_a_compilation_once_and_nothing_when_compiled():
    @njit
    def inner(x):
        return x * 2

    @njit
    def outer(x):
        return inner(x) + 1

    calls = []
    with CompileWatch(on_first_compile=lambda: calls.append(1)) as watch:
        assert outer(3) == 7
    assert watch.compiled and calls == [1]
    assert watch.functions == 1  # outer compiles inner inside its own compilation
    assert watch.seconds > 0
    assert list(watch.by_function) == [f"{__name__}.{outer.py_func.__qualname__}"]
    assert watch.by_function[f"{__name__}.{outer.py_func.__qualname__}"] == watch.seconds

    with CompileWatch(on_first_compile=lambda: calls.append(2)) as again:
        assert outer(4) == 9
    assert not again.compiled and again.seconds == 0 and calls == [1]


def test_watch_sees_no_compilation_when_the_disk_cache_has_the_kernel(tmp_path):
    (tmp_path / "cached_kernel.py").write_text(textwrap.dedent("""
        from numba import njit

        @njit(cache=True)
        def axpy(a, x, y):
            return a * x + y
    """))
    script = textwrap.dedent("""
        import json
        from minidl.kernels.jit import CompileWatch
        from cached_kernel import axpy
        with CompileWatch() as watch:
            axpy(2.0, 3.0, 1.0)
        print(json.dumps([watch.compiled, watch.functions]))
    """)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    runs = [json.loads(subprocess.run([sys.executable, "-c", script], env=env, check=True,
                                      capture_output=True, text=True).stdout)
            for _ in range(2)]
    assert runs == [[True, 1], [False, 0]]
