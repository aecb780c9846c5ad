"""``distrain launch``'s starter: one process imports torch once, and every rank's script is forked from it.

A rank started as ``python SCRIPT`` imports torch (about 1.5 s of CPU) and, with its first
optimizer, ``torch._dynamo`` (about 1.2 s more). With four ranks on a machine of two cores that
was about 5 of a short run's 7 s before its first step, and again for every rank started anew
(``--max-restarts``), whose join waited for it. :class:`Starter` starts one Python process
beside the launcher that imports :data:`PRELOAD` and then forks one child per rank on request.
The child becomes what ``python SCRIPT ARGS`` would be: the rank's environment (replaced whole),
working directory, ``sys.argv``, ``sys.path[0]`` (the script's directory; the working directory
for ``-m``), standard output and error on the launcher's pipes, standard input on /dev/null, the
signal handlers and mask of a fresh interpreter, the global generators of ``random``, NumPy
and torch seeded afresh, a process group of its own (the launcher stops it and its children with one signal). It
then runs the script as ``__main__``, so an uncaught exception, ``sys.exit`` and
``atexit`` behave as in a fresh interpreter. What differs: the modules of :data:`PRELOAD` are
imported already (with the environment the launcher had, not the rank's: ``RANK`` and the
like are read later), Python's string hashes share one seed over the ranks, and a traceback
shows the starter's frames above the script's (and ``runpy``'s, with ``-m``).

``distrain launch --no-preload`` starts each rank with ``python`` instead, as torchrun does; so
does ``--emulation netns`` (each rank starts inside its namespace). Messages between the
launcher and the starter are JSON over a Unix socket pair, the child's pipes passed with
SCM_RIGHTS; nothing is pickled. The starter dies with the launcher and its children with it
(``PR_SET_PDEATHSIG``), so nothing is left running.

This module imports nothing but the standard library at its top: the starter's own imports are
the point.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import importlib
import json
import os
import random
import select
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: What the starter imports before it forks any rank: ``torch._dynamo`` too, which the first
#: optimizer a script makes imports.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "distrain")
#: Seconds a request to start a rank may wait for the starter (which is importing :data:`PRELOAD`
#: at first) before the launcher starts that rank with ``python`` instead.
START_WAIT_S = 120.0
#: Size bound of one message between the launcher and the starter (a rank's environment).
MESSAGE_MAX = 1 << 22
#: prctl option: the signal this process gets when the thread that started it ends (Linux).
PR_SET_PDEATHSIG = 1
_CODE = ("import sys; sys.path.insert(0, sys.argv[2]); from distrain.launch.preload import main; "
         "main(int(sys.argv[1]), sys.argv[2])")


def killed_with_parent() -> None:
    """The kernel kills this process (SIGKILL) when its parent ends (Linux; elsewhere nothing);
    called in a child before it runs anything (a worker that also wants a watch where prctl is
    missing uses :func:`distrain.launch.common.die_with_parent`)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


# -- the starter's side ----------------------------------------------------------------------------


@dataclass
class _Rank:
    """A request to start one rank, as the child receives it."""

    env: dict[str, str]
    cwd: str
    script: str | None
    module: str | None
    args: list[str]
    out: int
    err: int
    #: the starter's pid: a child whose parent is another one was orphaned as it started
    starter: int = 0


def main(fd: int, added_path: str) -> None:
    """The starter's program (``python -c``): serve requests on socket ``fd``; in a forked child,
    run the rank's script. ``added_path`` was put first on ``sys.path`` to find distrain."""
    sys.path.remove(added_path)
    rank = _serve(socket.socket(fileno=fd))
    if rank is not None:
        _run(rank)


def _serve(sock: socket.socket) -> _Rank | None:
    """Import :data:`PRELOAD`, then fork a child for each request until the launcher closes the
    socket; report each child's pid and exit status. Returns in a child only: its request."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher forwards stops; a Ctrl-C is its to handle
    killed_with_parent()
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the script imports it itself, and fails there as it would anyway
            break
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a forked child could not use the GPU
        sock.sendall(json.dumps({"refused": "CUDA was initialised while importing torch"}).encode())
        return None
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below as a child ends
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        _reap(sock)
        if sock not in ready:
            continue
        message, fds, _, _ = socket.recv_fds(sock, MESSAGE_MAX, 2)
        if not message:  # the launcher is done (it stopped every rank first): nothing here to tidy
            os._exit(0)
        request = json.loads(message)
        me = os.getpid()
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            sock.close()
            for fd in (wake_r, wake_w):
                os.close(fd)
            return _Rank(request["env"], request["cwd"], request["script"], request["module"], request["args"], *fds,
                         starter=me)
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)  # (the child does too: whichever runs first; the launcher signals its group)
        for fd in fds:
            os.close(fd)
        sock.sendall(json.dumps({"started": request["id"], "pid": pid}).encode())


def _reap(sock: socket.socket) -> None:
    """Report every child that ended: its pid and exit status as ``subprocess`` gives it."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.sendall(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _run(rank: _Rank) -> None:
    """In the forked child: become ``python SCRIPT ARGS`` (or ``python -m MODULE ARGS``) and run it."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    killed_with_parent()
    if os.getppid() != rank.starter:  # the starter (and the launcher) ended before the line above
        os._exit(1)
    null = os.open(os.devnull, os.O_RDONLY)
    for source, target in ((null, 0), (rank.out, 1), (rank.err, 2)):
        os.dup2(source, target)
        os.close(source)
    for s in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):
        signal.signal(s, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    os.environ.clear()
    os.environ.update(rank.env)
    os.chdir(rank.cwd)
    # Forked, every rank would draw what the starter's generators draw: seeded afresh from the
    # system's entropy instead, as each fresh interpreter seeds them (torch's default generator too).
    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
    import runpy

    if rank.module is not None:
        sys.argv = [rank.module, *rank.args]  # (runpy puts the module's path there)
        sys.path[0] = rank.cwd
        runpy.run_module(rank.module, run_name="__main__", alter_sys=True)
    else:
        assert rank.script is not None
        sys.argv = [rank.script, *rank.args]
        sys.path[0] = str(Path(rank.script).resolve().parent)
        _run_script(os.path.abspath(rank.script))


def _run_script(path: str) -> None:
    """Run the file ``path`` as ``python`` runs its script: a new ``__main__`` module whose
    ``__file__`` is the absolute path, ``sys.argv[0]`` left as given (``runpy.run_path`` would
    set it to the path it is handed)."""
    import builtins
    import importlib.machinery
    import io
    import types

    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __builtins__=builtins, __spec__=None, __cached__=None, __package__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec")
    exec(code, main.__dict__)


# -- the launcher's side ---------------------------------------------------------------------------


class Forked:
    """A rank forked by the :class:`Starter`, seen as a :class:`subprocess.Popen` is: ``pid``,
    ``returncode``, ``poll()``, ``wait(timeout)``; ``stdout`` and ``stderr`` are the read ends of
    its output."""

    def __init__(self, out: int, err: int) -> None:
        self.stdout, self.stderr = os.fdopen(out, "rb"), os.fdopen(err, "rb")
        self.pid = 0
        self.returncode: int | None = None
        self._started, self._ended = threading.Event(), threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired("distrain launch rank", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def _end(self, code: int) -> None:
        self.returncode = code
        self._ended.set()


class Starter:
    """The launcher's starter process (see the module's text), and the ranks it forked."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.setdefault("OMP_NUM_THREADS", "1")  # (as distrain launch sets for its ranks: torch reads it as it loads)
        root = str(Path(__file__).resolve().parents[2])
        self.proc = subprocess.Popen([sys.executable, "-c", _CODE, str(theirs.fileno()), root], pass_fds=[theirs.fileno()],
                                     env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, preexec_fn=killed_with_parent)
        theirs.close()
        self._sock = ours
        self._lock = threading.Lock()
        self._next = 0
        self._waiting: dict[int, Forked] = {}  # request id -> the rank, until its pid is known
        self._running: dict[int, Forked] = {}  # pid -> the rank, until it ends
        self._ended_unseen: dict[int, int] = {}  # pid -> exit status reported before its start was read
        #: why the starter cannot start ranks (None: it can)
        self.refused: str | None = None
        self._reader = threading.Thread(target=self._read, name="distrain-starter", daemon=True)
        self._reader.start()

    def start(self, env: dict[str, str], script: str | None, module: str | None, args: list[str],
              timeout: float = START_WAIT_S) -> Forked | None:
        """Fork a rank that runs ``script`` (or ``module``) with ``args`` in ``env`` and this
        process's working directory; None when the starter cannot (it refused, or ended, or did
        not answer within ``timeout``): start it with ``python`` then."""
        if self.refused is not None:
            return None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        rank = Forked(out_r, err_r)
        request = {"env": env, "cwd": os.getcwd(), "script": script, "module": module, "args": args}
        with self._lock:
            self._next += 1
            request["id"] = self._next
            self._waiting[self._next] = rank
        try:
            socket.send_fds(self._sock, [json.dumps(request).encode()], [out_w, err_w])
        except OSError as exc:
            self.refused = self.refused or f"its socket failed: {exc}"
        finally:
            os.close(out_w)
            os.close(err_w)
        if self.refused is None:
            rank._started.wait(timeout)  # (set as well when the starter refuses or ends)
        with self._lock:
            self._waiting.pop(request["id"], None)  # (an answer after this kills the rank it started)
        if rank.pid:
            return rank
        self.refused = self.refused or f"it did not answer within {timeout:g} s"
        rank.stdout.close()
        rank.stderr.close()
        return None

    def _read(self) -> None:
        while True:
            try:
                message = self._sock.recv(MESSAGE_MAX)
            except OSError:
                message = b""
            if not message:  # the starter ended (killed, or the launcher closed it): so did its children
                with self._lock:
                    self.refused = self.refused or "it ended"
                    for rank in self._running.values():
                        rank._end(-signal.SIGKILL)
                    for rank in self._waiting.values():
                        rank._started.set()  # (no pid: start() hands it back to be started with python)
                    self._running.clear()
                    self._waiting.clear()
                return
            self._take(json.loads(message))

    def _take(self, message: dict[str, Any]) -> None:
        with self._lock:
            if "refused" in message:
                self.refused = str(message["refused"])
                for rank in self._waiting.values():
                    rank._started.set()
                self._waiting.clear()
            elif "started" in message:
                rank = self._waiting.pop(message["started"], None)
                if rank is None:  # the launcher gave up waiting and started the rank with python
                    with contextlib.suppress(OSError):
                        os.killpg(int(message["pid"]), signal.SIGKILL)
                    return
                rank.pid = int(message["pid"])
                if rank.pid in self._ended_unseen:
                    rank._end(self._ended_unseen.pop(rank.pid))
                else:
                    self._running[rank.pid] = rank
                rank._started.set()
            else:
                pid, code = int(message["exit"]), int(message["code"])
                if pid in self._running:
                    self._running.pop(pid)._end(code)
                else:
                    self._ended_unseen[pid] = code

    def close(self) -> None:
        """End the starter (once the launcher has stopped every rank it forked)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._sock.close()
        self._reader.join(timeout=5)


_early: Starter | None = None


def start_early(argv: list[str]) -> bool:
    """Start the starter now, beside the launcher's own imports, when command-line arguments
    ``argv`` (without the program) launch a script with it, as far as a look at them tells:
    ``launch``, with none of ``--no-preload``, ``--emulation netns``, ``--help`` anywhere in
    them. True when it was started; :func:`starter` hands it to the launcher. A wrong guess costs
    a process that ends with the launcher, or a starter started later."""
    global _early
    if not argv or argv[0] != "launch" or not hasattr(os, "fork") or _early is not None:
        return False
    if {"--help", "-h", "--no-preload", "--emulation=netns"} & set(argv) or \
            any(a == "--emulation" and b == "netns" for a, b in zip(argv, argv[1:], strict=False)):
        return False
    _early = Starter()
    return True


def starter() -> Starter:
    """The starter :func:`start_early` started, or a new one."""
    global _early
    started, _early = _early or Starter(), None
    return started
