"""The test suite's own settings: CI reports why tests were skipped and trusts no stale xfail."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def settings() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]


def test_skipped_tests_are_listed_with_their_reason():
    report = [a[2:] for a in shlex.split(settings()["addopts"]) if a.startswith("-r")]
    assert report and any(c in chars for chars in report for c in "sa"), report  # s: skipped; a: all but passed


def test_an_xfail_that_passes_fails_the_run():
    assert settings()["xfail_strict"] is True
    lenient = re.compile(r"xfail\([^)]*strict\s*=\s*False")
    assert [p.name for p in (ROOT / "tests").rglob("test_*.py") if lenient.search(p.read_text())] == []


def test_ci_leaves_out_only_the_slow_tests():
    assert "-m 'not slow'" in settings()["addopts"]
    assert any(m.startswith("slow:") for m in settings()["markers"])
