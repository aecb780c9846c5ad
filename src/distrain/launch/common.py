"""What every launcher does: pick a run directory, open the process group, run the loop."""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import logging
import os
import select
import shutil
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from distrain.config import TrainConfig, check_run_dir
from distrain.errors import ConfigError
from distrain.launch.preload import PR_SET_PDEATHSIG
from distrain.runtime.health import take_fence_request
from distrain.runtime.membership import SERVERS_RETURN_KEY

log = logging.getLogger(__name__)


def default_run_dir(cfg: TrainConfig, stamp: float) -> Path:
    """``runs/<name>`` with a name from the algorithm, data set and start time."""
    if cfg.run.run_dir:
        return Path(cfg.run.run_dir)
    name = cfg.run.name or "{}-{}-{}".format(
        cfg.algo.algorithm, cfg.data.dataset, datetime.datetime.fromtimestamp(stamp).strftime("%Y%m%d-%H%M%S"))
    return Path("runs") / name


#: What a run writes into its directory; --overwrite removes these and nothing else.
RUN_FILES = ("config.json", "summary.json", "model.pt", "metrics", "checkpoints", "failures", "report", "logs", "netns")


def holds_a_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds what an earlier run wrote (its config, results or checkpoints)."""
    return any((run_dir / name).exists() for name in ("config.json", "summary.json", "metrics", "checkpoints"))


def claim_run_dir(cfg: TrainConfig, run_dir: Path) -> None:
    """Refuse a run directory that holds an earlier run unless the user resumes or overwrites it.

    Starting afresh beside an earlier run's checkpoints would let a later ``--resume auto`` pick
    up a step of the other run; with ``--overwrite`` the earlier run's files are removed, but only
    by :func:`replace_earlier_run`, once every other check has passed (a typo in another flag
    must not cost the earlier run). Called once, before any worker starts (by the launcher, or
    torchrun's rank 0); it first checks that the directory is, or can be made, a writable directory.
    """
    check_run_dir(run_dir)
    if cfg.run.resume != "none" or not holds_a_run(run_dir):
        return
    if not cfg.run.overwrite:
        raise ConfigError("--run-dir", f"{str(run_dir)!r} holds an earlier run; continue it with --resume auto, "
                          "or replace it with --overwrite")


def replace_earlier_run(cfg: TrainConfig, run_dir: Path) -> None:
    """With ``--overwrite`` (a run starting afresh), remove the earlier run's files from
    ``run_dir`` (the user's own files stay); :func:`claim_run_dir` has allowed it. Called once the
    run's settings have passed every check the launcher makes, just before the workers start."""
    if cfg.run.resume != "none" or not cfg.run.overwrite or not holds_a_run(run_dir):
        return
    for name in RUN_FILES:
        target = run_dir / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()




def stop_requests(store: Any, running: dict[Any, int]) -> dict[Any, str]:
    """Of the ``running`` processes (each with its rank), those another asked to have stopped,
    each with why: alive, but silent while it waited for them
    (:class:`~distrain.runtime.health.SilenceWatch`); the requests are taken. Killed, their
    connections close, and the others go on without them as without any process that died.
    Empty once the store cannot answer (the run is ending anyway)."""
    asked = {}
    for proc, rank in running.items():
        try:
            why = take_fence_request(store, rank)
        except Exception as exc:  # noqa: BLE001 - the store is closing
            log.debug("could not read the stop requests: %s", exc)
            break
        if why is not None:
            asked[proc] = why
    return asked


def free_port(addr: str = "127.0.0.1") -> int:
    """A port that is free right now on ``addr``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, 0))
        except (OSError, OverflowError) as exc:
            raise ConfigError("--master-addr", f"cannot listen on {addr} ({getattr(exc, 'strerror', None) or exc}); "
                              "a local run needs an address of this machine, e.g. 127.0.0.1") from None
        return s.getsockname()[1]


def check_port_free(addr: str, port: int) -> None:
    free_port(addr)  # the address itself must be this machine's
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, port))
        except OSError as exc:
            raise ConfigError("--master-port", f"{addr}:{port} is not available ({exc.strerror}); pick another port or 0 for a free one") from None


def wait_for_master(addr: str, port: int, timeout: float) -> None:
    """Wait until ``addr:port`` accepts connections; ConfigError naming --master-addr after
    ``timeout`` seconds (probed quietly: the store client logs every failed attempt)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise ConfigError("--master-addr", f"no rendezvous answered at {addr}:{port} within --timeout "
                                  f"{timeout:g} s ({exc.strerror or exc}); is rank 0 running and reachable "
                                  "from here?") from None
            time.sleep(0.2)





def configure_worker_logging(rank: int) -> None:
    """Set up what a worker process prints: once per run, not once per worker.

    Log lines carry the worker's rank. distrain's warnings about settings (legal but
    pointless ones, e.g. a warm-up longer than the run) come from settings every worker shares,
    so only rank 0 shows them. Progress bars get a thread lock instead of tqdm's default
    multiprocessing one: a worker leaves through :func:`exit_now`, which skips the finalizer that
    would release that lock's semaphore, and the launcher's resource tracker would then report it
    as leaked when the run ends.
    """
    logging.basicConfig(level=os.environ.get("DISTRAIN_LOG", "WARNING").upper(),
                        format=f"[worker {rank}] %(levelname)s %(name)s: %(message)s")
    if rank != 0:
        warnings.filterwarnings("ignore", category=UserWarning, module=r"distrain(\.|$)")
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def exit_now(code: int) -> None:
    """Leave a worker process without running interpreter teardown.

    Everything a worker writes is closed (and atomically renamed) before this point; what is
    left are the backend's threads, whose destructors at interpreter exit sometimes abort the
    process ("terminate called without an active exception") after a successful run.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


#: How often the fallback watch (no prctl) checks that the launcher is still there.
PARENT_POLL_S = 0.5


def die_with_parent(parent: int, use_prctl: bool = True) -> str:
    """End this worker when its launcher (process ``parent``) dies, however it dies (SIGKILL too).

    A worker whose launcher is gone has nobody to report to, and without this it would keep
    training (and holding ports and memory) until its own timeouts. On Linux the kernel sends
    SIGKILL at once (``PR_SET_PDEATHSIG``); elsewhere a daemon thread checks every
    ``PARENT_POLL_S`` seconds whether the parent changed, and exits with a one-line message.
    Returns how it watches: ``"prctl"`` or ``"poll"`` (also with ``use_prctl=False``).

    Example::

        die_with_parent(os.getppid())   # first thing in a spawned worker
    """
    how = "poll"
    try:
        if not use_prctl:
            raise OSError("prctl not wanted")
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
            how = "prctl"
    except (OSError, AttributeError):  # not Linux: no prctl
        pass
    if os.getppid() != parent:  # the launcher died before the watch was set
        _orphaned(parent)
    if how == "poll":
        threading.Thread(target=_watch_parent, args=(parent,), name="distrain-parent-watch", daemon=True).start()
    return how


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    _orphaned(parent)


def enter_worker(launcher: int, environ: dict[str, str]) -> None:
    """First thing in a worker of :func:`~distrain.runtime.forkserver.worker_context`: the
    launcher's environment as it started the worker, and the worker's end with the launcher's
    (process ``launcher``), however that ends (:func:`die_with_parent` for a child of the
    launcher, :func:`die_with` for a child of its fork server, which outlives the launcher while
    any worker lives)."""
    os.environ.clear()
    os.environ.update(environ)
    if signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []):  # forked by the fork server, which
        # started with SIGINT held (see worker_context): ignore it, as the server does, until the
        # stop request takes it over (a Ctrl-C raised before this worker's work began was a traceback)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if os.getppid() == launcher:
        die_with_parent(launcher)
    else:
        die_with(launcher)


def die_with(process: int, use_pidfd: bool = True) -> str:
    """End this process when process ``process`` (not its parent) ends, however it ends: a
    daemon thread waits on its pidfd (Linux 5.3 and later: at once), or checks every
    ``PARENT_POLL_S`` seconds that it still exists; either way exits with a one-line message.
    Returns how it watches: ``"pidfd"`` or ``"poll"`` (also with ``use_pidfd=False``)."""
    try:
        if not use_pidfd:
            raise OSError("pidfd not wanted")
        handle = os.pidfd_open(process)
    except ProcessLookupError:  # gone already
        _orphaned(process)
    except (AttributeError, OSError):  # no pidfd here: poll
        threading.Thread(target=_poll_process, args=(process,), name="distrain-launcher-watch", daemon=True).start()
        return "poll"
    threading.Thread(target=_wait_pidfd, args=(handle, process), name="distrain-launcher-watch", daemon=True).start()
    return "pidfd"


def _wait_pidfd(handle: int, process: int) -> None:
    select.select([handle], [], [])  # readable once the process has ended
    _orphaned(process)


def _poll_process(process: int) -> None:
    while True:
        try:
            os.kill(process, 0)
        except ProcessLookupError:
            _orphaned(process)
        except PermissionError:  # alive, someone else's
            pass
        time.sleep(PARENT_POLL_S)


def _orphaned(parent: int) -> None:
    print(f"distrain: process {os.getpid()}: the launcher (process {parent}) is gone; exiting", file=sys.stderr)
    exit_now(1)


def server_count(cfg: TrainConfig) -> int:
    """Processes besides the training workers: the parameter servers of --algorithm ps."""
    return cfg.ps.servers if cfg.algo.algorithm == "ps" else 0


def run_role(cfg: TrainConfig, rank: int, world: int, run_dir: str | Path, **user: Any) -> dict[str, Any] | None:
    """Run this process's part: a training worker, or (the last --servers ranks) a parameter server.

    Every process must call this after the default group exists: creating the workers' group is
    collective.
    """
    from distrain.assemble import serve
    from distrain.train.loop import train

    servers = server_count(cfg)
    workers = world - servers
    if workers < 1:
        raise ConfigError("--servers", f"leaves no training workers in a world of {world} processes")
    group = dist.new_group(list(range(workers))) if servers else None
    if rank >= workers:
        serve(cfg, run_dir)
        return None
    return train(cfg, run_dir, workers_group=group, **user)


@dataclass
class Restarts:
    """How many lost workers may still be started again (``--max-restarts``), and how:
    ``start(rank)`` starts a process that joins the others. Only the first ``workers`` ranks are
    workers (None: every rank); a lost parameter server is started again only where the servers
    announced in ``store`` that a lost one's range is taken over and may return
    (:data:`~distrain.runtime.membership.SERVERS_RETURN_KEY`)."""

    left: int
    start: Callable[[int], Any]
    workers: int | None = None
    store: Any = None
    #: ``fresh(rank)`` starts a process in the place of one lost before it began to open the
    #: default group (nobody waits for it in a run yet: it starts as the first one did)
    fresh: Callable[[int], Any] | None = None

    def __call__(self, rank: int) -> Any:
        """The process started again for ``rank``, or None when no restart is left (or it is a
        server's that cannot return)."""
        if self.left <= 0 or (self.workers is not None and rank >= self.workers and not self._servers_return()):
            return None
        self.left -= 1
        return self.start(rank)

    @property
    def in_place_left(self) -> bool:
        """Whether a lost process may still be started in its place (see ``fresh``)."""
        return self.left > 0 and self.fresh is not None

    def in_place(self, rank: int) -> Any:
        """A process started as the first one of ``rank`` was (see ``fresh``), or None when no
        restart is left."""
        if not self.in_place_left:
            return None
        self.left -= 1
        return self.fresh(rank)

    def _servers_return(self) -> bool:
        try:
            return self.store is not None and self.store.check([SERVERS_RETURN_KEY])
        except Exception:  # noqa: BLE001 - a store that cannot answer: no server restart
            return False
