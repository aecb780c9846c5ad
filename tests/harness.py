"""Run a function on N real gloo processes on 127.0.0.1, with a timeout, always reaping them.

Example::

    def body(rank, world, scale):           # module-level, so spawn can import it
        t = torch.full((4,), float(rank))
        dist.all_reduce(t)
        return {"sum": t * scale}           # tensors / dicts of tensors / numbers

    results = run_group(body, world=4, args=(2.0,))
    assert results[3]["sum"][0] == 12.0

The processes are forked from a fork server that imported torch and distrain once, for the whole
test session (each ``spawn`` child imported torch again: about 1.5 s of CPU per process). Like
spawn children they start from a clean interpreter state and the test process's environment and
working directory at the call.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.connection
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distrain.launch.common import free_port

#: What the fork server imports once; a child imports the rest of what its function needs.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "distrain.algorithms", "distrain.distributed", "distrain.comm.transport",
           "distrain.compress", "tests.harness"]
_context = mp.get_context("forkserver")
_context.set_forkserver_preload(PRELOAD)


def _with_environ(environ: dict[str, str], *args: Any) -> None:
    """A child's start: the environment of the call (the fork server's dates from its own start)."""
    os.environ.clear()
    os.environ.update(environ)
    _child(*args)


def _child(fn: Callable, rank: int, world: int, port: int, out: str, args: tuple, timeout: float) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    except BaseException:
        Path(out, f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    os._exit(0)


def run_group(fn: Callable, world: int, args: tuple = (), timeout: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in ``world`` processes; return each rank's result.

    Raises AssertionError (with the failing rank's traceback) when a process fails or the whole
    group does not finish within ``timeout`` seconds; every child is reaped either way.
    """
    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = [_context.Process(target=_with_environ, args=(dict(os.environ), fn, r, world, port, out, args, timeout))
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            pending = list(procs)
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"group of {world} did not finish within {timeout} s")
                ready = multiprocessing.connection.wait([p.sentinel for p in pending], timeout=left)
                for p in [p for p in pending if p.sentinel in ready]:
                    p.join()
                    pending.remove(p)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(10)
        errors = sorted(Path(out).glob("*.err"))
        if errors:
            raise AssertionError(errors[0].read_text())
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise AssertionError(f"processes exited with {bad}")
        return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=True) for r in range(world)]


def stacked(results: list[dict], key: str) -> torch.Tensor:
    """Every rank's ``key`` from ``run_group`` results, stacked along a new first dimension."""
    return torch.stack([r[key] for r in results])


def check_rounds_keep_the_mean(results: list[dict], rounds: int, counter: str, at_least: int) -> None:
    """Rounds ``0 .. rounds - 1`` of a gossip stress (zero updates, lr = 0): together the ranks
    counted at least ``at_least`` of ``counter{i}`` (exchanges, group memberships), and each
    round kept the global mean of ``first{i}`` in ``last{i}``."""
    assert sum(int(r[f"{counter}{i}"]) for r in results for i in range(rounds)) >= at_least
    for i in range(rounds):
        torch.testing.assert_close(stacked(results, f"last{i}").mean(0), stacked(results, f"first{i}").mean(0))
