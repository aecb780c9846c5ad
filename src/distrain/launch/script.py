"""``distrain launch``: run the user's own training script as N processes on this machine.

Each process gets the environment torchrun would set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT`` of a store this launcher hosts on 127.0.0.1) and the emulated
network's settings in :data:`~distrain.distributed.SETTINGS_ENV`, which :func:`distrain.wrap` reads.
Each process is forked from one that imported torch once (:mod:`distrain.launch.preload`) unless
``--no-preload`` or ``--emulation netns`` asks for a fresh ``python`` per rank. Output lines carry the rank. When one process fails, the others are stopped and one line names
the rank and the cause; Ctrl-C stops them all; nothing is left running.

On several machines (:class:`Nodes`: ``--nnodes N --node-rank R --master-addr HOST
--master-port PORT``, run on each) every node's launcher starts its ``--workers`` processes as
ranks ``R * workers ...``; node 0's launcher hosts the store on ``HOST:PORT``. A launcher whose
job fails announces it in the store and the other nodes' launchers stop theirs; node 0's waits
for the others to finish before its store goes. In an elastic run a lost node (its machine, or
its launcher, gone) leaves the others going on, and ``--join`` starts a node's workers again: they
enter the running job at a step's end with a live member's state.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from distrain.comm.group import store_of
from distrain.config import TrainConfig
from distrain.distributed import SETTINGS_ENV
from distrain.emulation import NetworkSettings
from distrain.errors import ConfigError
from distrain.launch.common import (
    Restarts,
    check_port_free,
    free_port,
    stop_requests,
    wait_for_master,
)
from distrain.launch.preload import Forked, Starter, killed_with_parent, starter
from distrain.runtime.health import declare_dead, declared_dead
from distrain.runtime.membership import JOIN_ENV, RESTARTS_KEY, elastic_run, opening
from distrain.runtime.process import EXIT_BAD_INPUT, EXIT_LEFT_OUT

#: How often the launcher of an elastic job looks for processes another asked to have stopped.
FENCE_POLL_S = 0.5
#: Seconds the other processes get to stop after a failure or Ctrl-C before they are killed.
STOP_GRACE_S = 5.0
#: Lines of each process's stderr kept for the failure message.
TAIL_LINES = 20
#: torch.distributed's prefix on an uncaught exception's lines (the rank is named already).
_TORCH_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")
#: The first line of a Python warning ("FILE:LINE: SomeWarning: text"; the source line follows,
#: indented): never the cause of a failure, so not kept for its message.
_WARNING_LINE = re.compile(r"^\S.*:\d+: \w*Warning: ")
#: A failure that is the consequence of another process's: its connection to a peer that died
#: was closed (gloo, NCCL). The launcher waits up to ``ROOT_CAUSE_WAIT_S`` for the failure that
#: caused it, on this node or another, and names that one instead.
_LOST_PEER = re.compile(r"Connection (closed|reset) by peer|Broken pipe|remote process exited", re.IGNORECASE)
ROOT_CAUSE_WAIT_S = 3.0
#: Seconds a rank killed before it opened the group, with no restart left, waits for another to
#: open it (``wrap()``): an elastic run then goes on without it; after them, or in a run that is
#: not elastic (a script that opens its group itself, whose peers wait for it there), it is the
#: run's failure.
UNOPENED_GRACE_S = 10.0


@dataclass
class Target:
    """What each process runs: a script file or a module (``-m``), with its arguments."""

    script: str | None = None
    module: str | None = None
    args: list[str] = field(default_factory=list)

    def command(self) -> list[str]:
        head = ["-m", self.module] if self.module else [self.script or ""]
        return [sys.executable, "-u", *head, *self.args]

    def check(self) -> None:
        if self.module:
            # the top-level package only: finding a submodule would import its parents here
            top = self.module.partition(".")[0]
            if not top or importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is None and \
                    top not in sys.builtin_module_names:
                raise ConfigError("-m", f"no module named {top!r} on this Python's path (from {os.getcwd()})")
            return
        if not self.script:
            raise ConfigError("SCRIPT", "name the training script to run (or -m MODULE)")
        path = Path(self.script)
        if not path.is_file():
            raise ConfigError("SCRIPT", f"{self.script!r} is not a file")


def check_settings(settings: dict[str, Any], workers: int, servers: int = 0) -> TrainConfig:
    """The emulated network's settings as ``wrap()`` will read them, checked before any process
    starts (ConfigError naming the flag); the config they make."""
    if not isinstance(servers, int) or isinstance(servers, bool) or servers < 0:
        raise ConfigError("--servers", f"must be an integer >= 0, got {servers!r}")
    cfg = TrainConfig(**settings)
    cfg.set("workers", workers)
    cfg.network.validate()
    # every rank's emulated device and links: a --slow-worker or --slow-link naming no worker
    NetworkSettings.from_config(cfg.network).resolve(workers + servers, workers, 0)
    cfg.cluster.validate()
    if servers:
        cfg.ps.validate()
    if cfg.network.emulation == "netns":
        from distrain.launch.netns import require_netns

        require_netns()
    return cfg


class _Process:
    """One rank: its process and the threads copying its output with a rank prefix. Forked by
    ``starter`` where one is given and can (:mod:`distrain.launch.preload`), else started as
    ``python`` (behind ``prefix``, e.g. ``ip netns exec NS``)."""

    def __init__(self, rank: int, target: Target, env: dict[str, str], lock: threading.Lock,
                 prefix: list[str] | None = None, starter: Starter | None = None) -> None:
        self.rank = rank
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        forked = starter.start(env, target.script, target.module, target.args) if starter is not None else None
        if starter is not None and forked is None:
            print(f"distrain: rank {rank} is started with python: the preloaded starter could not start it "
                  f"({starter.refused})", file=sys.stderr)
        self.proc: subprocess.Popen[bytes] | Forked = forked if forked is not None else subprocess.Popen(
            [*(prefix or []), *target.command()], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL, preexec_fn=killed_with_parent, start_new_session=True)
        self.threads = [threading.Thread(target=self._copy, args=(self.proc.stdout, sys.stdout, False, lock), daemon=True),
                        threading.Thread(target=self._copy, args=(self.proc.stderr, sys.stderr, True, lock), daemon=True)]
        for t in self.threads:
            t.start()

    def _copy(self, source: IO[bytes], sink: IO[str], keep: bool, lock: threading.Lock) -> None:
        prefix = f"[rank {self.rank}] "
        warning = False  # in a Python warning's lines
        for raw in iter(source.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            warning = bool(_WARNING_LINE.match(line)) or (warning and line[:1].isspace())
            if keep and line.strip() and not warning:
                self.tail.append(line.strip())
            with lock:
                sink.write(prefix + line + "\n")
                sink.flush()
        source.close()

    def bad_input(self) -> bool:
        """Whether this process ended on distrain's refusal of a setting (a ConfigError its script
        did not catch, e.g. from ``wrap()``'s keyword arguments): the job's exit status is then
        distrain's for bad input."""
        return bool(self.tail) and _TORCH_RANK_PREFIX.sub("", self.tail[-1]).startswith(f"{ConfigError.__module__}.ConfigError: ")

    def cause(self, code: int) -> str:
        """Why this process ended: the last line it wrote to stderr, or how it exited."""
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        last = _TORCH_RANK_PREFIX.sub("", self.tail[-1]) if self.tail else ""
        return f"{last} ({how})" if last else how

    def stop(self, sig: int) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)  # the script's own children too
            except ProcessLookupError:
                pass


#: Store keys of a job on several machines: a failed node's line (the others stop theirs), and
#: each node's launcher's end (node 0 keeps the store up until every node has ended).
NODE_FAILED_KEY = "distrain/launch/failed"
NODE_UP_KEY = "distrain/launch/up/{}"
NODE_DONE_KEY = "distrain/launch/done/{}"
#: How often a node's launcher reads those keys.
NODE_POLL_S = 0.5


@dataclass(frozen=True)
class Nodes:
    """Where this launcher's processes sit in a job on several machines (``--nnodes``,
    ``--node-rank``, ``--master-addr``, ``--join``); the default is one machine on 127.0.0.1."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    #: start this node's workers as joiners of a running elastic job (a node lost and back)
    join: bool = False

    def check(self, master_port: int, servers: int, emulation: str) -> None:
        """ConfigError naming the flag, before anything starts."""
        for name, value, low in (("--nnodes", self.nnodes, 1), ("--node-rank", self.node_rank, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(name, f"must be an integer >= {low}, got {value!r}")
        if self.node_rank >= self.nnodes:
            raise ConfigError("--node-rank", f"must be below --nnodes ({self.nnodes}), got {self.node_rank}")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ConfigError("--master-addr", f"must name node 0's address, got {self.master_addr!r}")
        if self.nnodes == 1:
            if self.join:
                raise ConfigError("--join", "is for a node of a job on several machines (--nnodes 2 or more); on "
                                            "one machine, --max-restarts starts lost workers again")
            return
        if not master_port:
            raise ConfigError("--master-port", "a job on several machines needs the port every node names "
                                               "(node 0's launcher serves the rendezvous there), got 0")
        if servers:
            raise ConfigError("--servers", "parameter servers run on one machine only (--nnodes 1); across machines, "
                                           "start them under torchrun as its last ranks")
        if emulation == "netns":
            raise ConfigError("--emulation", "netns shapes one machine's namespaces; with --nnodes above 1 use "
                                             "model, or the real network")
        if self.join and self.node_rank == 0:
            raise ConfigError("--join", "node 0 hosts the job's rendezvous, so it cannot join one: a node that "
                                        "joins has --node-rank 1 or more")

    @property
    def host(self) -> bool:
        """Whether this launcher serves the job's store (node 0, or the only one)."""
        return self.node_rank == 0


def launch_script(target: Target, workers: int, settings: dict[str, Any], *, master_port: int = 0,
                  timeout: float = 120.0, servers: int = 0, max_restarts: int = 0, nodes: Nodes = Nodes(),
                  preload: bool = True) -> int:
    """Run ``target`` as ``workers`` processes, and ``servers`` more (the last ranks) that
    ``wrap()`` makes parameter servers; the exit status of the job (0: all succeeded). With
    ``nodes`` on several machines, these are ``workers`` of ``nodes.nnodes * workers``.

    In an elastic run, a worker that dies is started again, up to ``max_restarts`` times in all:
    it joins the others at a step's end with their state (``wrap()`` sees :data:`JOIN_ENV`). A
    rank killed before its ``wrap()`` began to open the default group (any run) is started again
    in its place, as it was started first, once another rank begins to open it.

    With ``preload`` (and not ``--emulation netns``), every process is forked from one that
    imported torch once (:mod:`distrain.launch.preload`), a rank started again too; otherwise each
    starts as ``python SCRIPT``.

    Bad settings raise ConfigError before anything starts.
    """
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise ConfigError("--max-restarts", f"must be an integer >= 0, got {max_restarts!r}")
    target.check()
    nodes.check(master_port, servers, settings.get("emulation", "model"))
    cfg = check_settings(settings, workers * nodes.nnodes, servers)
    world = workers * nodes.nnodes + servers
    first = workers * nodes.node_rank  # this node's first rank
    lock = threading.Lock()
    procs: list[_Process] = []
    interrupted: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _frame: interrupted.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    namespaces, work, store, forks = None, None, None, None
    try:
        if cfg.network.emulation == "netns":
            from distrain.emulation import NetworkSettings
            from distrain.launch.netns import NetnsHosts

            spec = NetworkSettings.from_config(cfg.network).resolve(world, workers, cfg.algo.workers_per_node)
            work = Path(tempfile.mkdtemp(prefix="distrain-launch-"))  # the traces' clock file
            namespaces = NetnsHosts(spec, work / "clock", host=True)  # the store waits on this machine's bridge
            namespaces.open()
        addr = nodes.master_addr if namespaces is None else namespaces.address
        port = master_port or free_port(addr)
        if nodes.host:  # outlives every rank: the rendezvous is the launcher's
            if master_port:
                check_port_free(addr, port)  # one line naming --master-port (or --master-addr), not a traceback
            store = store_of(addr, port, timeout, host=True)
        else:
            wait_for_master(addr, port, timeout)
            store = store_of(addr, port, timeout)
        if nodes.host and (max_restarts or nodes.nnodes > 1):
            # the members look for workers joining every few steps: restarted ones, or a node's
            store.set(RESTARTS_KEY, str(max_restarts))
        mine = list(range(first, first + workers)) + list(range(world - servers, world))
        if nodes.nnodes > 1:
            store.set(NODE_UP_KEY.format(nodes.node_rank), "1")  # node 0 waits for the nodes that came up
        if nodes.join:
            _check_join(store, nodes, mine, addr, port, timeout)
        base = dict(os.environ)
        base.setdefault("OMP_NUM_THREADS", "1")
        base.update(MASTER_ADDR=addr, MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(len(mine)),
                    GROUP_RANK=str(nodes.node_rank), TORCHELASTIC_USE_AGENT_STORE="True", PYTHONUNBUFFERED="1",
                    **{SETTINGS_ENV: json.dumps(settings)}, **(namespaces.env() if namespaces is not None else {}))
        if namespaces is not None:
            base.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d warns that namespaces have no host names

        if preload and namespaces is None and hasattr(os, "fork"):
            forks = starter()

        def start(rank: int, joining: bool = False) -> _Process:
            local = mine.index(rank)
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(local), "ROLE_RANK": str(rank)}
            if joining:
                env[JOIN_ENV] = "1"
            prefix = None if namespaces is None else ["ip", "netns", "exec", namespaces.namespace(rank)]
            return _Process(rank, target, env, lock, prefix=prefix, starter=forks)

        for rank in mine:
            procs.append(start(rank, joining=nodes.join))
        restart = Restarts(max_restarts, lambda rank: start(rank, joining=True), world - servers, store,
                           fresh=lambda rank: start(rank, joining=nodes.join))
        code = _supervise(procs, interrupted, exit_window=timeout, store=store, restart=restart,
                          nodes=nodes if nodes.nnodes > 1 else None,
                          irreplaceable={world - 1} if servers == 1 else set())
        if nodes.nnodes > 1:
            _end_node(store, nodes, code, workers, timeout)
        return code
    finally:
        for p in procs:
            p.stop(signal.SIGKILL)
            p.proc.wait()
            for t in p.threads:
                t.join(timeout=5)
        if forks is not None:
            forks.close()
        del store
        if namespaces is not None:
            namespaces.close()  # after every rank is gone
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _check_join(store: Any, nodes: Nodes, ranks: list[int], addr: str, port: int, timeout: float) -> None:
    """Before a node's workers join the job at ``addr:port``: it must be an elastic job that
    takes joiners, and every one of ``ranks`` must have been lost (the members declare a lost
    worker dead once they agree to go on without it; this waits up to ``timeout`` for that)."""
    if not (elastic_run(store) and store.check([RESTARTS_KEY])):
        raise ConfigError("--join", f"the job at {addr}:{port} takes no workers that join: its algorithm does not go "
                                    "on without lost workers (e.g. allreduce, diloco, gossip, prague), or it has not "
                                    "started training yet")
    deadline = time.monotonic() + timeout
    while live := [r for r in ranks if not declared_dead(store, r)]:
        if time.monotonic() > deadline:
            raise ConfigError("--node-rank", f"ranks {live} of node {nodes.node_rank} are still in the job at "
                                             f"{addr}:{port}; a node joins in place of one that was lost")
        time.sleep(NODE_POLL_S)


def _end_node(store: Any, nodes: Nodes, code: int, workers: int, timeout: float) -> None:
    """A node's launcher is done (exit status ``code``): say so in the store. Node 0's, which
    serves the store, waits up to ``timeout`` seconds for the other nodes that came up to end,
    except those whose workers were all lost (and not after Ctrl-C)."""
    with contextlib.suppress(Exception):  # the store's host may be gone already
        store.set(NODE_DONE_KEY.format(nodes.node_rank), str(code))
    if not nodes.host or code in (130, 143):  # interrupted: the others find the rendezvous gone and stop
        return
    deadline = time.monotonic() + timeout
    others = list(range(1, nodes.nnodes))
    while time.monotonic() < deadline:
        others = [n for n in others if store.check([NODE_UP_KEY.format(n)]) and not store.check([NODE_DONE_KEY.format(n)])
                  and not all(declared_dead(store, r) for r in range(n * workers, (n + 1) * workers))]
        if not others:
            return
        time.sleep(NODE_POLL_S)
    print(f"distrain: node(s) {others} had not ended {timeout:g} s after node 0; closing the rendezvous",
          file=sys.stderr)


def announce_failure(store: Any, nodes: Nodes | None, line: str) -> None:
    """On several machines: tell the other nodes' launchers that this node's job failed."""
    if nodes is not None:
        with contextlib.suppress(Exception):
            store.compare_set(NODE_FAILED_KEY, "", f"node {nodes.node_rank}: {line}")


def _failed_elsewhere(store: Any, nodes: Nodes | None) -> str | None:
    """Another node's failure line, or why this node cannot reach the job's store (node 0's
    launcher gone); None while the job goes on."""
    if nodes is None:
        return None
    try:
        return store.get(NODE_FAILED_KEY).decode() if store.check([NODE_FAILED_KEY]) else None
    except Exception:  # noqa: BLE001 - the store is node 0's launcher's
        return "the job's rendezvous (node 0's launcher) is gone"


def _supervise(procs: list[_Process], interrupted: list[int], exit_window: float, store: Any = None,
               restart: Restarts | None = None, nodes: Nodes | None = None,
               irreplaceable: set[int] | None = None) -> int:
    """Wait for every process; on the first failure or a signal, stop the others. Once one has
    finished, the others have ``exit_window`` seconds to finish too (a rank stuck at exit, or in
    a wait its finished peers will never answer, would otherwise keep the job up for ever).

    In an elastic run (``wrap()`` marked it so in ``store``) a process that dies is declared dead
    and the others go on; the job succeeds when every survivor does. On several machines
    (``nodes``) a failure is announced to the other nodes' launchers, and one they announce
    stops this node's processes. A rank in ``irreplaceable`` (the only parameter server: nobody
    holds its parameters) fails the job when it dies, elastic or not (it said the others went on
    without it, and they then stopped for want of it)."""
    first_done: tuple[float, int] | None = None
    lost: list[_Process] = []
    held: dict[_Process, float] = {}  # killed before opening the group: since when, until another opens it
    fenced: dict[_Process, str] = {}  # stopped here, silent while the others waited for them: why
    polled = fence_looked = time.monotonic()
    while True:
        if interrupted:
            _stop_all(procs)
            print(f"distrain: interrupted ({signal.Signals(interrupted[0]).name}); stopped {len(procs)} processes",
                  file=sys.stderr)
            return 130 if interrupted[0] == signal.SIGINT else 143
        codes = [p.proc.poll() for p in procs]
        if time.monotonic() - fence_looked > FENCE_POLL_S and elastic_run(store):
            fence_looked = time.monotonic()
            running = {p: p.rank for p, c in zip(procs, codes, strict=True) if c is None and p not in lost and p not in fenced}
            for p, why in stop_requests(store, running).items():
                fenced[p] = why
                p.stop(signal.SIGKILL)
        failed = next((p for p, c in zip(procs, codes, strict=True) if c not in (None, 0) and p not in lost
                       and p not in held), None)
        code = 0 if failed is None else int(codes[procs.index(failed)])  # type: ignore[arg-type]
        # killed before it opened the group: nobody waits for it yet; started again in its place
        # once another opens it, or, with no restart left, left out if the run is elastic
        if failed is not None and code < 0 and nodes is None and first_done is None \
                and not opening(store, failed.rank) and (restart is not None and restart.in_place_left
                                                         or not elastic_run(store)):
            held[failed] = time.monotonic()
            continue
        # died (a signal), or left out by the others (distrain.wrap() exits with EXIT_LEFT_OUT): the others go on
        if failed is not None and (code < 0 or code == EXIT_LEFT_OUT) and elastic_run(store) \
                and failed.rank not in (irreplaceable or ()):
            declare_dead(store, failed.rank)
            lost.append(failed)
            again = restart(failed.rank) if restart is not None and first_done is None else None
            cause = f"fell silent and was stopped ({fenced[failed]})" if failed in fenced else failed.cause(code)
            if again is None:
                print(f"distrain: rank {failed.rank} failed: {cause}; the others go on without it", file=sys.stderr)
            else:
                print(f"distrain: rank {failed.rank} failed: {cause}; started again, it joins the others with their "
                      "state", file=sys.stderr)
                procs.append(again)
            continue
        if failed is None and held:
            started, gone = len(procs), len(lost)
            failed, code = _start_in_place(held, procs, lost, store, restart, exit_window)
            if len(procs) != started or len(lost) != gone:
                continue  # (started again: its place is in procs now; or left out)
        if failed is not None:
            failed, code, elsewhere = _root_cause(procs, failed, code, store, nodes)
            if elsewhere is not None:  # this node's failure followed another node's
                _stop_all(procs)
                print(f"distrain: stopped {len(procs)} processes of node {nodes.node_rank}: {elsewhere} "  # type: ignore[union-attr]
                      f"(rank {failed.rank} here lost its connection: {failed.cause(code)})", file=sys.stderr)
                return 1
            announce_failure(store, nodes, f"rank {failed.rank} failed")  # the other nodes stop at once
            _stop_all(procs)
            cause = f"fell silent and was stopped ({fenced[failed]})" if failed in fenced else failed.cause(code)
            print(f"distrain: rank {failed.rank} failed: {cause}", file=sys.stderr)
            return EXIT_BAD_INPUT if failed.bad_input() else 1
        if all(c == 0 or p in lost for p, c in zip(procs, codes, strict=True)):
            return 0 if len(lost) < len(procs) else 1
        if nodes is not None and time.monotonic() - polled > NODE_POLL_S:
            polled = time.monotonic()
            elsewhere = _failed_elsewhere(store, nodes)
            if elsewhere is not None:
                _stop_all(procs)
                print(f"distrain: stopped {sum(c is None for c in codes)} processes of node {nodes.node_rank}: "
                      f"{elsewhere}", file=sys.stderr)
                return 1
        if first_done is None and 0 in codes:
            first_done = (time.monotonic(), procs[codes.index(0)].rank)
            if elastic_run(store):
                _remove_left_behind(procs, codes, lost, store)
        if first_done is not None and time.monotonic() - first_done[0] > exit_window:
            stuck = [p.rank for p, c in zip(procs, codes, strict=True) if c is None]
            announce_failure(store, nodes, f"rank {stuck[0]} did not finish")
            _stop_all(procs)
            print(f"distrain: rank {stuck[0]} did not finish within {exit_window:g} s of rank {first_done[1]} "
                  f"(ranks still running: {stuck}); stopped them (raise --timeout if a rank needs longer)",
                  file=sys.stderr)
            return 1
        time.sleep(0.05)


def _remove_left_behind(procs: list[_Process], codes: list[int | None], lost: list[_Process], store: Any) -> None:
    """As the first process of an elastic run finishes: kill (SIGKILL) every first life still
    running that the others declared dead, a process they went on without because it was silent
    (stopped, deadlocked): it is no longer in the run, and a stopped one would not even answer
    SIGTERM. It counts as lost, so the others' success is the run's, at once, not after the
    exit window. (A life started again may carry its last life's dead mark: it is left alone.)"""
    for p, code in zip(procs, codes, strict=True):
        if code is None and p not in lost and procs.index(p) == [q.rank for q in procs].index(p.rank) \
                and declared_dead(store, p.rank):
            p.stop(signal.SIGKILL)
            p.proc.wait()
            lost.append(p)
            print(f"distrain: rank {p.rank} was left behind by the others (silent past their deadline) and still "
                  f"ran as they finished; stopped it", file=sys.stderr)


def _start_in_place(held: dict[_Process, float], procs: list[_Process], lost: list[_Process], store: Any,
                    restart: Restarts | None, exit_window: float) -> tuple[_Process | None, int]:
    """Ranks ``held``, killed before they began to open the default group (nobody waits for them
    in a run yet): once another rank opens it (``wrap()`` marks it in ``store``), each is started
    again in its place, as it was started first; with no restart left, in an elastic run (marked
    so before the group opens) it is declared dead and the others open their group without it.
    One held for ``exit_window`` seconds with nobody opening it (the script opens the group
    itself, and its peers wait for it there), or with no restart left in a run that is not
    elastic, is the run's failure: it and its exit status are returned (None: none)."""
    others = [q for q in procs if q not in held and q not in lost]
    for p, since in list(held.items()):
        if any(opening(store, q.rank) for q in others):
            again = restart.in_place(p.rank) if restart is not None else None
            if again is None and not elastic_run(store):
                return p, int(p.proc.returncode)
            del held[p]
            lost.append(p)
            if again is None:
                declare_dead(store, p.rank)
                print(f"distrain: rank {p.rank} failed: {p.cause(p.proc.returncode)} before it opened the group "
                      "with the others; the others go on without it", file=sys.stderr)
                continue
            procs.append(again)
            print(f"distrain: rank {p.rank} failed: {p.cause(p.proc.returncode)} before it opened the group with "
                  "the others; started again in its place", file=sys.stderr)
        elif time.monotonic() - since > (exit_window if restart is not None and restart.in_place_left
                                         else min(exit_window, UNOPENED_GRACE_S)):
            return p, int(p.proc.returncode)
    return None, 0


def _root_cause(procs: list[_Process], failed: _Process, code: int, store: Any,
                nodes: Nodes | None) -> tuple[_Process, int, str | None]:
    """The failure to name for the job: ``failed``, unless it only lost its connection to a peer
    that died first. Then, for up to ``ROOT_CAUSE_WAIT_S`` seconds, a process of this node that
    failed for a reason of its own, or another node's announced failure (the third value), is
    the cause; if none shows, ``failed`` is."""
    deadline = time.monotonic() + ROOT_CAUSE_WAIT_S
    while True:
        for t in failed.threads:
            t.join(timeout=max(0.1, deadline - time.monotonic()))  # its last lines are read before they are judged
        if not _LOST_PEER.search(failed.cause(code)):
            return failed, code, None
        elsewhere = _failed_elsewhere(store, nodes)
        if elsewhere is not None:
            return failed, code, elsewhere
        own = [(p, c) for p in procs if p is not failed and (c := p.proc.poll()) not in (None, 0)
               and not any(t.is_alive() for t in p.threads) and not _LOST_PEER.search(p.cause(c))]
        if own:
            return own[0][0], int(own[0][1]), None  # type: ignore[arg-type]
        if time.monotonic() > deadline:
            return failed, code, None
        time.sleep(0.05)


def _stop_all(procs: list[_Process]) -> None:
    for p in procs:
        p.stop(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in procs:
        try:
            p.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.stop(signal.SIGKILL)
            p.proc.wait()
