"""``offload=optimizer``'s copy back in chunks (minidl/compile/chunked_upload.py): runs of
parameters back to back on the device go as one transfer of at most the chunk size, half
copies alone; training is bit-identical to the copy back one parameter at a time, on the plain
CPU device and through the emulated link's copy engine."""

from __future__ import annotations

import numpy as np
import pytest

import minidl
from minidl.compile.chunked_upload import UPLOAD_CHUNK_BYTES, ChunkedUpload
from minidl.net.optim import AdamW
from minidl.zoo.transformers import TransformerConfig, gpt

TINY = TransformerConfig(layers=2, heads=2, dim=32, context=8, vocab=11, dropout=0.0)


def _run(chunked: bool, precision: str = "fp32", emulate_link: str | None = None, steps=3):
    net = gpt(TINY, name="tiny-gpt")
    tr = minidl.Trainer(net, AdamW(net.parameters(), lr=1e-2), device_memory="32MiB",
                        memory="reuse,inplace,offload=optimizer", precision=precision,
                        emulate_link=emulate_link)
    if not chunked:
        tr.engine.host_state.chunks = None
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, TINY.vocab, (3, TINY.context)) for _ in range(2))
    losses = [tr.step(x, y) for _ in range(steps)]
    return tr, losses, {k: np.array(v) for k, v in net.state_dict().items()}


def test_chunks_cover_every_parameter_once_within_the_chunk_size():
    tr, _, _ = _run(True, steps=1)
    state = tr.engine.host_state
    up = state.chunks
    assert up.rest == [] and len(up.chunks) == 1  # (fp32: all back to back, 40 KiB)
    assert sum(n for _, _, n in up.chunks) == state.upload_bytes
    small = ChunkedUpload(state, {n: b.offset for n, b in tr.engine._blocks.items()},
                          chunk_bytes=4096)
    sizes = [n for _, _, n in small.chunks]
    assert sum(sizes) == state.upload_bytes and len(sizes) > 1
    alone = {size for _, size in state.offsets.values() if size > 4096}
    assert all(n <= 4096 or n in alone for n in sizes)
    assert UPLOAD_CHUNK_BYTES == 32 << 20
    with pytest.raises(ValueError, match="chunk_bytes must be >= 1, got 0"):
        ChunkedUpload(state, {}, chunk_bytes=0)


def test_half_copies_go_alone():
    tr, _, _ = _run(True, "bf16-mixed", steps=1)
    state = tr.engine.host_state
    assert {p.name for p in state.chunks.rest} == set(state.half_copies) != set()
    assert sum(n for _, _, n in state.chunks.chunks) == sum(
        size for name, (_, size) in state.offsets.items() if name not in state.half_copies)


@pytest.mark.parametrize("precision, link", [("fp32", None), ("bf16-mixed", None),
                                             ("fp32", "v100")])
def test_training_is_bit_identical_to_the_copy_back_per_parameter(precision, link):
    _, l1, s1 = _run(True, precision, link)
    _, l2, s2 = _run(False, precision, link)
    assert l1 == l2
    for k in s1:
        np.testing.assert_array_equal(s1[k], s2[k], err_msg=k)
