"""The frameworks the adapters' tests need: skipped where they are not installed, except where
GRADWIRE_REQUIRE_FRAMEWORKS=1 (CI installs them all: a skip there would hide a broken install)."""

from __future__ import annotations

import importlib.util
import os

import pytest


def require(*modules: str, extra: str) -> None:
    """Skip the calling test module unless every one of `modules` imports (fail instead in CI)."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return
    why = f"needs {', '.join(missing)}: pip install \"gradwire[{extra}]\""
    if os.environ.get("GRADWIRE_REQUIRE_FRAMEWORKS") == "1":
        raise ImportError(f"{why} (GRADWIRE_REQUIRE_FRAMEWORKS=1: CI must run these tests, not skip them)")
    pytest.skip(why, allow_module_level=True)
