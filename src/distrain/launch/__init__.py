"""How worker processes come to exist: local spawn on loopback, or torchrun's environment.

The names below load on first use (PEP 562), so that importing a light module of this package
(:mod:`distrain.launch.preload`, which the command line imports before torch) loads no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {"in_torchrun": "distrain.runtime.process", "launch_local": "distrain.launch.local",
          "run_in_process": "distrain.launch.local", "run_torchrun_worker": "distrain.launch.torchrun"}

__all__ = ["in_torchrun", "launch_local", "run_in_process", "run_torchrun_worker"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
