"""The fork server that starts a launcher's local workers, and its early start.

A local run's workers are forked from one fork server per launcher process, which imports torch
and distrain once, before any worker exists (see :func:`worker_context`). Those imports take
about 3 s of CPU: started only once the launcher itself had imported torch and read its
settings, the fork server made every multi-worker ``distrain train`` wait for both in a row.
:func:`start_early` starts it from the command line's first look at its arguments instead, so
that it imports beside the launcher. This module imports nothing but the standard library (and distrain.runtime.process).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import signal
from collections.abc import Sequence
from multiprocessing import resource_tracker

from distrain.runtime.process import in_torchrun

#: What the fork server imports once, before any worker exists. ``torch._dynamo`` too: the first
#: optimizer a process makes imports it (about 1.4 s of CPU per worker otherwise). (Imported before
#: a worker's process group opens, it once held a survivor that replaced its group after a hung
#: peer until ``--timeout``: see ``membership._keep_groups_alive``.)
WORKER_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "distrain.train.loop")

#: The commands whose launcher starts local workers from the fork server.
COMMANDS = ("train", "compare")


def worker_context() -> multiprocessing.context.BaseContext:
    """How a launcher starts its local workers: forked from a fork server (one per launcher
    process) that imported torch and distrain once, where the platform has one (each worker
    started with ``spawn`` imported torch again: about 1.5 s of CPU per process, the larger part
    of a short run's start on a small machine); ``spawn`` elsewhere. Both start every worker from
    a clean state: the fork server forks before it trains anything, pickles the worker's
    arguments and imports the caller's main module as ``spawn`` does, and its children start in
    the caller's working directory. A fork server keeps the environment it started with, so pass
    each worker ``dict(os.environ)`` and begin it with
    :func:`~distrain.launch.common.enter_worker`."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(WORKER_PRELOAD))  # (a fork server already running keeps its own)
    # It imports from now on, beside the caller. Ctrl-C reaches the whole process group, the fork
    # server too, which ignores it only once its imports are done: a Ctrl-C in the first seconds
    # printed its KeyboardInterrupt traceback under the launcher's one line. So it starts with
    # SIGINT held (blocked: the mask is kept across its exec), where a Ctrl-C waits until its
    # own start ignores SIGINT and drops it; its workers begin ignoring it (enter_worker) until
    # their stop request takes SIGINT and SIGTERM over, and the launcher forwards a stop request
    # (SIGTERM) to every worker it started either way. Here SIGINT is held for the few
    # milliseconds of the server's start and arrives once they are over. (It was ignored here
    # instead, kept ignored across the exec: a Ctrl-C in those milliseconds was lost, and the
    # run trained to its end with exit status 0.)
    resource_tracker.ensure_running()  # (its own start ends by releasing SIGINT: before the hold)
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # (this thread's: the server takes it)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)  # a Ctrl-C meanwhile is raised now
    return context


def wants_workers(argv: Sequence[str]) -> bool:
    """Whether command-line arguments ``argv`` (without the program) start local workers from
    the fork server, as far as a look at them tells: ``train`` or ``compare``, not as a
    torchrun worker, not ``--workers 1`` (one worker trains in the launcher's own process) and
    not ``--emulation netns`` (each worker is a process of its own namespace). A wrong guess
    costs nothing but time: a fork server nobody uses ends with the launcher."""
    if not argv or argv[0] not in COMMANDS or "--help" in argv or "-h" in argv:
        return False
    if in_torchrun():
        return False
    values = {}
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        if name in ("--workers", "--emulation"):
            values[name] = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
    return values.get("--workers") != "1" and values.get("--emulation") != "netns"


def start_early(argv: Sequence[str]) -> bool:
    """Start the fork server now when ``argv`` starts local workers (:func:`wants_workers`);
    True when it was started. The command's launcher later gets the same server from
    :func:`worker_context`."""
    if not wants_workers(argv) or "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    worker_context()
    atexit.register(_stop_server)
    return True


def _stop_server() -> None:
    """At the launcher's exit: end the fork server now. Left alone, it ends only once its imports
    are done, and it holds the launcher's standard output and error until then, so a command
    refused before any worker started (bad input, exit 2) ended, for whoever reads its output,
    seconds after its one line. (Its workers have ended by then: the launcher waits for them.)"""
    server = multiprocessing.forkserver._forkserver
    pid = server._forkserver_pid
    if pid is None:
        return
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
