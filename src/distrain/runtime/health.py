"""Liveness of the other workers, so a failed collective can name the rank that stopped.

Each worker stamps ``distrain/heartbeat/<rank>`` in the rendezvous store every ``interval``
seconds from a daemon thread, through a store client of its own. When a collective fails
("connection closed by peer", or the process-group timeout), the survivor reads the stamps: a
rank whose stamp is older than a few intervals (or missing) is the suspect. If the store itself
is gone, its host (rank 0 for local runs) is the suspect.

A live process can still be stuck: a deadlock, a call into a library that never returns. The
heartbeat vouches for its training thread only while that thread moves (:class:`StuckWatch`):
once the thread has stood at one place outside distrain's and torch.distributed's own waits for
longer than a deadline derived from its measured step times (:func:`stuck_deadline`; ``--timeout``
the ceiling), the stamps stop, and the others find the worker silent as they would a stopped one.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import Any

import torch.distributed as dist

from distrain.errors import PeerTimeout, WorkerFailure

log = logging.getLogger(__name__)

KEY = "distrain/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/heartbeat/{}"  # per torchrun attempt


#: A thread that stood still this long at least counts as stuck: no step of a healthy run spends
#: that long in one call outside a wait (the deadline is longer where its steps are slow).
STUCK_FLOOR_S = float(os.environ.get("DISTRAIN_STUCK_FLOOR_S", "30"))
#: ... or this many times the 99th percentile of its measured step times, if that is longer.
STUCK_FACTOR = 10.0
#: CPU seconds a thread must have used since it was last seen at a place to count as moving (a
#: Python loop is often seen at the same instruction, where it lets other threads run).
CPU_MOVES_S = 0.001
#: Step times measured before the deadline follows them (until then it is the ceiling).
STUCK_MIN_STEPS = 5
_DISTRAIN_DIR = str(Path(__file__).resolve().parents[1]) + os.sep


def stuck_deadline(step_seconds: list[float] | collections.deque[float], ceiling: float) -> float:
    """Seconds a training thread may stand still outside a wait: ``STUCK_FACTOR`` times the 99th
    percentile of its measured step times, at least ``STUCK_FLOOR_S``, at most ``ceiling``
    (``--timeout``); the ceiling until ``STUCK_MIN_STEPS`` steps were measured."""
    if len(step_seconds) < STUCK_MIN_STEPS:
        return ceiling
    ordered = sorted(step_seconds)
    q99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return min(ceiling, max(STUCK_FLOOR_S, STUCK_FACTOR * q99))


_STDLIB_DIR = sysconfig.get_paths()["stdlib"] + os.sep
_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep


def in_a_wait(frame: FrameType) -> bool:
    """Whether a thread whose innermost Python frame is ``frame`` waits in distrain's or
    torch.distributed's code, where waits on others have deadlines of their own: the first frame
    outward that is not the standard library's (a lock, a queue, a sleep) decides."""
    f: FrameType | None = frame
    while f is not None and f.f_code.co_filename.startswith(_STDLIB_DIR) and "-packages" not in f.f_code.co_filename:
        f = f.f_back
    if f is None:
        return False
    name = f.f_code.co_filename
    return name.startswith(_DISTRAIN_DIR) or _DISTRIBUTED in name


class StuckWatch:
    """Whether a thread (the training loop's) has stood still outside a wait for too long.

    Sampled from another thread (the heartbeat's): the watched thread's innermost Python frame
    and the instruction in it. A thread that runs Python (an evaluation loop, data loading)
    moves between samples; one inside a long call (a forward pass, a checkpoint write) stands
    still for as long as the call takes; one waiting in distrain or torch.distributed is not
    watched (those waits have deadlines of their own and name the peer they wait for).

    Args:
        ident: the watched thread (``threading.get_ident()`` there).
        ceiling: the longest deadline, ``--timeout``.

    Example::

        watch = StuckWatch(threading.get_ident(), ceiling=120.0)
        watch.progress()            # the watched thread, at the end of every step
        watch.stuck_for()           # another thread: 0.0, or how long the thread stood past its deadline
    """

    def __init__(self, ident: int, ceiling: float) -> None:
        self.ident, self.ceiling = ident, ceiling
        self.steps: collections.deque[float] = collections.deque(maxlen=200)  # seconds of the last steps
        self._last_progress: float | None = None
        self._place: tuple[int, int, float] | None = None
        self._since = time.monotonic()
        try:  # the thread's CPU time: a thread that computes moves even where its place looks the same
            self._clock: int | None = time.pthread_getcpuclockid(ident)
        except (AttributeError, OSError):  # not on this platform: its place alone
            self._clock = None

    def progress(self) -> None:
        """A step ended (called by the watched thread): its time joins the measurements."""
        now = time.monotonic()
        if self._last_progress is not None:
            self.steps.append(now - self._last_progress)
        self._last_progress = now

    def deadline(self) -> float:
        return stuck_deadline(self.steps, self.ceiling)

    def frame(self) -> FrameType | None:
        return sys._current_frames().get(self.ident)

    def stuck_for(self) -> float:
        """Seconds the watched thread has stood at one place outside a wait, if that is longer
        than its deadline; else 0.0 (also once the thread has ended)."""
        frame, now = self.frame(), time.monotonic()
        if frame is None or in_a_wait(frame):
            self._place, self._since = None, now
            return 0.0
        cpu = self._cpu()
        place = (id(frame), frame.f_lasti, cpu)
        if self._place is None or place[:2] != self._place[:2] or cpu - self._place[2] > CPU_MOVES_S:
            self._place, self._since = place, now
            return 0.0
        still = now - self._since
        return still if still > self.deadline() else 0.0

    def _cpu(self) -> float:
        try:
            return time.clock_gettime(self._clock) if self._clock is not None else 0.0
        except OSError:  # the thread ended
            return 0.0

    def where(self) -> str:
        """The watched thread's stack, innermost last (for the warning that it is stuck)."""
        frame = self.frame()
        return "".join(traceback.format_stack(frame, limit=8)).rstrip() if frame is not None else "(ended)"


#: Seconds the store may fail every request before the heartbeat takes its host for gone.
STORE_LOST_S = 10.0


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

    def __init__(self, host: str, port: int, rank: int, world_size: int, interval: float = 1.0,
                 ceiling: float | None = None) -> None:
        self.host, self.port = host, port
        self.rank, self.world_size = rank, world_size
        self.interval = interval
        #: with ``ceiling`` (``--timeout``): the thread that made this heartbeat is watched, and the
        #: stamps stop while it is stuck (see :class:`StuckWatch`)
        self.watch = StuckWatch(threading.get_ident(), ceiling) if ceiling is not None else None
        self.stuck = False
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

    def progress(self) -> None:
        """A step of the watched thread ended (its duration sets the stuck deadline)."""
        if self.watch is not None:
            self.watch.progress()

    def _vouch(self) -> bool:
        """Whether to stamp now: not while the watched thread is stuck (said once, with where)."""
        still = self.watch.stuck_for() if self.watch is not None else 0.0
        if still and not self.stuck:
            assert self.watch is not None
            log.warning("worker %d: its training thread has stood still for %.0f s outside any wait (deadline "
                        "%.1f s: %g x its 99th-percentile step time, at least %g s, at most --timeout); it "
                        "stops stamping its heartbeat and the others go on without it. The thread is at:\n%s",
                        self.rank, still, self.watch.deadline(), STUCK_FACTOR, STUCK_FLOOR_S, self.watch.where())
        elif not still and self.stuck:
            log.warning("worker %d: its training thread moves again", self.rank)
        self.stuck = bool(still)
        return not self.stuck

    def _run(self) -> None:
        """Stamp every interval. A request that fails (a store slow to answer on a loaded host)
        is tried again with a new client: only a store unreachable for ``STORE_LOST_S`` stops the
        stamps, which would otherwise make a live worker look dead to everyone 3 s later."""
        store: dist.TCPStore | None = None
        failing_since: float | None = None
        while not self._stop.is_set():
            try:
                store = store if store is not None else self._client()
                if self._vouch():
                    store.set(KEY.format(self.rank), repr(time.time()))
                failing_since = None
            except Exception as exc:  # noqa: BLE001 - tried again, until the store is surely gone
                store, now = None, time.monotonic()
                failing_since = failing_since if failing_since is not None else now
                if now - failing_since > STORE_LOST_S:  # the store's host went away; suspects() will say so
                    self._store_lost = True
                    log.debug("heartbeat stopped: %s", exc)
                    return
                log.debug("heartbeat: a stamp failed, trying again: %s", exc)
            self._stop.wait(self.interval)

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


#: How often a worker that goes on in the same group (parameter servers, asynchronous gossip)
#: looks in the store for workers declared dead (seconds).
LOST_CHECK_S = 1.0


def dead_since(store: dist.Store, rank: int) -> float | None:
    """When process ``rank`` was declared dead (Unix time), or None when it is not (or no longer:
    a worker started again deletes its mark). One atomic read: a check followed by a get would
    wait the store's whole timeout for a mark deleted between the two."""
    value = store.compare_set(DEAD_KEY.format(rank), _MISSING, _MISSING)  # sets nothing
    return None if value == _MISSING.encode() else float(value.decode())


def heartbeat_age(store: dist.Store, rank: int) -> float | None:
    """Seconds since ``rank``'s last heartbeat; None when it has stamped none."""
    beat = KEY.format(rank)
    return time.time() - float(store.get(beat).decode()) if store.check([beat]) else None


def heartbeat_stale(store: dist.Store, rank: int, stale_after: float) -> bool:
    """Whether ``rank``'s heartbeat is missing or older than ``stale_after`` seconds (its dead
    mark aside: a process started again may still carry its last life's)."""
    age = heartbeat_age(store, rank)
    return age is None or age > stale_after


def stopped_stamping(store: dist.Store, rank: int, stale_after: float = 3.0) -> bool:
    """Whether ``rank``'s heartbeat stamped and then stopped for longer than ``stale_after``
    seconds (one that has stamped none yet, still importing, has not stopped)."""
    age = heartbeat_age(store, rank)
    return age is not None and age > stale_after


def silent(store: dist.Store, ranks: list[int] | set[int], stale_after: float) -> list[int]:
    """Of ``ranks``: those declared dead, or whose heartbeat is missing or older than
    ``stale_after`` seconds."""
    return [r for r in sorted(ranks) if store.check([DEAD_KEY.format(r)]) or heartbeat_stale(store, r, stale_after)]


def declared_dead(store: dist.Store | None, rank: int) -> bool:
    """Whether process ``rank`` was declared dead in the run's store (False when it cannot say)."""
    try:
        return store is not None and store.check([DEAD_KEY.format(rank)])
    except Exception:  # noqa: BLE001
        return False


class Liveness:
    """Which workers the others have given up on (asynchronous algorithms drop them and go on).

    A worker that finds a peer gone (its connection closed, or silent while we wait for it
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


#: A process asks the launcher (which hosts the store) to stop process ``rank``: it waits for
#: it, and the process is alive but silent (see :class:`SilenceWatch`). The value says why.
FENCE_KEY = "distrain/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/fence/{}"


def request_fence(store: dist.Store, rank: int, why: str) -> None:
    """Ask the launcher to stop process ``rank`` (the first reason given stands)."""
    store.compare_set(FENCE_KEY.format(rank), "", why)


def take_fence_request(store: dist.Store, rank: int) -> str | None:
    """Why a process asked for ``rank`` to be stopped, once (the request is removed, so that a
    process started again in its place is not stopped for it); None when nobody asked."""
    key = FENCE_KEY.format(rank)
    value = store.compare_set(key, _MISSING, _MISSING)  # sets nothing
    if value == _MISSING.encode():
        return None
    store.delete_key(key)
    return value.decode()


class SilenceWatch:
    """Has the launcher stop a peer that stays silent while this process waits for it.

    Gloo cannot cancel a wait, and a wait that outlasts the group's timeout closes every
    connection of the group. A peer that stopped (SIGSTOP, a stuck training thread) keeps its
    connections open: waited for, it would hold this process until ``--timeout`` and then take
    every other peer's connection with it. A thread here looks every ``poll`` seconds at whom the
    caller waits for (``awaited()``: rank -> since when, monotonic); once a peer has been waited
    for longer than ``stale_after`` and its heartbeat is as old (alive, but silent; not declared
    dead, not finished), it asks the launcher to stop it (:func:`request_fence`). The launcher
    kills it, the wait fails at once with its connection reset, and the caller goes on without
    it as without any peer that died (``--max-restarts`` then starts it again). Under a launcher
    that does not take such requests (torchrun), the wait ends at ``--timeout`` as before.

    Example::

        watch = SilenceWatch(lambda: {worker: since}, "server 0").start()
        ...
        watch.close()
    """

    def __init__(self, awaited: Callable[[], dict[int, float]], who: str, stale_after: float = 3.0,
                 poll: float = 0.25) -> None:
        self.awaited, self.who, self.stale_after, self.poll = awaited, who, stale_after, poll
        #: the peers it asked to have stopped: rank -> the reason given
        self.asked: dict[int, str] = {}
        self.looks = 0  # how many times it has looked at the waits
        self._live = Liveness.from_env(world_size=0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distrain-silence-watch", daemon=True)

    def start(self) -> SilenceWatch:
        if self._live is not None:
            self._thread.start()
        return self

    def _run(self) -> None:
        waits_asked: set[tuple[int, float]] = set()  # (peer, since): one request per wait
        while not self._stop.wait(self.poll):
            try:
                now = time.monotonic()
                for peer, since in list(self.awaited().items()):
                    if now - since <= self.stale_after or (peer, since) in waits_asked:
                        continue
                    store = self._live.store
                    if dead_since(store, peer) is not None or store.check([FINISHED_KEY.format(peer)]) \
                            or not heartbeat_stale(store, peer, self.stale_after):
                        continue
                    why = (f"{self.who} waited {now - since:.1f} s for it and its heartbeat had stopped "
                           "(alive, but not answering)")
                    request_fence(store, peer, why)
                    waits_asked.add((peer, since))
                    self.asked[peer] = why
                    log.warning("%s: rank %d silent for %.1f s, its heartbeat stopped; asked the launcher to stop it",
                                self.who, peer, now - since)
            except Exception as exc:  # noqa: BLE001 - the store may be closing; looked at again next time
                log.debug("silence watch: %s", exc)
                self._live = self._live.another()
            self.looks += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.poll + 1)


class HungPeers:
    """A wait watch (:func:`~distrain.runtime.membership.watch_waits`) for a run that stops on any
    lost peer (``--min-workers`` equal to ``--workers``, torchrun, a GPU): a peer that stopped
    (SIGSTOP, a stuck training thread: its heartbeat stops, :class:`StuckWatch`) keeps its
    connections open, and a wait for it would last until ``--timeout`` (120 s by default). Once a
    wait of this thread has lasted ``stale_after`` seconds, the watch looks in the store, every
    ``every`` seconds, for a peer whose heartbeat stamped and then stopped for ``stale_after``
    seconds (or which was declared dead), and ends the wait with
    :class:`~distrain.errors.PeerTimeout` naming it: the run stops in one line a few
    seconds after the peer did. A peer that has not stamped yet (still importing) is not
    suspected; its wait keeps the ``--timeout`` ceiling.

    Example::

        watch_waits(HungPeers.from_env(me=0, peers=[0, 1, 2, 3]))
    """

    def __init__(self, host: str, port: int, me: int, peers: list[int], stale_after: float = 3.0,
                 every: float = 0.5, on_hung: Callable[[], None] | None = None) -> None:
        self.me, self.peers, self.stale_after, self.every = me, [p for p in peers if p != me], stale_after, every
        #: called before the wait ends (e.g. to close this process's connections, so that its
        #: pending operations and the peers' waits on it fail now)
        self.on_hung = on_hung
        self._live = Liveness(host, port, world_size=0, stale_after=stale_after)
        self._looked = -float("inf")

    @classmethod
    def from_env(cls, me: int, peers: list[int], **kwargs: Any) -> HungPeers | None:
        """The watch over the store at ``MASTER_ADDR:MASTER_PORT``; None without one."""
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        return cls(host, int(port), me, peers, **kwargs) if host and port and set(peers) - {me} else None

    def __call__(self, waited: float) -> bool:
        """Called by a wait after ``waited`` seconds: False (the wait goes on), or raises."""
        now = time.monotonic()
        if waited <= self.stale_after or now - self._looked < self.every:
            return False
        self._looked = now
        try:
            hung = self.hung()
        except Exception as exc:  # noqa: BLE001 - the store may be slow or closing: looked at again next time
            log.debug("hung-peer watch: %s", exc)
            self._live = self._live.another()
            return False
        if hung:
            peer, age = hung[0]
            if self.on_hung is not None:
                self.on_hung()
            said = "was declared dead" if age is None else f"has stamped no heartbeat for {age:.1f} s"
            raise PeerTimeout(f"rank {peer} {said} while rank {self.me} waited {waited:.1f} s for the others: "
                              "stopped or stuck, it holds the run")
        return False

    def hung(self) -> list[tuple[int, float | None]]:
        """The peers declared dead (age None) or whose heartbeat stamped once and then stopped for
        longer than ``stale_after`` (with its age in seconds), but for those that finished."""
        store, out = self._live.store, []
        for peer in self.peers:
            if dead_since(store, peer) is not None:
                out.append((peer, None))
            elif (age := heartbeat_age(store, peer)) is not None and age > self.stale_after \
                    and not store.check([FINISHED_KEY.format(peer)]):  # (a finished one's heartbeat ended with it)
                out.append((peer, age))
        return out
