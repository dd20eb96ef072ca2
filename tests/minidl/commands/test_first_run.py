"""The first run says it compiles kernels; a run with the kernels in Numba's disk cache does not."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import numpy as np
    import minidl
    from minidl import layers as L

    net = minidl.Sequential([L.Flatten(), L.Linear(16, 3)], input_shape=(1, 4, 4))
    trainer = minidl.Trainer(net, device_memory="1MiB")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((12, 1, 4, 4)).astype(np.float32)
    trainer.fit((x, np.arange(12) % 3), epochs=1, batch_size=4, progress=PROGRESS)
""")


def _stderr(cache_dir, progress: bool) -> str:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir))
    script = SCRIPT.replace("PROGRESS", str(progress))
    return subprocess.run([sys.executable, "-c", script], env=env, check=True,
                          capture_output=True, text=True).stderr


def test_fit_says_compiling_only_when_kernels_compile(tmp_path):
    first, second = (_stderr(tmp_path / "numba-cache", True) for _ in range(2))
    assert "compiling kernels (first run only)..." in first
    assert "kernels compiled in" in first
    assert "compiling kernels" not in second and "kernels compiled" not in second


def test_fit_without_progress_compiles_silently(tmp_path):
    assert "compil" not in _stderr(tmp_path / "numba-cache", False)
