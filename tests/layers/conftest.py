"""Layer tests import the shared finite-difference helper as ``gradcheck`` (pytest runs with
``--import-mode=importlib``, which leaves sys.path alone, so test files may share names across
folders)."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
