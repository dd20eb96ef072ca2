"""``python -m minidl``: the ``minidl`` command."""

import sys

from .cli import main

sys.exit(main())
