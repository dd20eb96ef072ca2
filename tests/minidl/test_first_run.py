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
    trainer.fit((x, np.arange(12) % 3), epochs=1, batch_size=4, progress=True)
""")


def test_fit_says_compiling_only_when_kernels_compile(tmp_path):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba-cache"))
    first, second = (subprocess.run([sys.executable, "-c", SCRIPT], env=env, check=True,
                                    capture_output=True, text=True).stderr for _ in range(2))
    assert "compiling kernels (first run only)..." in first
    assert "kernels compiled in" in first
    assert "compiling kernels" not in second and "kernels compiled" not in second
