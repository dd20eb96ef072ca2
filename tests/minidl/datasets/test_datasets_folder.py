"""Data users have: a folder of images (class per sub-folder) and CIFAR-10 / CIFAR-100's python
batches, in memory or streamed by minidl.datasets.loaders (read batch by batch, the next prefetched
on a
thread): the same arrays and batches, bit for bit, and the same losses through ``minidl train``
and ``Trainer.fit``; one-line errors for a wrongly named or laid out dataset."""

from __future__ import annotations

import json
import pickle
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from minidl.cli import build_parser, main, validate_args
from minidl.commands.common import UsageError
from minidl.datasets import loaders
from minidl.datasets.data import DATASETS, batches, load_dataset
from minidl.datasets.image_sources import ImageReadError
from minidl.datasets.loaders import ImageArray, Loader, StreamedDataset

CLASSES = ("ant", "bee", "cat")


def _folder(root: Path, per_class: int = 6, seed: int = 0) -> dict[str, list[Path]]:
    """PNG images of assorted sizes and modes, one folder per class (+ files to skip)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    files: dict[str, list[Path]] = {}
    for k, cls in enumerate(CLASSES):
        d = root / cls
        d.mkdir(parents=True)
        files[cls] = []
        for i in range(per_class):
            h, w = 9 + (i + k) % 4, 11 + i % 3
            if i % 3 == 2:
                im = Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8), "L")
            else:
                im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")
            path = d / f"img{i:02d}.png"
            im.save(path)
            files[cls].append(path)
        (d / "notes.txt").write_text("not an image")
        (d / ".hidden.png").write_bytes(b"")
    return files


def _pil_image(path: Path, shape: tuple[int, int, int]) -> np.ndarray:
    """What the in-memory arrays must hold for one image: Pillow directly."""
    from PIL import Image

    c, h, w = shape
    with Image.open(path) as im:
        im = im.convert({1: "L", 3: "RGB"}[c]).resize((w, h), Image.Resampling.BILINEAR)
        a = np.asarray(im, dtype=np.uint8)
    a = a[None] if a.ndim == 2 else a.transpose(2, 0, 1)
    return a.astype(np.float32) / np.float32(255)


def _cifar(root: Path, which: str = "cifar10", n: int = 12, seed: int = 0) -> Path:
    """CIFAR's python batches in their exact layout, in root/cifar-10-batches-py (or
    root/cifar-100-python); returns that folder."""
    rng = np.random.default_rng(seed)
    ten = which == "cifar10"
    d = root / ("cifar-10-batches-py" if ten else "cifar-100-python")
    d.mkdir(parents=True)
    k = 10 if ten else 100

    def batch(name: str, label: str) -> dict:
        return {b"batch_label": label.encode(),
                b"labels" if ten else b"fine_labels": rng.integers(0, k, n).tolist(),
                **({} if ten else {b"coarse_labels": rng.integers(0, 20, n).tolist()}),
                b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                b"filenames": [f"{name}_{i}.png".encode() for i in range(n)]}

    files = ([(f"data_batch_{i}", f"training batch {i} of 5") for i in range(1, 6)]
             + [("test_batch", "testing batch 1 of 1")]) if ten else [
        ("train", "training batch 1 of 1"), ("test", "testing batch 1 of 1")]
    for name, label in files:
        with open(d / name, "wb") as f:
            pickle.dump(batch(name, label), f, protocol=2)
    meta = ({b"label_names": [f"c{i}".encode() for i in range(10)], b"num_cases_per_batch": n,
             b"num_vis": 3072} if ten else
            {b"fine_label_names": [f"f{i}".encode() for i in range(100)],
             b"coarse_label_names": [f"g{i}".encode() for i in range(20)]})
    with open(d / ("batches.meta" if ten else "meta"), "wb") as f:
        pickle.dump(meta, f, protocol=2)
    return d


def _unpickled(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f, encoding="bytes")


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ----------------------------------------------------------------------------- folders


def test_folder_classes_labels_and_images_as_pillow_reads_them(tmp_path):
    pytest.importorskip("PIL")
    files = _folder(tmp_path / "imgs")
    ds = load_dataset("folder", data_dir=tmp_path / "imgs", input_shape=(3, 8, 10),
                      test_fraction=0.5, seed=1)
    assert ds.classes == CLASSES and ds.num_classes == 3 and ds.input_shape == (3, 8, 10)
    assert (ds.n_train, ds.n_test) == (9, 9)  # per class: 3 held out of 6
    want = {p: (_pil_image(p, (3, 8, 10)), k) for k, cls in enumerate(CLASSES)
            for p in files[cls]}
    got = [(x, y) for split in ("train", "test")
           for x, y in zip(getattr(ds, f"x_{split}"), getattr(ds, f"y_{split}"))]
    for x, y in got:  # every image once, with its class's label
        match = [p for p, (img, label) in want.items() if _same(img, x) and label == y]
        assert len(match) == 1
        del want[match[0]]
    assert not want
    default = load_dataset("folder", data_dir=tmp_path / "imgs")  # the first image's size
    first = files["ant"][0]
    assert default.input_shape == (3, *_pil_image(first, (3, 9, 11)).shape[1:])
    assert (default.n_train, default.n_test) == (15, 3)  # 20 % held out
    grey = load_dataset("folder", data_dir=tmp_path / "imgs", input_shape=(1, 5, 5),
                        test_fraction=0)
    assert grey.x_train.shape == (18, 1, 5, 5) and grey.n_test == 0


def test_folder_train_test_layout(tmp_path):
    pytest.importorskip("PIL")
    _folder(tmp_path / "d" / "train")
    from PIL import Image

    (tmp_path / "d" / "test" / "bee").mkdir(parents=True)
    Image.new("RGB", (4, 4), (255, 0, 0)).save(tmp_path / "d" / "test" / "bee" / "x.jpg")
    ds = load_dataset("folder", data_dir=tmp_path / "d", input_shape=(3, 4, 4))
    assert ds.classes == CLASSES and (ds.n_train, ds.n_test) == (18, 1)
    assert ds.y_test.tolist() == [1]  # bee's label in train's classes
    (tmp_path / "d" / "test" / "wasp").mkdir()
    with pytest.raises(ValueError, match="'wasp' not among the 3 classes"):
        load_dataset("folder", data_dir=tmp_path / "d")


@pytest.mark.parametrize("kind", ["folder", "cifar10", "cifar100"])
def test_loader_batches_are_batches_of_the_in_memory_arrays(tmp_path, kind):
    if kind == "folder":
        pytest.importorskip("PIL")
        _folder(tmp_path / "data")
        kw = dict(input_shape=(3, 7, 6))
    else:
        _cifar(tmp_path / "data", kind)
        kw = {}
    mem = load_dataset(kind, data_dir=tmp_path / "data", **kw)
    lazy = load_dataset(kind, data_dir=tmp_path / "data", lazy=True, **kw)
    assert isinstance(lazy, StreamedDataset) and isinstance(lazy.x_train, ImageArray)
    assert _same(np.asarray(lazy.x_test), mem.x_test) and _same(lazy.y_train, mem.y_train)
    for bs, shuffle, drop_last, start, prefetch, workers in [
            (5, True, False, 0, 1, 1), (4, True, True, 2, 2, 2), (7, False, False, 1, 0, 1),
            (64, True, False, 0, 1, 3)]:
        for epoch in (0, 3):
            want = list(batches(mem.x_train, mem.y_train, bs, shuffle=shuffle, seed=5,
                                epoch=epoch, drop_last=drop_last))[start:]
            loader = Loader(lazy.x_train, lazy.y_train, bs, shuffle, seed=5, epoch=epoch,
                            drop_last=drop_last, start=start, prefetch=prefetch,
                            workers=workers)
            got = list(loader)
            assert len(got) == len(want) == len(loader)
            for (xa, ya), (xb, yb) in zip(want, got):
                assert _same(xa, xb) and _same(ya, yb) and xb.flags.c_contiguous
            # the loader over the in-memory arrays too
            for (xa, ya), (xb, yb) in zip(want, Loader(mem.x_train, mem.y_train, bs, shuffle,
                                                       seed=5, epoch=epoch,
                                                       drop_last=drop_last, start=start)):
                assert _same(xa, xb) and _same(ya, yb)


def test_loader_stops_its_thread_and_raises_read_errors_where_drawn(tmp_path):
    pytest.importorskip("PIL")
    files = _folder(tmp_path / "imgs")
    ds = load_dataset("folder", data_dir=tmp_path / "imgs", input_shape=(3, 6, 6), lazy=True)
    before = threading.active_count()
    it = iter(Loader(ds.x_train, ds.y_train, 2, seed=0))
    next(it)
    it.close()  # stopping early ends the reader
    assert threading.active_count() == before
    files["bee"][3].write_bytes(b"\x89PNG broken")
    drawn = 0
    with pytest.raises(ImageReadError, match=r"cannot read image .*bee.img03\.png"):
        for _ in Loader(ds.x_train, ds.y_train, 1, seed=0):
            drawn += 1
    assert 0 < drawn < ds.n_train  # the batches before the broken image came
    assert threading.active_count() == before


def test_progress_lines_while_indexing_and_reading(tmp_path, monkeypatch):
    pytest.importorskip("PIL")
    _folder(tmp_path / "imgs")
    monkeypatch.setattr(loaders, "PROGRESS_EVERY_S", 0.0)
    lines: list[str] = []
    load_dataset("folder", data_dir=tmp_path / "imgs", input_shape=(1, 4, 4),
                 progress=lines.append)
    assert any(line.startswith(f"indexing {tmp_path / 'imgs'}: ") for line in lines)
    assert any("images in 3 classes" in line for line in lines)
    assert any(line.startswith("reading ") and "of 15 images" in line for line in lines)
    quiet: list[str] = []
    monkeypatch.setattr(loaders, "PROGRESS_EVERY_S", 3600.0)
    load_dataset("folder", data_dir=tmp_path / "imgs", progress=quiet.append)
    assert quiet == []  # a load shorter than the interval says nothing


# ----------------------------------------------------------------------------- CIFAR


@pytest.mark.parametrize("which", ["cifar10", "cifar100"])
def test_cifar_batches_as_the_pickles_hold_them(tmp_path, which):
    d = _cifar(tmp_path, which)
    names = ([f"data_batch_{i}" for i in range(1, 6)], ["test_batch"]) if which == "cifar10" \
        else (["train"], ["test"])
    key = b"labels" if which == "cifar10" else b"fine_labels"
    for data_dir in (tmp_path, d):  # the folder holding cifar-*-python, or that folder
        ds = load_dataset(which, data_dir=data_dir)
        for split, files in zip(("train", "test"), names):
            raw = [_unpickled(d / f) for f in files]
            x = np.concatenate([r[b"data"] for r in raw]).reshape(-1, 3, 32, 32)
            assert _same(getattr(ds, f"x_{split}"), x.astype(np.float32) / np.float32(255))
            assert getattr(ds, f"y_{split}").tolist() == sum((r[key] for r in raw), [])
        assert ds.num_classes == (10 if which == "cifar10" else 100)
        assert ds.classes[:2] == (("c0", "c1") if which == "cifar10" else ("f0", "f1"))
    small = load_dataset(which, data_dir=tmp_path, input_shape=(1, 16, 16), n_train=7,
                         lazy=True)
    ref = load_dataset(which, data_dir=tmp_path, input_shape=(1, 16, 16), n_train=7)
    assert small.n_train == 7 and _same(np.asarray(small.x_train), ref.x_train)
    assert small.adaptation() == ref.adaptation() != ""


def test_cifar_pickles_of_other_protocols_and_no_code(tmp_path):
    d = _cifar(tmp_path)
    batch = _unpickled(d / "data_batch_2")
    with open(d / "data_batch_2", "wb") as f:
        pickle.dump(batch, f, protocol=pickle.HIGHEST_PROTOCOL)
    assert load_dataset("cifar10", data_dir=d).n_train == 60

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    with open(d / "test_batch", "wb") as f:
        pickle.dump({b"data": Evil()}, f, protocol=2)
    with pytest.raises(ImageReadError, match="test_batch: not a CIFAR python batch.*print"):
        load_dataset("cifar10", data_dir=d)


# ----------------------------------------------------------------------------- training


def _train(capsys, argv: list[str], loader: str) -> dict:
    """``minidl train ... --json`` with --loader (set on the parsed arguments)."""
    args = build_parser().parse_args(["train", *argv, "--json", "--quiet"])
    args.loader = loader
    validate_args(args)
    assert args.func(args) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("kind", ["folder", "cifar10"])
def test_train_streamed_gives_the_in_memory_losses(tmp_path, capsys, kind):
    if kind == "folder":
        pytest.importorskip("PIL")
        _folder(tmp_path / "data", per_class=8)
        extra = ["--input", "3x8x8"]
    else:
        _cifar(tmp_path / "data", n=6)
        extra = ["--input", "3x8x8"]  # (centre-cropped 32x32: small and fast)
    argv = ["smallcnn", "--dataset", kind, "--data-dir", str(tmp_path / "data"), "--epochs",
            "2", "--batch-size", "5", "--width", "4", *extra]
    mem = _train(capsys, argv, "memory")
    streamed = _train(capsys, argv, "stream")
    auto = _train(capsys, argv, "auto")
    assert mem["steps"] == streamed["steps"] > 4
    for res in (streamed, auto):
        assert res["losses"] == mem["losses"]  # bit for bit (JSON floats round-trip)
        assert res["test_loss"] == mem["test_loss"]
        assert res["test_accuracy"] == mem["test_accuracy"]


def test_fit_streamed_resumes_mid_epoch_bit_identically(tmp_path):
    from minidl import Trainer
    from minidl.net.optim import make_optimizer
    from minidl.zoo.models import get_model

    _cifar(tmp_path, n=4)

    def trainer():
        net = get_model("smallcnn", input_shape=(3, 8, 8), num_classes=10, width=4)
        return Trainer(net, make_optimizer("sgd", net.parameters(), 0.05, 0.0), seed=3)

    mem = load_dataset("cifar10", data_dir=tmp_path, input_shape=(3, 8, 8))
    lazy = load_dataset("cifar10", data_dir=tmp_path, input_shape=(3, 8, 8), lazy=True)
    whole = trainer().fit(mem, epochs=2, batch_size=6, progress=False)
    t = trainer()
    first = t.fit(lazy, epochs=2, batch_size=6, max_steps=6, progress=False, evaluate=False)
    t.save(tmp_path / "ck.npz")
    t2 = trainer()
    t2.load(tmp_path / "ck.npz", resume=True)
    rest = t2.fit(lazy, epochs=2, batch_size=6, progress=False)
    assert first.losses + rest.losses == whole.losses
    assert rest.test.loss == whole.test.loss


def test_evaluate_reads_a_streamed_test_split_batch_by_batch(tmp_path, monkeypatch):
    """Trainer.evaluate on a streamed split reads it a batch at a time (never the whole
    split at once) and gives the in-memory figures."""
    from minidl import Trainer
    from minidl.zoo.models import get_model

    _cifar(tmp_path, n=12)
    mem = load_dataset("cifar10", data_dir=tmp_path, input_shape=(3, 8, 8))
    lazy = load_dataset("cifar10", data_dir=tmp_path, input_shape=(3, 8, 8), lazy=True)
    net = get_model("smallcnn", input_shape=(3, 8, 8), num_classes=10, width=4)
    t = Trainer(net, device_memory="32MiB")
    want = t.evaluate(mem.x_test, mem.y_test, batch_size=4)

    def whole(*_a, **_k):
        raise AssertionError("the whole streamed split was read at once")

    monkeypatch.setattr(ImageArray, "__array__", whole)
    assert t.evaluate(lazy.x_test, lazy.y_test, batch_size=4) == want


# ----------------------------------------------------------------------------- errors


def _one_line_error(capsys, argv: list[str], code: int = 2) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("minidl: error: ") and "Traceback" not in err
    return err


def test_wrongly_named_or_laid_out_datasets_are_one_line_errors(tmp_path, capsys):
    err = _one_line_error(capsys, ["train", "smallcnn", "--dataset", "cifar-10"])
    assert "unknown dataset 'cifar-10' (did you mean 'cifar10'?)" in err
    assert all(name in err for name in DATASETS)
    for name in ("folder", "cifar10", "cifar100"):
        err = _one_line_error(capsys, ["train", "smallcnn", "--dataset", name])
        assert f"--dataset {name} needs --data-dir DIR" in err
    err = _one_line_error(capsys, ["train", "smallcnn", "--dataset", "cifar10", "--data-dir",
                                   str(tmp_path)], code=1)
    assert f"{tmp_path}: no CIFAR-10 python batches (data_batch_1..5, test_batch)" in err
    _cifar(tmp_path)
    err = _one_line_error(capsys, ["train", "smallcnn", "--dataset", "cifar100", "--data-dir",
                                   str(tmp_path)], code=1)
    assert "(it holds CIFAR-10: --dataset cifar10)" in err
    (tmp_path / "empty").mkdir()
    err = _one_line_error(capsys, ["train", "smallcnn", "--dataset", "folder", "--data-dir",
                                   str(tmp_path / "empty")], code=1)
    assert "no class sub-folders" in err
    args = build_parser().parse_args(["train", "smallcnn", "--dataset", "digits"])
    args.loader = "stream"
    with pytest.raises(UsageError, match="--loader stream reads folder, cifar10, cifar100"):
        args.func(args)
    args.loader = "disk"
    with pytest.raises(UsageError, match="unknown --loader 'disk'; valid: auto, memory, stream"):
        args.func(args)


def test_a_broken_image_met_while_training_is_one_line(tmp_path, capsys):
    pytest.importorskip("PIL")
    files = _folder(tmp_path / "imgs")
    files["cat"][4].write_bytes(b"not a png")
    err = _one_line_error(capsys, ["train", "smallcnn", "--dataset", "folder", "--data-dir",
                                   str(tmp_path / "imgs"), "--input", "3x8x8", "--width", "4",
                                   "--epochs", "1", "--quiet"], code=1)
    assert err.endswith(f"cannot read image {files['cat'][4]}: not an image Pillow can identify "
                        "(damaged, or a format it does not read)\n")


def test_missing_pillow_names_the_install(tmp_path, capsys, monkeypatch):
    (tmp_path / "a").mkdir()
    monkeypatch.setitem(sys.modules, "PIL", None)
    err = _one_line_error(capsys, ["train", "smallcnn", "--dataset", "folder", "--data-dir",
                                   str(tmp_path)], code=1)
    assert "the 'folder' dataset needs Pillow: pip install 'minidl[images]'" in err
