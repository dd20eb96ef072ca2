"""Issue 49: JSON outputs (traces, .mem snapshots) get the mode a plainly written file gets
(0666 less the umask), not the private 0600 of the temporary file they are renamed from."""

from __future__ import annotations

import os
import stat

from minidl.memory.ir.timeline import write_json_atomic


def test_json_written_atomically_has_a_plain_files_mode(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("{}")
    out = tmp_path / "x.json"
    write_json_atomic(out, {"a": 1})
    assert stat.S_IMODE(os.stat(out).st_mode) == stat.S_IMODE(os.stat(plain).st_mode)
    assert out.read_text() == '{"a": 1}'


def test_the_umask_is_honoured(tmp_path):
    old = os.umask(0o077)
    try:
        write_json_atomic(tmp_path / "y.json", [])
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "y.json").st_mode) == 0o600
