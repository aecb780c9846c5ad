"""Crash-safe file writes: a reader sees the previous complete file or the new one, never a mix.

Every file distrain writes for later reading (checkpoints, ``summary.json``, ``config.json``,
data caches and shard files) goes through :func:`atomic_write`.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

logger = logging.getLogger(__name__)

#: What :func:`atomic_write` writes: the bytes themselves, or a function that writes them to a
#: binary file (e.g. ``lambda f: torch.save(state, f)``), so large payloads need no copy.
Content = bytes | bytearray | memoryview | Callable[[BinaryIO], object]


def atomic_write(path: str | os.PathLike[str], content: Content) -> Path:
    """Write ``content`` to ``path`` through a temporary file beside it, fsynced and renamed.

    The temporary file has a hidden, unique name (``.<name>.<pid>.<random>.tmp``), so concurrent
    writers never share one and directory listings of the final names never see it; it is
    removed if anything fails. Missing parent directories are created. After the rename the
    directory is fsynced too, so the new name survives a power cut (POSIX; elsewhere best effort).

    Args:
        path: the final file name.
        content: bytes, or a function that writes the file's bytes to the binary file it is given.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        OSError: the directory cannot be created or the file cannot be written; the previous file
            under ``path``, if any, is left as it was.

    Example::

        atomic_write("runs/x/summary.json", json.dumps(summary).encode())
        atomic_write("runs/x/ckpt.pt", lambda f: torch.save(state, f))
    """
    path = Path(path)
    directory = path.parent
    if not directory.is_dir():
        directory.mkdir(parents=True, exist_ok=True)
        _fsync_dir(directory.parent)  # so the new directory itself survives a power cut
    temp = directory / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        with os.fdopen(fd, "wb") as file:
            if callable(content):
                content(file)
            else:
                file.write(content)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    _fsync_dir(directory)
    return path


def _fsync_dir(directory: Path) -> None:
    """Make a rename or new entry in ``directory`` durable (POSIX only; a no-op elsewhere)."""
    if os.name != "posix":
        return
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError as exc:
        logger.debug("cannot open %s to fsync it: %s", directory, exc)
        return
    try:
        os.fsync(fd)
    except OSError as exc:  # some file systems refuse fsync on directories
        logger.debug("cannot fsync directory %s: %s", directory, exc)
    finally:
        os.close(fd)


@contextlib.contextmanager
def exclusive_lock(lock_file: str | os.PathLike[str], timeout_s: float = 600.0) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_file`` (e.g. while one process fills a cache that
    others wait for); the lock file itself is left in place. DataError after ``timeout_s``."""
    from distrain.errors import DataError

    # Deleting the lock file after use would let two processes lock two different inodes.
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise DataError(f"{lock_file}: still locked by another process after {timeout_s:.0f} s") from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
