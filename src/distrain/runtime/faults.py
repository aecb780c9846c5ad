"""What the worker loop does when something goes wrong: signals, lost peers, non-finite values.

Fault injection for tests (environment variables, read by every worker):

    DISTRAIN_INJECT_NAN='RANK:STEP'    that worker's loss becomes NaN at that step
    DISTRAIN_INJECT_KILL='RANK:STEP'   that process (a worker, or a parameter server by its
                                       global rank) kills itself with SIGKILL at that step
                                       (not after a torchrun restart)
    DISTRAIN_INJECT_STOP='RANK:STEP'   that process stops itself with SIGSTOP at that step (a hang;
                                       the test sends SIGCONT)
    DISTRAIN_INJECT_WEDGE='RANK:STEP:S' that worker's training thread blocks for S seconds at that
                                       step, in a call of no library (a deadlock; its heartbeat
                                       thread goes on)
    DISTRAIN_INJECT_KILL_IN='PHASE:ID' worker ID kills itself with SIGKILL in an elastic run's
                                       membership change: ``admission`` (a member, as the
                                       members begin to admit a joiner), ``handover`` (a
                                       member, once the group with the joiner is open, before
                                       it takes their state), ``entry`` (the joiner, once
                                       admitted; once per run: not when the mark file exists),
                                       ``recovery`` (a survivor of a loss, once the survivors
                                       agreed, before their new group opens), ``meet`` (a
                                       member, once every member is ready to open the new
                                       group, before its rendezvous), ``link`` (a
                                       parameter server, ID its global rank, as it opens its
                                       link with a joiner), ``node-broadcast`` (a worker of
                                       hierarchical parameter servers, as it begins its node's
                                       first broadcast of the parameters: a leader once it
                                       pulled them, another once it sent its gradient),
                                       ``node-groups`` (a worker of parameter servers, or
                                       of an elastic hierarchical all-reduce, as it is about
                                       to make its node groups), ``build`` (a member of an
                                       elastic run, after a change of members, before it
                                       builds its algorithm over the new group),
                                       ``node-stop`` (a worker of synchronous parameter
                                       servers, once it told the first server its training
                                       is over), ``gossip-groups`` (a worker of adpsgd or
                                       prague, as it is about to make its gossip groups),
                                       ``final-model`` (a worker, as ``finish()`` begins to
                                       make the final model, after the members' last barrier),
                                       ``start-broadcast`` (a worker, as the members of its
                                       first group begin to take rank 0's parameters),
                                       ``regroup`` (an all-reduce worker, after its first
                                       step's all-reduce, as the workers agree on the buckets)
    DISTRAIN_INJECT_KILL_ANSWERING='RANK:STEP:N'  synchronous parameter server RANK (global rank)
                                       kills itself with SIGKILL once it answered step STEP (as
                                       its workers count them) to its first N live workers and
                                       they pushed their next step: the others never get it
    DISTRAIN_INJECT_KILL_AFTER='RANK:S' that process (global rank) kills itself with SIGKILL S seconds
                                       after its fault watch started (about when training starts),
                                       wherever it is then; not after a restart
    DISTRAIN_INJECT_MARK=PATH          where the injected fault writes its time and process id
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from distrain.errors import PeerTimeout, WorkerFailure
from distrain.runtime.files import atomic_write
from distrain.runtime.health import Heartbeat

T = TypeVar("T")

log = logging.getLogger(__name__)

# Under torchrun the store outlives a restart: keys carry the attempt, so none is read twice.
_ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
STOP_KEY = f"distrain/{_ATTEMPT}/stop_step"
FAILURE_KEY = f"distrain/{_ATTEMPT}/failure"
#: A second SIGTERM / SIGINT this long after the first stops a worker at once; sooner, it is the
#: same request arriving twice (Ctrl-C reaches every process, and the launcher forwards it too).
REPEAT_WINDOW_S = 3.0
#: Words in the errors gloo raises when a peer is gone or silent.
COMM_ERROR_WORDS = ("connection", "closed", "reset", "timed out", "timeout", "broken pipe", "gloo", "peer", "socket")


class NonFinite(Exception):
    """Raised where a non-finite value is found before it is sent (``what``: loss, gradient)."""

    def __init__(self, what: str) -> None:
        self.what = what
        super().__init__(f"non-finite {what}")


class SignalFlag:
    """A flag that a signal handler sets and the loop reads: :class:`threading.Event` without
    its lock.

    A handler runs in the main thread between two bytecodes, also between two of an earlier
    handler's: Ctrl-C and the launcher's forwarded SIGTERM arrive together, and a second
    ``Event.set`` that runs inside the first one's ``with self._cond`` waits for a lock that its
    own thread holds, for ever. Assigning an attribute takes no lock.
    """

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set


class StopRequest:
    """Turns SIGTERM / SIGINT into a request that the loop honours at a step boundary.

    Synchronous algorithms must stop at the same step on every worker, or the ones that go on
    would wait for the ones that left. The first worker to see the request proposes
    ``step + 2`` in the rendezvous store (compare-and-set, so one proposal wins); each worker
    runs until that step, checkpoints, and leaves. Every worker is signalled (the launchers
    forward the signal; Ctrl-C reaches the whole process group), and workers are at most one step
    apart in a synchronous algorithm, so nobody has passed the agreed step.
    """

    def __init__(self) -> None:
        self.requested = SignalFlag()  # set from a signal handler: no lock (see SignalFlag)
        self._first: float | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if self._first is not None and now - self._first > REPEAT_WINDOW_S:  # asked again: stop now
            raise KeyboardInterrupt
        if self._first is None:
            self._first = now
        self.requested.set()

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def agreed_step(self, step: int, synchronous: bool, store: dist.Store | None = None) -> int:
        """The step at which every worker stops: ours + 2 (or the first proposal), or ours if alone."""
        if not synchronous:
            return step
        store = store if store is not None else store_client()
        if store is None:
            return step
        value = store.compare_set(STOP_KEY, "", str(step + 2))
        return int(value.decode() if isinstance(value, bytes) else value)


def store_client(timeout: float = 10.0) -> dist.TCPStore | None:
    """A client of the rendezvous store (None for a single process or no store address). A
    process without a default group has one when the store is named: a worker that joined a
    parameter-server run talks to the servers over a link of its own."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port or (dist.is_initialized() and dist.get_world_size() == 1):
        return None
    return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout))


def start_heartbeat(rank: int | None = None, world: int | None = None, ceiling: float | None = None) -> Heartbeat | None:
    """Stamp liveness in the rendezvous store as ``rank`` of ``world`` (default: this process's
    place in the default group; none for a single process). With ``ceiling`` (``--timeout``),
    only while the calling thread is not stuck (see :class:`~distrain.runtime.health.StuckWatch`)."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    world = dist.get_world_size() if world is None else world
    if not host or not port or world == 1:
        return None
    return Heartbeat(host, int(port), dist.get_rank() if rank is None else rank, world, ceiling=ceiling).start()


def announce_failure(store: dist.Store | None, message: str) -> None:
    """Leave this worker's reason for stopping in the store, so peers can quote it (best effort)."""
    try:
        if store is not None:
            store.compare_set(FAILURE_KEY, "", message)
    except Exception as exc:  # noqa: BLE001 - the store may be gone already
        log.debug("could not record the failure: %s", exc)


def announced_failure(store: dist.Store | None) -> str | None:
    """The first reason a worker left in the store, if any."""
    try:
        if store is not None and store.check([FAILURE_KEY]):
            return store.get(FAILURE_KEY).decode() or None
    except Exception:  # noqa: BLE001 - the store may be gone
        return None
    return None


def is_comm_error(exc: BaseException) -> bool:
    """Whether an exception looks like a collective or point-to-point failing (a peer gone)."""
    if isinstance(exc, (PeerTimeout, getattr(dist, "DistError", ()))):
        return True
    return isinstance(exc, RuntimeError) and any(w in str(exc).lower() for w in COMM_ERROR_WORDS)


def lost_peer(exc: BaseException, rank: int, step: int, heartbeat: Heartbeat | None, role: str = "worker",
              store: dist.Store | None = None) -> WorkerFailure:
    """A one-line failure naming the step and the rank that most likely stopped."""
    cause = announced_failure(store)
    suspects = heartbeat.wait_for_suspects() if heartbeat is not None and cause is None else []
    if cause is not None:
        return WorkerFailure(f"{role} {rank} stopped at step {step} because {cause}")
    who = f"rank {', '.join(map(str, suspects))}" if suspects else "an unknown rank"
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    reason = re.sub(r"^\[[^\]]*\]\s*", "", reason)  # gloo's source location
    return WorkerFailure(f"{role} {rank} lost contact with {who} at step {step} ({reason[:160]})")


def all_finite(tensor: torch.Tensor) -> bool:
    """True when every element of ``tensor`` is finite.

    A sum screens: a NaN or an infinity anywhere makes it non-finite (IEEE arithmetic has no way
    back to a finite value), so a finite sum settles it. Only a non-finite sum, which finite
    values can also give by overflowing, pays for the exact check: the minimum and the maximum
    in one pass (a NaN turns both into NaN, an infinity shows in one of them). Measured here on
    one CPU thread: 1.7 us against 10.4 us for the exact check on a 14k-float bucket, 147 us
    against 245 us on a million floats; ``isfinite(t).all()``, which writes a boolean copy,
    took 2.5 ms.
    """
    values = _stored(tensor)
    if not values.numel() or math.isfinite(float(values.sum())):
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(values))).all())


def grads_finite(params: list[torch.nn.Parameter]) -> bool:
    """True when every gradient is finite: one sum per gradient and one sync, the exact check
    (:func:`all_finite`) only for a gradient whose sum is not finite."""
    grads = [p.grad for p in params if p.grad is not None and p.grad.numel()]
    if not grads:
        return True
    sums = torch.stack([_stored(g).sum().double() for g in grads])
    if math.isfinite(float(sums.sum())):
        return True
    return all(all_finite(g) for g, s in zip(grads, sums.tolist(), strict=True) if not math.isfinite(s))


def _stored(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values, a sparse tensor's stored ones."""
    return tensor.coalesce().values() if tensor.is_sparse else tensor


def nonfinite_error(rank: int, step: int, what: str = "loss") -> WorkerFailure:
    return WorkerFailure(f"worker {rank}: non-finite {what} at step {step}; stopped before sending anything "
                         "(use --on-nonfinite skip to skip such steps)")


def _injected(variable: str, rank: int, step: int) -> bool:
    spec = os.environ.get(variable)
    if not spec:
        return False
    r, s = (int(v) for v in spec.split(":"))
    return r == rank and s == step


def injected_nan(rank: int, step: int) -> bool:
    """Fault injection for tests: DISTRAIN_INJECT_NAN='rank:step' poisons that worker's loss once."""
    return _injected("DISTRAIN_INJECT_NAN", rank, step)


def _mark_injected() -> None:
    mark = os.environ.get("DISTRAIN_INJECT_MARK")  # when it happened (and who), for tests
    if mark:
        atomic_write(mark, f"{time.time()!r} {os.getpid()}".encode())  # whole, or not there


#: A blocking call compiled outside distrain's files: to the stuck watch it is a library call
#: that never returns, not one of distrain's waits.
_WEDGE = compile("threading.Event().wait(seconds)", "<injected wedge>", "eval")


def maybe_injected_kill(rank: int, step: int) -> None:
    """Fault injection for tests: DISTRAIN_INJECT_KILL='rank:step' kills this process outright;
    DISTRAIN_INJECT_STOP='rank:step' stops it (SIGSTOP) until someone sends SIGCONT;
    DISTRAIN_INJECT_WEDGE='rank:step:seconds' blocks the calling thread for that long."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or os.environ.get("DISTRAIN_JOIN"):
        return  # a worker started again after its loss is not killed twice
    for variable, sig in (("DISTRAIN_INJECT_KILL", signal.SIGKILL), ("DISTRAIN_INJECT_STOP", signal.SIGSTOP)):
        if _injected(variable, rank, step):
            _mark_injected()
            os.kill(os.getpid(), sig)
    wedge = os.environ.get("DISTRAIN_INJECT_WEDGE", "").split(":")
    if len(wedge) == 3 and (int(wedge[0]), int(wedge[1])) == (rank, step):
        _mark_injected()
        eval(_WEDGE, {"threading": threading, "seconds": float(wedge[2])})  # noqa: S307 - our own constant code


def injected_answers(rank: int, step: int) -> int | None:
    """Fault injection for tests (DISTRAIN_INJECT_KILL_ANSWERING='rank:step:n'): how many of its
    live workers server ``rank`` answers step ``step`` before it dies (:func:`kill_now`); None:
    all of them, it does not die there."""
    spec = os.environ.get("DISTRAIN_INJECT_KILL_ANSWERING", "").split(":")
    if len(spec) != 3 or (int(spec[0]), int(spec[1])) != (rank, step) or os.environ.get("DISTRAIN_JOIN"):
        return None
    return int(spec[2])


def kill_now() -> None:
    """Fault injection for tests: this process dies here (SIGKILL), its mark written first."""
    _mark_injected()
    os.kill(os.getpid(), signal.SIGKILL)


def arm_timed_kill(rank: int) -> None:
    """Fault injection for tests and benchmarks (DISTRAIN_INJECT_KILL_AFTER='rank:seconds'): kill
    process ``rank`` that many seconds from now, from a thread of its own, whatever it is doing
    then (a real failure does not wait for a step to begin); not a process started again."""
    spec = os.environ.get("DISTRAIN_INJECT_KILL_AFTER", "").split(":")
    if len(spec) != 2 or int(spec[0]) != rank:
        return
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or os.environ.get("DISTRAIN_JOIN"):
        return
    timer = threading.Timer(float(spec[1]), kill_now)
    timer.daemon = True
    timer.start()


def inject_kill_in(phase: str, worker: int) -> None:
    """Fault injection for tests: DISTRAIN_INJECT_KILL_IN='phase:id' kills worker ``id`` when
    it reaches ``phase`` of a membership change (see the module's docstring): a member in its
    first life, a joiner (``entry``) in its first life that joins."""
    spec = os.environ.get("DISTRAIN_INJECT_KILL_IN", "").split(":")
    if len(spec) != 2 or spec[0] != phase or int(spec[1]) != worker:
        return
    joiner = bool(os.environ.get("DISTRAIN_JOIN"))
    mark = os.environ.get("DISTRAIN_INJECT_MARK")
    if joiner != (phase == "entry") or (joiner and mark and os.path.exists(mark)):
        return
    kill_now()


class FaultWatch:
    """One worker's (or server's) guard for a run: a stop request, heartbeats, and the step it
    is at, so that whatever goes wrong ends in one line naming the step and the cause.

    Example::

        watch = FaultWatch(rank=1)
        try:
            ...                                # the loop sets watch.step as it goes
        except BaseException as exc:
            raise watch.explain(exc) from exc  # a lost peer becomes "worker 1 lost contact with rank 3 at step 41 (...)"
        finally:
            watch.close()
    """

    def __init__(self, rank: int, role: str = "worker", world: int | None = None, timeout: float | None = None) -> None:
        self.rank, self.role = rank, role
        self._step = 0
        self.stop = StopRequest().install()
        self.store: dist.Store | None = None
        try:
            self.store = store_client()  # made now, while the store is surely up; reused
        except Exception as exc:  # noqa: BLE001 - then no stop agreement or failure notes
            log.warning("no rendezvous store for stop requests and failure notes: %s", exc)
        self.heartbeat = start_heartbeat(rank, world, ceiling=timeout)
        arm_timed_kill(rank)  # fault injection for tests and benchmarks

    @property
    def step(self) -> int:
        """The step under way (set by the loop as it goes: each new one is measured)."""
        return self._step

    @step.setter
    def step(self, step: int) -> None:
        if step != self._step and self.heartbeat is not None:
            self.heartbeat.progress()
        self._step = step

    def explain(self, exc: BaseException) -> BaseException:
        """The exception to raise in place of ``exc``: lost peers named, own failures announced."""
        if isinstance(exc, WorkerFailure):
            cause = exc.__cause__
            if cause is not None and is_comm_error(cause):  # e.g. a gossip thread's exchange failed
                return lost_peer(cause, self.rank, self.step, self.heartbeat, self.role, self.store)
            announce_failure(self.store, str(exc))  # e.g. a non-finite loss: the peers quote it
            return exc
        if is_comm_error(exc):
            return lost_peer(exc, self.rank, self.step, self.heartbeat, self.role, self.store)
        return exc

    def agreed_step(self, step: int, synchronous: bool) -> int:
        return self.stop.agreed_step(step, synchronous, self.store)

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` under this watch: an exception is replaced by its explanation (see
        :meth:`explain`), and the watch is closed whatever happens."""
        try:
            return fn(*args)
        except Exception as exc:
            replacement = self.explain(exc)
            if replacement is exc:
                raise
            raise replacement from exc
        finally:
            self.close()

    def close(self) -> None:
        self.stop.uninstall()
        if self.heartbeat is not None:
            self.heartbeat.stop()
