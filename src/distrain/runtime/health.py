"""Liveness of the other workers, so a failed collective can name the rank that stopped.

Each worker stamps ``distrain/heartbeat/<rank>`` in the rendezvous store every ``interval``
seconds from a daemon thread, through a store client of its own. When a collective fails
("connection closed by peer", or the process-group timeout), the survivor reads the stamps: a
rank whose stamp is older than a few intervals (or missing) is the suspect. If the store itself
is gone, its host (rank 0 for local runs) is the suspect.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from distrain.errors import WorkerFailure

log = logging.getLogger(__name__)

KEY = "distrain/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/heartbeat/{}"  # per torchrun attempt


class Heartbeat:
    """Stamp this worker's liveness in the store; find ranks that stopped stamping.

    Args:
        host, port: the rendezvous store (MASTER_ADDR / MASTER_PORT).
        rank, world_size: this process and the number of processes to watch.
        interval: seconds between stamps.

    Example::

        beat = Heartbeat("127.0.0.1", 29500, rank=1, world_size=4)
        beat.start()
        ...
        print(beat.suspects())   # e.g. [3] after worker 3 was killed
        beat.stop()
    """

    def __init__(self, host: str, port: int, rank: int, world_size: int, interval: float = 1.0) -> None:
        self.host, self.port = host, port
        self.rank, self.world_size = rank, world_size
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._query: dist.TCPStore | None = None  # made while the store is surely up; reused
        self._store_lost = False

    def _client(self) -> dist.TCPStore:
        return dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=max(2.0, 2 * self.interval)))

    def start(self) -> Heartbeat:
        try:
            self._query = self._client()
            self._query.set(KEY.format(self.rank), repr(time.time()))  # started means stamped
        except Exception as exc:  # noqa: BLE001 - no store: suspects() names its host
            log.debug("no store for heartbeats: %s", exc)
        self._thread = threading.Thread(target=self._run, name="distrain-heartbeat", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            store = self._client()
            while not self._stop.is_set():
                store.set(KEY.format(self.rank), repr(time.time()))
                self._stop.wait(self.interval)
        except Exception as exc:  # the store's host went away; suspects() will say so
            self._store_lost = True
            log.debug("heartbeat stopped: %s", exc)

    def suspects(self, stale_after: float | None = None) -> list[int]:
        """Ranks whose stamp is missing or older than ``stale_after`` seconds (default 3 intervals)."""
        stale_after = stale_after if stale_after is not None else 3 * self.interval
        try:
            if self._store_lost:
                raise ConnectionError("the store is gone")
            store = self._query if self._query is not None else self._client()
            self._query = store
            now = time.time()
            out = []
            for r in range(self.world_size):
                if r == self.rank:
                    continue
                key = KEY.format(r)
                if not store.check([key]) or now - float(store.get(key).decode()) > stale_after:
                    out.append(r)
            return out
        except Exception:
            self._store_lost = True  # do not try again: every try against a dead store waits and logs
            return [0]  # the store lives with rank 0 (or the torchrun agent on its host)

    def wait_for_suspects(self, patience: float | None = None) -> list[int]:
        """Poll until some rank looks dead or ``patience`` seconds pass (default 5 intervals)."""
        deadline = time.monotonic() + (patience if patience is not None else 5 * self.interval)
        while True:
            found = self.suspects()
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(self.interval / 2)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)


DEAD_KEY = "distrain/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/dead/{}"


#: A process that finished its part of the run (see :func:`finishers`).
FINISHED_KEY = "distrain/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/finished/{}"


def finishers(store: dist.Store, rank: int, world: int, timeout: float, poll: float = 0.05) -> list[int]:
    """Register process ``rank`` as finished and wait until each of the ``world`` processes has
    finished too or was declared dead; return those that finished (in order). Every finisher gets
    the same list: a finished process stays finished, and one that has not finished is waited
    for until it is declared dead.

    Raises WorkerFailure after ``timeout`` seconds with processes neither finished nor dead."""
    store.set(FINISHED_KEY.format(rank), "1")
    deadline = time.monotonic() + timeout
    while True:
        finished = [r for r in range(world) if store.check([FINISHED_KEY.format(r)])]
        pending = [r for r in range(world) if r not in finished]
        if all(store.check([DEAD_KEY.format(r)]) for r in pending):
            return finished
        if time.monotonic() > deadline:
            raise WorkerFailure(f"process {rank}: processes {pending} neither finished nor were lost within {timeout:g} s")
        time.sleep(poll)


def declare_dead(store: dist.Store | None, rank: int) -> None:
    """Mark process ``rank`` dead in the run's store (best effort: the store may be closing)."""
    if store is None:
        return
    try:
        store.compare_set(DEAD_KEY.format(rank), "", repr(time.time()))
    except Exception as exc:  # noqa: BLE001
        log.debug("could not declare rank %d dead: %s", rank, exc)


#: a value no store key holds: compare_set(key, MISSING, MISSING) reads a key without waiting for it
_MISSING = "\x00missing"


def dead_since(store: dist.Store, rank: int) -> float | None:
    """When process ``rank`` was declared dead (Unix time), or None when it is not (or no longer:
    a worker started again deletes its mark). One atomic read: a check followed by a get would
    wait the store's whole timeout for a mark deleted between the two."""
    value = store.compare_set(DEAD_KEY.format(rank), _MISSING, _MISSING)  # sets nothing
    return None if value == _MISSING.encode() else float(value.decode())


def silent(store: dist.Store, ranks: list[int] | set[int], stale_after: float) -> list[int]:
    """Of ``ranks``: those declared dead, or whose heartbeat is missing or older than
    ``stale_after`` seconds."""
    now, out = time.time(), []
    for r in sorted(ranks):
        beat = KEY.format(r)
        if store.check([DEAD_KEY.format(r)]) or not store.check([beat]) \
                or now - float(store.get(beat).decode()) > stale_after:
            out.append(r)
    return out


def declared_dead(store: dist.Store | None, rank: int) -> bool:
    """Whether process ``rank`` was declared dead in the run's store (False when it cannot say)."""
    try:
        return store is not None and store.check([DEAD_KEY.format(rank)])
    except Exception:  # noqa: BLE001
        return False


class Liveness:
    """Which workers the others have given up on (asynchronous algorithms drop them and go on).

    A worker that finds a peer gone (its connection closed, or silent past the peer timeout
    with a stale heartbeat) declares it dead in the store; every survivor then leaves it out of
    the final consensus. One instance per thread (each holds its own store client).

    Example::

        live = Liveness.from_env(world_size=4)
        live.declare_dead(3)
        live.dead_ranks()      # {3: time it was declared}
    """

    def __init__(self, host: str, port: int, world_size: int, stale_after: float = 3.0) -> None:
        self.host, self.port, self.world_size, self.stale_after = host, port, world_size, stale_after
        self._store: dist.TCPStore | None = None

    @classmethod
    def from_env(cls, world_size: int) -> Liveness | None:
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        return cls(host, int(port), world_size) if host and port else None

    def _client(self) -> dist.TCPStore:
        if self._store is None:
            self._store = dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                                        timeout=timedelta(seconds=10))
        return self._store

    @property
    def store(self) -> dist.TCPStore:
        """This instance's store client."""
        return self._client()

    def another(self) -> Liveness:
        """The same view through a store client of its own (for another thread)."""
        return Liveness(self.host, self.port, self.world_size, self.stale_after)

    def declare_dead(self, rank: int) -> None:
        declare_dead(self._client(), rank)

    def is_dead(self, rank: int) -> bool:
        """Whether ``rank`` was declared dead (one store request)."""
        return declared_dead(self._client(), rank)

    def dead_ranks(self) -> dict[int, float]:
        """Ranks declared dead, with when (Unix time) the first survivor declared them."""
        store = self._client()
        return {r: t for r in range(self.world_size) if (t := dead_since(store, r)) is not None}

    def silent(self, ranks: list[int] | set[int]) -> list[int]:
        """Of ``ranks``: those declared dead, or whose heartbeat is missing or stale."""
        return silent(self._client(), ranks, self.stale_after)
