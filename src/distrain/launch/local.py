"""Local launch: spawn one process per worker on this machine, meeting on loopback."""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch.distributed as dist

from distrain.assemble import survives as algorithm_survives
from distrain.comm.group import check_device, close_group, init_group, store_of
from distrain.config import TrainConfig
from distrain.emulation import NetworkSettings
from distrain.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    DistrainError,
    Interrupted,
    WorkerFailure,
)
from distrain.launch.checks import finished_before_start, preflight
from distrain.launch.common import (
    Restarts,
    check_port_free,
    claim_run_dir,
    configure_worker_logging,
    default_run_dir,
    enter_worker,
    exit_now,
    free_port,
    replace_earlier_run,
    run_role,
    server_count,
    stop_requests,
)
from distrain.runtime.forkserver import worker_context
from distrain.runtime.health import declare_dead, declared_dead, stopped_stamping
from distrain.runtime.membership import JOIN_ENV, RESTARTS_KEY, LeftOut
from distrain.runtime.process import EXIT_BAD_INPUT, EXIT_LEFT_OUT

log = logging.getLogger(__name__)

#: Exit status of a worker that stopped on SIGTERM / Ctrl-C after saving a checkpoint.
EXIT_INTERRUPTED = 130
#: Seconds workers get, after SIGTERM / Ctrl-C, to agree on a step, checkpoint and leave.
STOP_GRACE_S = 10.0
#: Where a failed worker leaves its reason, inside the run directory: ``rank-<r>.txt`` (one line,
#: which the launcher prints once for the run) and ``rank-<r>.log`` (the traceback, when there is one).
FAILURES = "failures"





def _worker(rank: int, world: int, cfg: TrainConfig, addr: str, port: int, run_dir: str, user: dict[str, Any],
            launcher: int, environ: dict[str, str], joining: bool = False) -> None:
    enter_worker(launcher, environ)  # nobody outlives the launcher, even one killed outright
    configure_worker_logging(rank)
    os.environ.update(MASTER_ADDR=addr, MASTER_PORT=str(port))  # heartbeats and stop requests meet in the store
    code = 0
    try:
        if joining:  # started again after its loss: it joins the others at a step's end
            from distrain.assemble import serve_again
            from distrain.train.loop import train

            os.environ.update({JOIN_ENV: "1", "RANK": str(rank)})
            if rank >= cfg.cluster.workers:  # a parameter server: it takes its range back
                serve_again(cfg, run_dir, rank)
            else:
                train(cfg, run_dir, **user)
        else:
            init_group(cfg, rank, world, store=store_of(addr, port, cfg.cluster.timeout))
            run_role(cfg, rank, world, run_dir, **user)
    except (ConfigError, DataError, CheckpointError) as exc:
        if rank == 0:  # every worker reads the same settings: one of them says what is wrong
            print(f"distrain: {exc}", file=sys.stderr)
        code = EXIT_BAD_INPUT
    except (Interrupted, KeyboardInterrupt):
        code = EXIT_INTERRUPTED
    except LeftOut as exc:
        _report(run_dir, rank, str(exc))
        code = EXIT_LEFT_OUT
    except DistrainError as exc:  # distrain's own one-line failures: a lost peer, a non-finite loss
        # The traceback matters only when the user's code raised underneath (e.g. a model factory).
        _report(run_dir, rank, str(exc), traceback.format_exc() if exc.__cause__ is not None else None)
        code = 1
    except Exception as exc:
        _report(run_dir, rank, last_line(exc), traceback.format_exc())
        code = 1
    finally:
        close_group()
    exit_now(code)


def last_line(exc: BaseException) -> str:
    """``Type: message``, as a traceback ends, on one line."""
    return " ".join(traceback.format_exception_only(type(exc), exc)[-1].split())


def _report(run_dir: str, rank: int, message: str, details: str | None = None) -> None:
    """Leave a failed worker's reason for the launcher, which tells the user once for the run:
    one line in ``failures/rank-<r>.txt``, the traceback (if any) in ``failures/rank-<r>.log``.
    Only when the run directory cannot take them does the worker print the line itself."""
    try:
        failures = Path(run_dir) / FAILURES
        failures.mkdir(exist_ok=True)
        if details:
            (failures / f"rank-{rank}.log").write_text(details)
        (failures / f"rank-{rank}.txt").write_text(message + "\n")
    except OSError:
        print(f"distrain: worker {rank}: {message}", file=sys.stderr)


def _describe_exit(run_dir: Path, rank: int, code: int, nworkers: int) -> str:
    role = f"worker {rank}" if rank < nworkers else f"server {rank - nworkers} (rank {rank})"
    note = run_dir / FAILURES / f"rank-{rank}.txt"
    if note.is_file():
        return f"{role} failed: {note.read_text().strip()}"
    if code < 0:
        return f"{role} was killed by {signal.Signals(-code).name}"
    return f"{role} exited with status {code}"


def _traceback_note(run_dir: Path, rank: int) -> str:
    """Where a failed worker's traceback is, as a note for the launcher's line ('' if none)."""
    log_file = run_dir / FAILURES / f"rank-{rank}.log"
    return f" (traceback in {log_file})" if log_file.is_file() else ""


class _Signals:
    """The launcher's SIGTERM / SIGINT: forward a stop request to every worker, once."""

    def __init__(self, procs: list[mp.Process]) -> None:
        self.procs = procs
        self.at: float | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.at is not None:
            return
        self.at = time.monotonic()
        self.forward(self.procs)  # Ctrl-C reached them already; SIGTERM from elsewhere did not

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def forward(self, procs: list[mp.Process]) -> None:
        """Send the stop request (SIGTERM) to those of ``procs`` that are running."""
        for p in procs:
            if p.is_alive() and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)


def _start_all(procs: list[mp.Process], signals: _Signals) -> list[mp.Process]:
    """Start the workers in rank order, none after a stop request (the first start waits about
    2 s for the fork server to import torch: a Ctrl-C or SIGTERM then found no worker to tell, and
    the run trained to its end before it was reported stopped); those started are told then.
    Returns the started ones (the first ranks)."""
    started: list[mp.Process] = []
    for p in procs:
        if signals.at is not None:
            break
        try:
            p.start()
        except (EOFError, OSError):
            if signals.at is None:
                raise
            break  # a Ctrl-C ended the fork server too (it was importing torch): nothing more to start
        started.append(p)
    if signals.at is not None:
        signals.forward(started)
    return started


def _supervise(procs: list[mp.Process], grace: float, run_dir: Path, nworkers: int,
               signals: _Signals | None = None, survivable: bool = False, store: dist.Store | None = None,
               restart: Any = None) -> None:
    """Wait for every worker; once one fails, give the others ``grace`` seconds, then stop them.

    After a SIGTERM / Ctrl-C, workers get ``STOP_GRACE_S`` seconds to agree on a step, save a
    checkpoint and leave; then they are killed. With ``survivable`` (an asynchronous algorithm
    that goes on without lost workers), a failed worker does not stop the others: every wait
    of theirs is bounded by --peer-timeout, and the run succeeds if they all finish. A failed
    process is declared dead in ``store`` as soon as it exits; ``restart(rank)`` (elastic runs
    with --max-restarts) starts it again, or returns None when no restart is left.
    """
    ranks = {p: r for r, p in enumerate(procs)}  # the process of each worker id, restarts included
    fenced: dict[mp.Process, str] = {}  # processes stopped here, silent while the others waited: why
    restarted: list[mp.Process] = []
    pending = list(procs)
    failed_at: float | None = None
    failures: list[tuple[int, int, mp.Process]] = []
    while pending:
        deadlines = [failed_at + grace if failed_at is not None else None,
                     signals.at + STOP_GRACE_S if signals is not None and signals.at is not None else None]
        due = min((d for d in deadlines if d is not None), default=None)
        if due is not None and time.monotonic() >= due:  # the survivors are stuck, or too slow to stop
            _stop(pending)
            break
        if failed_at is not None and store is not None and (silent := _silent(store, pending, ranks)):
            _stop(silent, wait=0.5)  # stopped or stuck: none would leave in the others' grace
            pending = [p for p in pending if p not in silent]
            continue
        if restart is not None and any(p.exitcode == 0 for p in ranks) \
                and all(declared_dead(store, ranks[p]) for p in pending):
            _stop(pending)  # the members finished; the others were left out (e.g. stopped) and lost
        if survivable and store is not None:
            for p, why in stop_requests(store, {p: ranks[p] for p in pending if p not in fenced and p.is_alive()}).items():
                fenced[p] = why
                p.kill()
        ready = multiprocessing.connection.wait([p.sentinel for p in pending], timeout=0.5)
        for p in [p for p in pending if p.sentinel in ready]:
            p.join()
            pending.remove(p)
            if p.exitcode not in (0, EXIT_INTERRUPTED):
                if p in fenced:
                    _report(str(run_dir), ranks[p], f"fell silent and was stopped: {fenced[p]}")
                failures.append((ranks[p], p.exitcode, p))
                declare_dead(store, ranks[p])  # the survivors of an elastic run know at once
                if not survivable or p.exitcode == EXIT_BAD_INPUT or (restart is not None and p.exitcode > 0
                                                                      and p.exitcode != EXIT_LEFT_OUT):
                    # (an elastic run goes on without a process that died, not one that failed: its error is the news)
                    if failed_at is None:  # the run stops: a worker started again (not of procs) has nothing
                        _stop([q for q in pending if q not in procs], wait=1.0)  # to say (it may wait to be
                        pending = [q for q in pending if q in procs]  # admitted): not the others' grace
                    failed_at = failed_at or time.monotonic()
                elif restart is not None and signals is not None and signals.at is None \
                        and not any(q.exitcode == 0 for q in ranks):  # nobody has finished: it can still join
                    again = restart(ranks[p])
                    if again is not None:
                        log.warning("%s; started again, it joins the others with their state",
                                    _describe_exit(run_dir, ranks[p], p.exitcode, nworkers))
                        ranks[again] = ranks[p]
                        pending.append(again)
                        restarted.append(p)
    if signals is not None and signals.at is not None:
        raise Interrupted(-1)
    finished = [r for p, r in ranks.items() if p.exitcode == 0]
    if failures and survivable and finished and len(finished) + len(failures) == len(ranks) \
            and all(code != EXIT_BAD_INPUT for _, code, _ in failures):
        for rank, code, _ in [f for f in failures if f[2] not in restarted]:
            log.warning("%s; the %s finished without it%s", _describe_exit(run_dir, rank, code, nworkers),
                        "other workers" if rank < nworkers else "workers and the other servers",
                        _traceback_note(run_dir, rank))
        return
    if failures:
        if all(code == EXIT_BAD_INPUT for _, code, _ in failures):
            raise SystemExit(EXIT_BAD_INPUT)
        killed = [(r, c) for r, c, _ in failures if c < 0]  # a process killed outright is the cause
        rank, code = (killed or [(r, c) for r, c, _ in failures])[0]
        raise WorkerFailure(f"{_describe_exit(run_dir, rank, code, nworkers)}; the run was stopped"
                            f"{_traceback_note(run_dir, rank)}")
    interrupted = [r for p, r in ranks.items() if p.exitcode == EXIT_INTERRUPTED]
    if interrupted:  # a worker was signalled directly: every one stopped at the agreed step
        raise Interrupted(-1)


def _silent(store: dist.Store, pending: list[mp.Process], ranks: dict[mp.Process, int]) -> list[mp.Process]:
    """Of ``pending``: the processes whose heartbeat stamped and then stopped for longer than its
    staleness (a stopped process, a stuck training thread), which will not leave by themselves
    once the run is stopping (best effort: none when the store cannot say)."""
    try:
        return [p for p in pending if p.is_alive() and stopped_stamping(store, ranks[p])]
    except Exception:  # noqa: BLE001 - the store may be closing: the others' grace ends it
        return []


def _stop(procs: list[mp.Process], wait: float = 5.0) -> None:
    procs = [p for p in procs if p.pid is not None]  # a failed start leaves the rest unstarted: its error is the news
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + wait
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def launch_local(cfg: TrainConfig, *, model_fn: Any = None, train_set: Any = None, test_set: Any = None,
                 loss_fn: Any = None) -> dict[str, Any]:
    """Train with ``cfg.cluster.workers`` local processes; returns the run summary.

    Workers are started from a fork server, as by ``spawn`` (see
    :func:`~distrain.runtime.forkserver.worker_context`), so ``model_fn``, ``loss_fn`` and the data sets
    must be picklable (module-level functions, not lambdas) when there is more than one worker.
    """
    if cfg.network.emulation == "netns":  # emulation: each worker in its own shaped network namespace
        from distrain.launch.netns import launch_netns

        return launch_netns(cfg, model_fn=model_fn, train_set=train_set, test_set=test_set, loss_fn=loss_fn)
    check_device(cfg)
    run_dir = default_run_dir(cfg, time.time())
    claim_run_dir(cfg, run_dir)
    user = {"model_fn": model_fn, "train_set": train_set, "test_set": test_set, "loss_fn": loss_fn}
    nprocs = cfg.cluster.workers + server_count(cfg)
    # every worker's emulated device and links (a --slow-worker or --slow-link naming no worker)
    NetworkSettings.from_config(cfg.network).resolve(nprocs, cfg.cluster.workers, cfg.algo.workers_per_node)
    if nprocs == 1:
        if cfg.run.overwrite:  # the data checks first: the earlier run goes only for one that can start
            preflight(cfg, train_set)
        replace_earlier_run(cfg, run_dir)
        return run_in_process(cfg, run_dir, **user)
    ctx = worker_context()  # (its fork server imports torch while the checks below run)
    preflight(cfg, train_set)
    finished = finished_before_start(cfg, run_dir, nprocs)
    if finished is not None:
        return finished
    addr = cfg.cluster.master_addr
    if cfg.cluster.master_port:
        check_port_free(addr, cfg.cluster.master_port)
    replace_earlier_run(cfg, run_dir)  # every check passed: --overwrite removes the earlier run now
    run_dir.mkdir(parents=True, exist_ok=True)  # only now: a start refused above leaves no directory behind
    shutil.rmtree(run_dir / FAILURES, ignore_errors=True)  # notes of an earlier attempt in this directory
    port = cfg.cluster.master_port or free_port(addr)
    # The store lives here, not in a worker: heartbeats, stop requests and failure notes outlive
    # any worker that dies.
    store = store_of(addr, port, cfg.cluster.timeout, host=True)
    procs = [ctx.Process(target=_worker, name=f"distrain-worker-{rank}",
                         args=(rank, nprocs, cfg, addr, port, str(run_dir), user, os.getpid(), dict(os.environ)))
             for rank in range(nprocs)]
    signals = _Signals(procs).install()
    survives = algorithm_survives(cfg)
    if survives and cfg.cluster.max_restarts:
        store.set(RESTARTS_KEY, str(cfg.cluster.max_restarts))  # the members look for joiners at every step

    def start_again(rank: int) -> mp.Process:
        p = ctx.Process(target=_worker, name=f"distrain-worker-{rank}",
                        args=(rank, nprocs, cfg, addr, port, str(run_dir), user, os.getpid(), dict(os.environ), True))
        procs.append(p)  # signalled and stopped with the others
        p.start()
        return p

    try:
        started = _start_all(procs, signals)
        _supervise(started, grace=min(cfg.cluster.timeout, 30.0), run_dir=run_dir, nworkers=cfg.cluster.workers,
                   signals=signals, survivable=survives, store=store,
                   restart=Restarts(cfg.cluster.max_restarts, start_again, cfg.cluster.workers, store)
                   if survives else None)
    except Interrupted:
        from distrain.runtime.checkpoint import CheckpointStore

        saved = CheckpointStore(run_dir, 0, nprocs).latest_complete()
        raise Interrupted(-1 if saved is None else saved, run_dir) from None
    finally:
        signals.uninstall()
        _stop(procs)  # nobody outlives the launcher
        del store
    return json.loads((run_dir / "summary.json").read_text())


def run_in_process(cfg: TrainConfig, run_dir: str | Path, **user: Any) -> dict[str, Any]:
    """One worker, in this process: a world of size 1 with an in-memory store."""
    from distrain.train.loop import train

    check_device(cfg, processes=1)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        raise ConfigError("--workers", "a process group already exists in this process; use torchrun or call fit() outside it")
    init_group(cfg, 0, 1)
    try:
        summary = train(cfg, run_dir, **user)
    finally:
        close_group()
    assert summary is not None
    return summary
