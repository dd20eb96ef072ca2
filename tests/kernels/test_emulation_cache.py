"""Emulated kernels come from Numba's disk cache in a later process, and compile again once a
file their code comes from has changed (here: a device function's own module)."""

import json
import os
import subprocess
import sys
import textwrap

KERNELS = textwrap.dedent("""
    from emu_device import _times

    from minidl.kernels import _cuda

    cuda = times = None  # set in the emulation, as in a kernel module


    def _k_scale(x, out):
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            out[i] = times(x[i])


    K = _cuda.bind(globals(), ["_k_scale"], device={"times": "_times"})
""")

SCRIPT = textwrap.dedent("""
    import json
    import numpy as np
    from emulated_arrays import D, H
    from emu_kernels import K
    from minidl.kernels import _cuda
    from minidl.kernels.jit import CompileWatch

    out = D(np.zeros(4))
    with CompileWatch() as watch:
        _cuda.launch(K.k_scale, 4, D(np.arange(4.0)), out)
    print(json.dumps([watch.compiled, H(out).tolist()]))
""")


def test_an_emulated_kernel_is_cached_until_a_device_function_changes(tmp_path):
    (tmp_path / "emu_kernels.py").write_text(KERNELS)
    device = tmp_path / "emu_device.py"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=os.pathsep.join(
        [str(tmp_path), os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))

    def run():
        r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0 and not r.stderr, r.stdout + r.stderr
        return json.loads(r.stdout)

    device.write_text("def _times(v):\n    return 2 * v\n")
    assert run() == [True, [0.0, 2.0, 4.0, 6.0]]
    assert run() == [False, [0.0, 2.0, 4.0, 6.0]]  # from the disk cache
    device.write_text("def _times(v):\n    return 3.0 * v\n")  # another size and time
    assert run() == [True, [0.0, 3.0, 6.0, 9.0]]
    assert run() == [False, [0.0, 3.0, 6.0, 9.0]]
