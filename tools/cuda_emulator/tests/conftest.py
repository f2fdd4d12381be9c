"""The emulator's own tests run from the repository root, where tests/conftest.py is not an
ancestor: put tools/ (the `cuda_emulator` package) and tests/support on sys.path here too."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[3]
for _path in (_ROOT / "tools", _ROOT / "tests" / "support"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
