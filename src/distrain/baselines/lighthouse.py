"""torchft's lighthouse (the quorum server of its replica groups) as a child of the launcher.

:class:`Lighthouse` starts ``torchft_lighthouse --bind 127.0.0.1:PORT --min_replicas N`` on a free
loopback port (``RUST_LOG=warn``, its output in ``<run dir>/logs/lighthouse.log``), optionally
waits until it accepts connections, and on leaving, also after a failure, stops it and reaps it;
every wait has a timeout. On Linux the kernel kills it if the launcher dies without stopping it.

The program imports torch before it listens (seconds); a launcher need not wait for that, since
torchft's Managers wait for the lighthouse themselves (up to their connect timeout) while the
workers start alongside it.

Example::

    with Lighthouse(min_replicas=4, log_file=run_dir / "logs" / "lighthouse.log") as address:
        ...  # workers connect torchft Managers to ``address`` ("http://127.0.0.1:PORT")
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from distrain.errors import DistrainError
from distrain.launch.common import PR_SET_PDEATHSIG, free_port

#: The program torchft installs beside its Python package.
PROGRAM = "torchft_lighthouse"
#: Seconds a stopped lighthouse gets to exit before it is killed.
STOP_GRACE_S = 5.0


def lighthouse_program() -> str | None:
    """The ``torchft_lighthouse`` of this interpreter's environment (or on PATH), or None."""
    beside = Path(sys.executable).parent / PROGRAM
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else shutil.which(PROGRAM)


def _killed_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel SIGKILL the child when its parent dies (Linux), or
    None. libc is loaded here, in the parent: the forked child must not look for it."""
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None
    return lambda: libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Lighthouse:
    """A ``torchft_lighthouse`` process for the length of a ``with`` block.

    Args:
        min_replicas: replica groups a quorum needs (every worker of the run).
        log_file: where its output goes (its directory is made).
        start_timeout: seconds it may take to accept connections before the ``with`` block
            starts; None: do not wait.
        program: the executable (default :func:`lighthouse_program`).
    """

    def __init__(self, min_replicas: int, log_file: Path, start_timeout: float | None = 30.0,
                 program: str | None = None) -> None:
        self.min_replicas, self.log_file, self.start_timeout = min_replicas, Path(log_file), start_timeout
        self.program = program or lighthouse_program()
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""

    def __enter__(self) -> str:
        if self.program is None:
            raise DistrainError(f"{PROGRAM} not found beside {sys.executable} or on PATH (it comes with torchft)")
        port = free_port("127.0.0.1")
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(
                [self.program, "--bind", f"127.0.0.1:{port}", "--min_replicas", str(self.min_replicas)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RUST_LOG": "warn"},
                preexec_fn=_killed_with_parent())
        if self.start_timeout is not None:
            try:
                self._wait_listening(port, self.start_timeout)
            except BaseException:
                self.stop()
                raise
        self.address = f"http://127.0.0.1:{port}"
        return self.address

    def _wait_listening(self, port: int, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                    return
            except OSError:
                pass
            try:  # waits on the process itself between tries: it exiting is the news
                code = self.proc.wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                code = None
            if code is not None:
                raise DistrainError(f"{PROGRAM} exited with status {code} before it listened on 127.0.0.1:{port}: "
                                    f"{self.log_tail()}")
            if time.monotonic() > deadline:
                raise DistrainError(f"{PROGRAM} did not listen on 127.0.0.1:{port} within {timeout:g} s")

    def exited(self) -> int | None:
        """Its exit status if it has ended (on its own: it is meant to run until stopped), else None."""
        return self.proc.poll() if self.proc is not None else None

    def log_tail(self, lines: int = 3) -> str:
        """The last lines of its output, on one line."""
        try:
            text = self.log_file.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:]) or "no output"

    def stop(self) -> int | None:
        """Stop it (SIGTERM, then SIGKILL after ``STOP_GRACE_S``) and reap it; its exit status."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                return proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
        return proc.wait(timeout=STOP_GRACE_S)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
