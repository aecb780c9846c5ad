"""``distrain launch``: run the user's own training script as N processes on this machine.

Each process gets the environment torchrun would set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``/``MASTER_PORT`` of a store this launcher hosts on 127.0.0.1) and the emulated
network's settings in :data:`~distrain.distributed.SETTINGS_ENV`, which :func:`distrain.wrap` reads.
Output lines carry the rank. When one process fails, the others are stopped and one line names
the rank and the cause; Ctrl-C stops them all; nothing is left running.
"""

from __future__ import annotations

import ctypes
import ctypes.util
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
from distrain.errors import ConfigError
from distrain.launch.common import PR_SET_PDEATHSIG, Restarts, free_port
from distrain.runtime.health import declare_dead
from distrain.runtime.membership import JOIN_ENV, RESTARTS_KEY, elastic_run

#: Seconds the other processes get to stop after a failure or Ctrl-C before they are killed.
STOP_GRACE_S = 5.0
#: Lines of each process's stderr kept for the failure message.
TAIL_LINES = 20
#: torch.distributed's prefix on an uncaught exception's lines (the rank is named already).
_TORCH_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")


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
    cfg.cluster.validate()
    if servers:
        cfg.ps.validate()
    if cfg.network.emulation == "netns":
        from distrain.launch.netns import require_netns

        require_netns()
    return cfg


def _die_with_launcher() -> None:
    """In a child, before exec: the kernel kills it when the launcher dies (Linux)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class _Process:
    """One rank: its process and the threads copying its output with a rank prefix."""

    def __init__(self, rank: int, target: Target, env: dict[str, str], lock: threading.Lock,
                 prefix: list[str] | None = None) -> None:
        self.rank = rank
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.proc = subprocess.Popen([*(prefix or []), *target.command()], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_launcher, start_new_session=True)
        self.threads = [threading.Thread(target=self._copy, args=(self.proc.stdout, sys.stdout, False, lock), daemon=True),
                        threading.Thread(target=self._copy, args=(self.proc.stderr, sys.stderr, True, lock), daemon=True)]
        for t in self.threads:
            t.start()

    def _copy(self, source: IO[bytes], sink: IO[str], keep: bool, lock: threading.Lock) -> None:
        prefix = f"[rank {self.rank}] "
        for raw in iter(source.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if keep and line.strip():
                self.tail.append(line.strip())
            with lock:
                sink.write(prefix + line + "\n")
                sink.flush()
        source.close()

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


def launch_script(target: Target, workers: int, settings: dict[str, Any], *, master_port: int = 0,
                  timeout: float = 120.0, servers: int = 0, max_restarts: int = 0) -> int:
    """Run ``target`` as ``workers`` processes, and ``servers`` more (the last ranks) that
    ``wrap()`` makes parameter servers; the exit status of the job (0: all succeeded).

    In an elastic run, a worker that dies is started again, up to ``max_restarts`` times in all:
    it joins the others at a step's end with their state (``wrap()`` sees :data:`JOIN_ENV`).

    Bad settings raise ConfigError before anything starts.
    """
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise ConfigError("--max-restarts", f"must be an integer >= 0, got {max_restarts!r}")
    target.check()
    cfg = check_settings(settings, workers, servers)
    world = workers + servers
    lock = threading.Lock()
    procs: list[_Process] = []
    interrupted: list[int] = []
    previous = {s: signal.signal(s, lambda signum, _frame: interrupted.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    namespaces, work, store = None, None, None
    try:
        if cfg.network.emulation == "netns":
            from distrain.emulation import NetworkSettings
            from distrain.launch.netns import NetnsHosts

            spec = NetworkSettings.from_config(cfg.network).resolve(world, workers, cfg.algo.workers_per_node)
            work = Path(tempfile.mkdtemp(prefix="distrain-launch-"))  # the traces' clock file
            namespaces = NetnsHosts(spec, work / "clock", host=True)  # the store waits on this machine's bridge
            namespaces.open()
        addr = "127.0.0.1" if namespaces is None else namespaces.address
        port = master_port or free_port(addr)
        store = store_of(addr, port, timeout, host=True)  # outlives every rank: the rendezvous is the launcher's
        if max_restarts:
            store.set(RESTARTS_KEY, str(max_restarts))  # the members look for workers joining at every step
        base = dict(os.environ)
        base.setdefault("OMP_NUM_THREADS", "1")
        base.update(MASTER_ADDR=addr, MASTER_PORT=str(port), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                    GROUP_RANK="0", TORCHELASTIC_USE_AGENT_STORE="True", PYTHONUNBUFFERED="1",
                    **{SETTINGS_ENV: json.dumps(settings)}, **(namespaces.env() if namespaces is not None else {}))
        if namespaces is not None:
            base.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # c10d warns that namespaces have no host names

        def start(rank: int, joining: bool = False) -> _Process:
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
            if joining:
                env[JOIN_ENV] = "1"
            prefix = None if namespaces is None else ["ip", "netns", "exec", namespaces.namespace(rank)]
            return _Process(rank, target, env, lock, prefix=prefix)

        for rank in range(world):
            procs.append(start(rank))
        restart = Restarts(max_restarts, lambda rank: start(rank, joining=True), workers, store)
        return _supervise(procs, interrupted, exit_window=timeout, store=store, restart=restart)
    finally:
        for p in procs:
            p.stop(signal.SIGKILL)
            p.proc.wait()
            for t in p.threads:
                t.join(timeout=5)
        del store
        if namespaces is not None:
            namespaces.close()  # after every rank is gone
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _supervise(procs: list[_Process], interrupted: list[int], exit_window: float, store: Any = None,
               restart: Restarts | None = None) -> int:
    """Wait for every process; on the first failure or a signal, stop the others. Once one has
    finished, the others have ``exit_window`` seconds to finish too (a rank stuck at exit, or in
    a wait its finished peers will never answer, would otherwise keep the job up for ever).

    In an elastic run (``wrap()`` marked it so in ``store``) a process that dies is declared dead
    and the others go on; the job succeeds when every survivor does."""
    first_done: tuple[float, int] | None = None
    lost: list[_Process] = []
    while True:
        if interrupted:
            _stop_all(procs)
            print(f"distrain: interrupted ({signal.Signals(interrupted[0]).name}); stopped {len(procs)} processes",
                  file=sys.stderr)
            return 130 if interrupted[0] == signal.SIGINT else 143
        codes = [p.proc.poll() for p in procs]
        failed = next((p for p, c in zip(procs, codes, strict=True) if c not in (None, 0) and p not in lost), None)
        code = 0 if failed is None else int(codes[procs.index(failed)])  # type: ignore[arg-type]
        if failed is not None and code < 0 and elastic_run(store):  # died (a signal): the others go on
            declare_dead(store, failed.rank)
            lost.append(failed)
            again = restart(failed.rank) if restart is not None and first_done is None else None
            if again is None:
                print(f"distrain: rank {failed.rank} failed: {failed.cause(code)}; the others go on without it",
                      file=sys.stderr)
            else:
                print(f"distrain: rank {failed.rank} failed: {failed.cause(code)}; started again, it joins the "
                      f"others with their state", file=sys.stderr)
                procs.append(again)
            continue
        if failed is not None:
            _stop_all(procs)
            for t in failed.threads:
                t.join(timeout=5)  # its last lines are read before they are quoted
            print(f"distrain: rank {failed.rank} failed: {failed.cause(code)}", file=sys.stderr)
            return 1
        if all(c == 0 or p in lost for p, c in zip(procs, codes, strict=True)):
            return 0 if len(lost) < len(procs) else 1
        if first_done is None and 0 in codes:
            first_done = (time.monotonic(), procs[codes.index(0)].rank)
        if first_done is not None and time.monotonic() - first_done[0] > exit_window:
            stuck = [p.rank for p, c in zip(procs, codes, strict=True) if c is None]
            _stop_all(procs)
            print(f"distrain: rank {stuck[0]} did not finish within {exit_window:g} s of rank {first_done[1]} "
                  f"(ranks still running: {stuck}); stopped them (raise --timeout if a rank needs longer)",
                  file=sys.stderr)
            return 1
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
