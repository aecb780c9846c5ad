"""Where a benchmark result came from, and the statistics every benchmark reports the same way.

Every script in ``benchmarks/`` writes its results file through :func:`write_result`, which adds
a ``provenance`` record (the commit, whether the checkout had changes, the torch and Python
versions, the host's core count and processor, the UTC time and the command line) and rewrites any path inside
the repository as a path relative to it, so a results file says which code produced it and
carries nothing of the machine it ran on but what matters for its figures.

    from provenance import spread, write_result    # scripts run as python benchmarks/NAME.py
    write_result(RESULTS / "ddp.json", {"ratio": spread(ratios), ...})

A figure that compares two configurations is the median of the per-repeat ratios (repeat i of
one over repeat i of the other), reported with their minimum, maximum and every value
(:func:`ratio_spread`); each script's ``--repeats`` defaults to at least 3.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MIN_REPEATS = 3
#: Keys every results file's ``provenance`` holds.
FIELDS = ("commit", "dirty", "torch", "cpus", "python", "utc", "command")
#: Keys recorded since 2026-12-02 (files written before lack them): the processor's model and the
#: vector instructions torch's kernels use on it, on which a run's figures depend to the last digits.
MACHINE_FIELDS = ("cpu", "cpu_capability")
# An absolute path: a slash at the start of a word followed by a name and another slash.
_ABSOLUTE = re.compile(r"(?<![\w.~-])/(?:[\w.~-]+/)+[\w.~-]*")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def provenance(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The record of this run: commit, dirty flag, versions, cores, processor, UTC time and command line.

    ``dirty`` is True when tracked files other than the results differ from the commit (results
    written by an earlier benchmark do not make the code dirty), None outside a git checkout.
    """
    import torch

    from distrain.compare import cpu_model

    argv = sys.argv if argv is None else argv
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results")
    return {
        "commit": _git("rev-parse", "HEAD"),
        "dirty": None if status is None else status != "",
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": relative_text(shlex.join(["python", *argv])),
    }


def relative(path: str | os.PathLike[str]) -> str:
    """``path`` relative to the repository if it lies inside it, else ``<outside>/NAME``."""
    resolved = Path(path).resolve()
    if resolved.is_relative_to(ROOT):
        return str(resolved.relative_to(ROOT)) or "."
    return f"<outside>/{resolved.name}"


def relative_text(text: str) -> str:
    """Every absolute path in ``text`` (a command line, say) made relative by :func:`relative`."""
    return _ABSOLUTE.sub(lambda m: relative(m.group(0)), text)


def relative_paths(obj: Any) -> Any:
    """A copy of a JSON-like object with every string's absolute paths made relative."""
    if isinstance(obj, dict):
        return {k: relative_paths(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [relative_paths(v) for v in obj]
    if isinstance(obj, str):
        return relative_text(obj)
    return obj


def absolute_paths(obj: Any) -> list[str]:
    """Every absolute path found in the strings of a JSON-like object (keys included)."""
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in absolute_paths(k) + absolute_paths(v)]
    if isinstance(obj, list):
        return [p for v in obj for p in absolute_paths(v)]
    return _ABSOLUTE.findall(obj) if isinstance(obj, str) else []


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """Median, minimum and maximum of repeats, with the values; a missing value (a repeat that
    never reached its target) counts as infinitely large, and a median that is one is None."""
    finite = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "values": []}
    median = statistics.median([float("inf") if v is None else v for v in values])
    return {"median": None if median == float("inf") else median,
            "min": min(finite) if finite else None, "max": max(finite) if len(finite) == len(values) else None,
            "values": list(values)}


def ratio_spread(numerators: Sequence[float | None], denominators: Sequence[float | None]) -> dict[str, Any]:
    """Median, minimum and maximum of the per-repeat ratios ``numerators[i] / denominators[i]``.

    A repeat where either is missing (never reached its target) gives no ratio; the median is
    then None, since it would depend on how the missing one is counted."""
    ratios = [a / b if a is not None and b else None for a, b in zip(numerators, denominators, strict=True)]
    finite = [r for r in ratios if r is not None]
    return {"median": statistics.median(finite) if finite and len(finite) == len(ratios) else None,
            "min": min(finite) if finite else None, "max": max(finite) if finite else None,
            "values": ratios, "repeats": len(ratios)}


def check_repeats(parser: Any, repeats: int) -> None:
    """Refuse fewer repeats than a figure needs, unless asked for a quick look (``--repeats 1``
    is allowed and says so in the results)."""
    if repeats < 1:
        parser.error(f"--repeats must be >= 1, got {repeats}")
    if repeats < MIN_REPEATS:
        print(f"note: --repeats {repeats} < {MIN_REPEATS}: a quick look, not a figure to publish", flush=True)


def write_result(path: str | os.PathLike[str], result: dict[str, Any], argv: Sequence[str] | None = None) -> Path:
    """Write ``result`` as JSON with its ``provenance`` and every path made relative."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = relative_paths({"provenance": provenance(argv), **result})
    out.write_text(json.dumps(record, indent=2) + "\n")
    return out
