"""The compressed model file: round trip, atomic writes, and one clear error for every way a
file can be broken."""

from __future__ import annotations

import os

import numpy as np
import pytest

from minidl.compression import container
from minidl.compression.container import CompressedModel, CompressedModelError
from minidl.kernels.compression import weight_record


def _model() -> CompressedModel:
    codes = np.array([[0, 1, 0, 2], [3, 0, 0, 1]])
    return CompressedModel(
        {"name": "smallcnn", "input_shape": [1, 8, 8], "num_classes": 10, "width": 4},
        {"a.weight": weight_record.shared_record(codes, [0.5, -1.0, 2.0], 2, 2),
         "a.bias": weight_record.raw_record(np.arange(3, dtype=np.float32))},
        {"mean": [0.1], "std": [0.3]})


def test_round_trip_and_atomic_write(tmp_path):
    cm = _model()
    path = tmp_path / "m.mdc"
    size = container.write(cm, path)
    assert size == os.path.getsize(path) and os.listdir(tmp_path) == ["m.mdc"]
    back = container.read(path)
    assert back.model == cm.model and back.preprocess == cm.preprocess
    assert back.records == cm.records
    path.write_bytes(b"keep me")
    with pytest.raises(TypeError):  # a failure while writing leaves the old file and no temp
        container.write(CompressedModel({"x": object()}, {}), path)
    assert path.read_bytes() == b"keep me" and os.listdir(tmp_path) == ["m.mdc"]


def test_every_truncation_and_every_flipped_byte_fail_clearly():
    data = container.to_bytes(_model())
    for n in range(len(data)):
        with pytest.raises(CompressedModelError) as e:
            container.from_bytes(data[:n], "f")
        assert "\n" not in str(e.value)
        assert ("truncated" in str(e.value)) or n < 8
    for i in range(len(data)):
        bad = bytearray(data)
        bad[i] ^= 0x20
        with pytest.raises(CompressedModelError) as e:
            container.from_bytes(bytes(bad), "f")
        assert any(w in str(e.value) for w in ("corrupted", "truncated", "not a minidl",
                                               "version", "after its end"))


def test_wrong_files_say_what_they_are(tmp_path):
    with pytest.raises(CompressedModelError, match="not a minidl compressed model"):
        container.from_bytes(b"PK\x03\x04 a zip file", "x.npz")
    with pytest.raises(CompressedModelError, match="no such file"):
        container.read(tmp_path / "missing.mdc")
    data = bytearray(container.to_bytes(_model()))
    data[8] = 9  # a later format version
    with pytest.raises(CompressedModelError, match="format version 9; this minidl reads version 1"):
        container.from_bytes(bytes(data), "f")
    with pytest.raises(CompressedModelError, match="bytes after its end"):
        container.from_bytes(container.to_bytes(_model()) + b"\0", "f")
