"""minidl checkpoints: atomic writes (the ``.npz`` writer, and a temporary path for any other
writer), the training position read back for a resume, and what a file that is not a
checkpoint looks like (for one clear error)."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import zipfile
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..net.graph import Network


class CheckpointError(ValueError):
    """A file that is not a minidl checkpoint of this network; the message says what it is."""


#: What reading a truncated or corrupted ``.npz`` raises.
DAMAGED = (zipfile.BadZipFile, zlib.error, EOFError, OSError, ValueError, KeyError)


def damage(e: BaseException) -> str:
    """A truncated or corrupted archive's error, in a few words."""
    text = str(e) or type(e).__name__
    if "not a zip file" in text.lower():
        return "truncated or not a complete .npz: its zip directory is missing"
    if "crc" in text.lower():
        return f"a checksum does not match: {text}"
    return text


def check_writable(path: str | os.PathLike, noun: str = "checkpoint") -> str:
    """The folder a file at ``path`` goes to, after checking it exists and is writable and
    that ``path`` is not a folder (so that a run can fail before training, not after); errors
    call the file by its own ``noun`` (a checkpoint, a memory snapshot, a trace)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise IsADirectoryError(f"cannot write {noun} {path}: it is a folder")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"cannot write {noun} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write {noun} {path}: folder {folder} is not writable")
    return folder


def describe_file(path: str) -> str:
    """What a file that NumPy cannot load looks like, from its first bytes."""
    with open(path, "rb") as f:
        head = f.read(512)
    if not head:
        return "an empty file"
    if head[:1] == b"\x80":
        return "a Python pickle (such as a PyTorch file from an old torch.save)"
    try:
        head.decode("utf-8")
    except UnicodeDecodeError:
        return "a binary file of an unknown format"
    return "a text file"


def describe_npz(names: list[str], net: Network) -> str:
    """What a zip / ``.npz`` file without minidl's ``trainer/iteration`` entry holds."""
    if any(n.endswith("data.pkl") for n in names):
        return ("a PyTorch file (torch.save); to load its weights use "
                "net.load_state_dict(torch.load(path))")
    own = set(net.state_dict())
    if names and set(names) <= own:
        return ("a plain .npz of this network's state dict (np.savez); load it with "
                "net.load_state_dict(dict(np.load(path)))")
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return f"an .npz of {len(names)} arrays ({shown or 'none'}) without minidl's entries"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str,
                noun: str = "checkpoint") -> Iterator[str]:
    """A temporary file's path in ``path``'s folder (checked writable first; errors name the
    file by ``noun``) for the block to write; it is renamed onto ``path`` when the block
    ends, and removed if the block raises."""
    folder = check_writable(path, noun)
    try:
        fd, tmp = tempfile.mkstemp(suffix=suffix, dir=folder)
    except OSError as e:  # (named by the file asked for, not the temporary one)
        raise type(e)(e.errno, f"{e.strerror} (creating a file in {folder})",
                      os.fspath(path)) from None
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())  # (mkstemp's 0600: the file is the user's like any)
        os.replace(tmp, os.fspath(path))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: str | os.PathLike, data: Any, noun: str = "trace") -> None:
    """``data`` as JSON at ``path``, atomically (:func:`atomic_path`): mode 0666 less the
    umask, as any file the user writes (a trace, a snapshot), not mkstemp's 0600."""
    with atomic_path(path, ".json", noun) as tmp, open(tmp, "w") as f:
        json.dump(data, f)


def write_npz(path: str, arrays: dict[str, Any]) -> None:
    """``np.savez`` of ``arrays`` to ``path``, atomically (:func:`atomic_path`)."""
    with atomic_path(path, ".npz") as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def resume_position(path: str, z: Any) -> tuple[int, int, int | None,
                                                     np.random.Generator | None]:
        """(epoch, batch in epoch, steps per epoch, augmentation generator) from a checkpoint."""
        if "trainer/epoch" not in z.files:
            raise CheckpointError(f"checkpoint {path} holds no training position (written by an "
                                  "older minidl): load it without resume=True to start a new "
                                  "run from its weights")
        rng = None
        if "trainer/augment_rng" in z.files:
            rng = np.random.default_rng()
            rng.bit_generator.state = json.loads(str(z["trainer/augment_rng"]))
        return (int(z["trainer/epoch"]), int(z["trainer/epoch_step"]),
                int(z["trainer/steps_per_epoch"]) or None, rng)
