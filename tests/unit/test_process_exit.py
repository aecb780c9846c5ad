"""A process's exit: the garbage collector's objects are frozen once, before the interpreter's
last collection, by a handler registered once however often it is asked for."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import atexit, gc
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0))  # runs after the handler below
from distrain.runtime.process import freeze_at_exit
before = atexit._ncallbacks()
freeze_at_exit()
freeze_at_exit()
print("handlers added:", atexit._ncallbacks() - before)
print("frozen before exit:", gc.get_freeze_count() > 0)
"""


def test_objects_are_frozen_at_exit_by_one_handler():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split("\n")[:3] == ["handlers added: 1", "frozen before exit: False", "frozen at exit: True"]
