"""CrossHair plugin entry: ``crosshair check --extra_plugin tests/crosshair/plugin.py``.

CrossHair exec()s this file's text (so ``__file__`` is not ours): the factories live in
an ordinary module beside it, found relative to the repository root, where CrossHair
runs.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd() / "tests" / "crosshair"))

import factories

factories.register()
