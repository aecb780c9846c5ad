"""What the worker loop does when something goes wrong: signals, lost peers, non-finite values."""

from __future__ import annotations

import logging
import os
import signal
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from distrain.errors import WorkerFailure
from distrain.train.health import Heartbeat

log = logging.getLogger(__name__)

STOP_KEY = "distrain/stop_step"


class Interrupted(Exception):
    """The run was asked to stop (SIGTERM / Ctrl-C); a checkpoint was written at ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step
        super().__init__(f"stopped on request at step {step}")


class StopRequest:
    """Turns SIGTERM / SIGINT into a request that the loop honours at a step boundary.

    Synchronous algorithms must stop at the same step on every worker, or the ones that go on
    would wait for the ones that left. The first worker to see the request proposes
    ``step + 2`` in the rendezvous store (compare-and-set, so one proposal wins); each worker
    runs until that step, checkpoints, and leaves. Workers are at most one step apart in a
    synchronous algorithm, so nobody has passed the agreed step.
    """

    def __init__(self) -> None:
        self.requested = threading.Event()
        self._previous: dict[int, Any] = {}

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested.is_set():  # a second signal: stop now
            raise KeyboardInterrupt
        self.requested.set()

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def agreed_step(self, step: int, synchronous: bool) -> int:
        """The step at which every worker stops: ours + 2 (or the first proposal), or ours if alone."""
        store = _store_client()
        if not synchronous or store is None:
            return step
        value = store.compare_set(STOP_KEY, "", str(step + 2))
        return int(value.decode() if isinstance(value, bytes) else value)


def _store_client() -> dist.TCPStore | None:
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))


def start_heartbeat() -> Heartbeat | None:
    """Stamp liveness in the rendezvous store (none for a single process)."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port or dist.get_world_size() == 1:
        return None
    return Heartbeat(host, int(port), dist.get_rank(), dist.get_world_size()).start()


def lost_peer(exc: BaseException, rank: int, step: int, heartbeat: Heartbeat | None) -> WorkerFailure:
    """A one-line failure naming the step and the rank that most likely stopped."""
    suspects = heartbeat.wait_for_suspects() if heartbeat is not None else []
    who = f"rank {', '.join(map(str, suspects))}" if suspects else "an unknown rank"
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return WorkerFailure(f"worker {rank} lost contact with {who} at step {step} ({reason[:160]})")


def check_finite(loss: torch.Tensor, rank: int, step: int) -> bool:
    """False when the loss is NaN or infinite (the caller stops or skips the step)."""
    return bool(torch.isfinite(loss).all())


def nonfinite_error(rank: int, step: int, what: str = "loss") -> WorkerFailure:
    return WorkerFailure(f"worker {rank}: non-finite {what} at step {step}; stopped before sending anything "
                         "(use --on-nonfinite skip to skip such steps)")


def injected_nan(rank: int, step: int) -> bool:
    """Fault injection for tests: DISTRAIN_INJECT_NAN='rank:step' poisons that worker's loss once."""
    spec = os.environ.get("DISTRAIN_INJECT_NAN")
    if not spec:
        return False
    r, s = (int(v) for v in spec.split(":"))
    return r == rank and s == step
