"""The mixed-precision tests import their shared networks as ``mixed_nets`` (pytest runs with
``--import-mode=importlib``, which leaves sys.path alone)."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
