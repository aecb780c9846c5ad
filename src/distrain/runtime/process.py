"""A process's exit: skip the interpreter's last garbage collection over what torch loaded.

At exit, Python collects garbage once more over every object the garbage collector tracks. With
torch and its compiler stack loaded (the first optimizer a script makes imports it) that walk
takes about 0.8 s of CPU per process here, paid by every worker and launcher at the end of every
run: 4 workers on 2 cores wait about 1.6 s for it. Frozen objects (``gc.freeze``) are left out of
it; at exit nothing needs them collected (Python does not promise to finalize objects that still
exist when the interpreter exits), and everything else of interpreter teardown (``atexit``
handlers registered before this one, module cleanup, flushing files) runs as usual.

Also what a process can tell of itself before it imports torch: its exit statuses, and whether
torchrun started it (:func:`in_torchrun`).
"""

from __future__ import annotations

import atexit
import gc
import os

#: Exit status of a run, launcher or worker stopped by bad input (a setting, data or checkpoint
#: refused, with one line naming it), as argparse's usage errors.
EXIT_BAD_INPUT = 2

#: Exit status of a worker the others went on without (it was silent, e.g. stopped, while they
#: agreed on the members, or a server was lost as it joined): lost, as if it had died. The
#: launchers (``distrain train``, ``distrain launch``) go on without it in an elastic run and may
#: start it again.
EXIT_LEFT_OUT = 3

_registered = False


def freeze_at_exit() -> None:
    """Freeze the garbage collector's objects when the interpreter exits (registered once per
    process, as an ``atexit`` handler: handlers registered after it run before it)."""
    global _registered  # noqa: PLW0603 - once per process
    if not _registered:
        _registered = True
        atexit.register(gc.freeze)


def in_torchrun() -> bool:
    """True when this process was started by torchrun (or an equivalent launcher): its
    environment names its rank, the world size and the rendezvous."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
