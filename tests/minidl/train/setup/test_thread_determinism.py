"""Training is bit-identical whatever the thread count (``MINIDL_NUM_THREADS``).

Each thread count runs in its own process: Numba's and BLAS's thread pools are per process.
The shapes are large enough that the conv kernels and the Linear products run in parallel and
that a multi-threaded BLAS would cut the recurrent products differently (on AMD EPYC that
changed the bits)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import hashlib
import numpy as np
import minidl
from minidl.zoo.models import get_model
from minidl.net.optim import SGD
from minidl.zoo.rnn import char_rnn
from minidl.zoo.transformers import TransformerConfig, gpt

def digest(net, x, y, memory):
    trainer = minidl.Trainer(net, SGD(net.parameters(), lr=0.01, momentum=0.9),
                             memory=memory, device_memory="1GiB")
    h = hashlib.sha256()
    for _ in range(2):
        h.update(np.float64(trainer.step(x, y)).tobytes())
    for _, p in net.named_parameters():
        h.update(np.ascontiguousarray(p.data).tobytes())
    return h.hexdigest()[:16]

rng = np.random.default_rng(0)
cnn_x = rng.standard_normal((16, 3, 32, 32)).astype(np.float32)
cnn_y = rng.integers(0, 10, 16)
tok_x = rng.integers(0, 65, (32, 64))
tok_y = rng.integers(0, 65, (32, 64))
print(digest(get_model("resnet8", (3, 32, 32), 10), cnn_x, cnn_y, "none"))
print(digest(get_model("vgg11_bn", (3, 32, 32), 10), cnn_x, cnn_y, "reuse,inplace"))
# Linear layers of 1024 rows: their products run in parallel bands (kernels.blas.gemm)
net = gpt(TransformerConfig(layers=1, heads=2, dim=128, context=64, vocab=65, dropout=0.1))
print(digest(net, tok_x[:16], tok_y[:16], "none"))
for cell in ("lstm", "gru"):
    net = char_rnn(vocab_size=65, embedding_dim=128, hidden_size=256, steps=64, cell=cell)
    print(digest(net, tok_x, tok_y, "none"))
    net = char_rnn(vocab_size=65, embedding_dim=128, hidden_size=256, steps=64, cell=cell)
    print(digest(net, tok_x, tok_y, "bptt=2"))
"""


def _digests(threads: int) -> list[str]:
    env = dict(os.environ, MINIDL_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


@pytest.mark.slow
def test_training_is_bit_identical_across_thread_counts():
    one = _digests(1)
    assert len(one) == 7
    assert _digests(3) == one  # more threads than these 2-core machines have
