"""Checkpoints that survive a crash mid-write, are checked on load, and are kept in per-step sets.

A checkpoint file is a 48-byte header followed by a ``torch.save`` payload::

    magic    8 bytes   b"DSTRNCK1"
    length   8 bytes   payload length, big-endian unsigned
    sha256  32 bytes   SHA-256 digest of the payload
    payload            torch.save(state), loaded back with weights_only=True

Files are written to a temporary name in the same directory, fsynced, then renamed over the final
name, so a reader sees either the previous complete file or the new complete file, never a mix.

In a multi-worker run every rank writes its own file of a step's *set*::

    <run_dir>/checkpoints/step-00001200/rank-0000.pt
    <run_dir>/checkpoints/step-00001200/rank-0001.pt

There is no barrier between ranks here, so a set counts as complete once all ``world_size`` rank
files exist and pass their checksum. Ranks are expected to save the same steps in increasing
order; that is what lets rank 0 prune old sets without coordination.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import logging
import os
import pickle
import re
import secrets
import shutil
import struct
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from distrain.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

MAGIC = b"DSTRNCK1"
_HEADER = struct.Struct(">8sQ32s")
HEADER_SIZE = _HEADER.size

#: State keys that :func:`check_compatible` compares with the current run.
MODEL_KEY = "model_name"
ALGORITHM_KEY = "algorithm_name"
WORLD_SIZE_KEY = "world_size"

# Exactly the types torch.load(weights_only=True) rebuilds without extra allow-listing; exact type
# checks, because subclasses (numpy.float64 is a float, namedtuples are tuples) pickle as their
# own class and would only fail later, at load time.
_SCALAR_TYPES = (str, int, float, bool, complex, bytes, type(None), torch.dtype, torch.device)
_STEP_DIR = re.compile(r"step-(\d+)")


def save_checkpoint(path: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically, with a header that lets a reader detect damage.

    Only tensors, plain scalars and strings, ``torch.dtype``/``torch.device``/``torch.Size`` and
    dicts, lists, tuples and sets of them may be stored, because :func:`load_checkpoint` loads with
    ``weights_only=True``; anything else is refused here, before a file is touched. The parent
    directory is created if needed.

    Args:
        path: the final file name, e.g. ``runs/x/ckpt.pt``.
        state: a dict such as ``{"model": model.state_dict(), "optimizer": opt.state_dict(),
            "step": 120, "model_name": "mlp", "algorithm_name": "allreduce"}``.

    Raises:
        CheckpointError: ``state`` holds a value that cannot be loaded back safely, or the file
            cannot be written (the previous file under ``path``, if any, is left as it was).

    Example::

        save_checkpoint("runs/x/ckpt.pt", {"model": model.state_dict(), "step": 120})
        state = load_checkpoint("runs/x/ckpt.pt")
    """
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint state must be a dict, got {type(state).__name__}")
    _check_storable(state, "state")
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getbuffer()
    header = _HEADER.pack(MAGIC, len(payload), hashlib.sha256(payload).digest())
    _write_atomic(Path(path), header, payload)


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint`, checking length and checksum first.

    Tensors are loaded onto the CPU with ``weights_only=True``, so a file cannot run code.

    Args:
        path: the checkpoint file.

    Returns:
        The state dict that was saved.

    Raises:
        CheckpointError: one line naming the file and what is wrong: it does not exist, is not a
            distrain checkpoint, is truncated, fails its checksum, or holds disallowed objects.

    Example::

        state = load_checkpoint("runs/x/ckpt.pt")
        model.load_state_dict(state["model"])
    """
    path = Path(path)
    payload = _read_payload(path)
    try:
        state = torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        match = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        what = match.group(1) if match else str(exc).splitlines()[0]
        raise CheckpointError(
            f"checkpoint {path} holds an object that weights-only loading refuses ({what})"
        ) from exc
    except Exception as exc:  # torch raises many types for a payload it cannot parse
        raise CheckpointError(f"checkpoint {path} cannot be unpickled: {exc}") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(state).__name__}, expected a dict")
    return state


def verify_checkpoint(path: str | os.PathLike[str]) -> None:
    """Check a checkpoint's header, length and checksum without unpickling it.

    Args:
        path: the checkpoint file.

    Raises:
        CheckpointError: as :func:`load_checkpoint`, for everything short of unpickling.

    Example::

        verify_checkpoint("runs/x/ckpt.pt")  # raises if truncated or corrupted
    """
    _read_payload(Path(path))


def check_compatible(
    state: dict[str, Any], *, model: str, algorithm: str, world_size: int | None = None
) -> None:
    """Refuse a checkpoint written by a different model, algorithm or (optionally) world size.

    The checkpoint must carry the keys ``"model_name"`` and ``"algorithm_name"`` (and
    ``"world_size"`` when ``world_size`` is given); ``"algorithm"`` is left free for the
    algorithm's own state dict.

    Args:
        state: a state dict returned by :func:`load_checkpoint`.
        model: the model name of this run, e.g. ``"mlp"``.
        algorithm: the algorithm name of this run, e.g. ``"allreduce"``.
        world_size: the number of workers of this run; ``None`` skips that check.

    Raises:
        CheckpointError: a key is missing or a value differs; the message shows both sides.

    Example::

        check_compatible(state, model="mlp", algorithm="allreduce", world_size=4)
    """
    expected: dict[str, Any] = {MODEL_KEY: model, ALGORITHM_KEY: algorithm}
    if world_size is not None:
        expected[WORLD_SIZE_KEY] = world_size
    missing = [key for key in expected if key not in state]
    if missing:
        names = ", ".join(repr(key) for key in missing)
        raise CheckpointError(
            f"checkpoint has no {names} entry, so it cannot be matched to this run"
        )
    found = {key: state[key] for key in expected}
    if found != expected:
        raise CheckpointError(
            f"checkpoint was written by {_describe(found)}; this run uses {_describe(expected)}"
        )


class CheckpointStore:
    """One rank's view of a run's checkpoint sets: save, find the newest complete set, prune.

    Args:
        run_dir: the run directory; checkpoints go to ``run_dir/checkpoints/``.
        rank: this worker's rank, ``0 <= rank < world_size``.
        world_size: number of workers, each writing one file per saved step.
        keep: how many complete sets rank 0 keeps when pruning (at least 1).

    Example::

        store = CheckpointStore("runs/x", rank=rank, world_size=world_size, keep=3)
        start = store.resolve("auto")  # newest complete, valid set, or None
        if start is not None:
            state = store.load(start)
            check_compatible(state, model="mlp", algorithm="allreduce", world_size=world_size)
        ...
        store.save(step, {"model": model.state_dict(), "step": step, ...})
    """

    def __init__(
        self, run_dir: str | os.PathLike[str], rank: int, world_size: int, keep: int = 3
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError("world_size", f"must be an integer >= 1, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ConfigError("rank", f"must be an integer in [0, {world_size}), got {rank!r}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError("keep", f"must be an integer >= 1, got {keep!r}")
        self.directory = Path(run_dir) / "checkpoints"
        self.rank = rank
        self.world_size = world_size
        self.keep = keep

    def __repr__(self) -> str:
        return (
            f"CheckpointStore({str(self.directory.parent)!r}, rank={self.rank}, "
            f"world_size={self.world_size}, keep={self.keep})"
        )

    def step_dir(self, step: int) -> Path:
        """Return the directory of a step's set, e.g. ``.../checkpoints/step-00001200``."""
        return self.directory / f"step-{step:08d}"

    def rank_file(self, step: int, rank: int | None = None) -> Path:
        """Return one rank's file in a step's set (this rank's when ``rank`` is None)."""
        return self.step_dir(step) / f"rank-{self.rank if rank is None else rank:04d}.pt"

    def steps(self) -> list[int]:
        """Return every step that has a directory, complete or not, in increasing order."""
        try:
            entries = list(self.directory.iterdir())
        except FileNotFoundError:
            return []
        steps = []
        for entry in entries:
            match = _STEP_DIR.fullmatch(entry.name)
            if match and entry.is_dir():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write this rank's file of ``step``'s set atomically; rank 0 then prunes old sets.

        Args:
            step: the training step the state belongs to (>= 0).
            state: the state dict, as for :func:`save_checkpoint`.

        Returns:
            The path written.

        Example::

            store.save(1200, {"model": model.state_dict(), "step": 1200})
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError("step", f"must be an integer >= 0, got {step!r}")
        path = self.rank_file(step)
        started = time.perf_counter()
        save_checkpoint(path, state)
        logger.info(
            "saved checkpoint %s (%d bytes, %.3f s)",
            path,
            path.stat().st_size,
            time.perf_counter() - started,
        )
        if self.rank == 0:
            self.prune()
        return path

    def load(self, step: int) -> dict[str, Any]:
        """Load this rank's file of ``step``'s set; see :func:`load_checkpoint`."""
        return load_checkpoint(self.rank_file(step))

    def latest_complete(self) -> int | None:
        """Return the newest step whose set is complete and passes its checksums, or None."""
        return self._newest_complete(logging.DEBUG)

    def resolve(self, resume: str) -> int | None:
        """Turn a ``--resume`` value into the step to resume from, or None to start fresh.

        Args:
            resume: ``"auto"`` (newest complete, valid set; older sets are tried when newer ones
                are incomplete or damaged, with a warning naming the bad file), ``"none"`` or
                ``""`` (start fresh), a step number such as ``"1200"``, or the path of a step
                directory of this run such as ``runs/x/checkpoints/step-00001200``.

        Raises:
            CheckpointError: an explicitly named set is missing, incomplete or damaged; the
                message names the file.

        Example::

            step = store.resolve("auto")
        """
        value = resume.strip()
        if value.lower() in ("", "none"):
            return None
        if value.lower() == "auto":
            return self._newest_complete(logging.WARNING)
        if value.isdigit():
            step = int(value)
        else:
            step = self._step_from_path(Path(value))
        problem = self._problem(step)
        if problem is not None:
            raise CheckpointError(f"cannot resume from step {step}: {problem}")
        return step

    def prune(self) -> list[int]:
        """Delete step directories older than the oldest of the newest ``keep`` complete sets.

        Only rank 0 deletes; on other ranks this does nothing. Nothing newer than the oldest kept
        set is touched (another rank may still be writing it), and with no complete set nothing
        is deleted, so the only complete set is never lost.
        The kept sets are re-read and checksummed each time, so a file damaged after it was
        written does not count as part of a complete set.

        Returns:
            The steps whose directories were deleted.

        Example::

            store.prune()  # called by save() on rank 0
        """
        if self.rank != 0:
            return []
        steps = self.steps()
        kept: list[int] = []
        for step in reversed(steps):
            if self._problem(step) is None:
                kept.append(step)
                if len(kept) == self.keep:
                    break
        if not kept:
            return []
        oldest_kept = kept[-1]
        removed = []
        for step in steps:
            if step >= oldest_kept:
                break
            directory = self.step_dir(step)
            try:
                shutil.rmtree(directory)
            except OSError as exc:
                logger.warning("could not delete old checkpoint set %s: %s", directory, exc)
                continue
            removed.append(step)
        if removed:
            logger.info("pruned checkpoint sets %s; kept %s", removed, sorted(kept))
        return removed

    def _newest_complete(self, level: int) -> int | None:
        steps = self.steps()
        for step in reversed(steps):
            problem = self._problem(step)
            if problem is None:
                return step
            logger.log(level, "skipping checkpoint step %d: %s", step, problem)
        if steps:
            logger.log(level, "no complete checkpoint set in %s", self.directory)
        return None

    def _problem(self, step: int) -> str | None:
        """Return what is wrong with ``step``'s set, naming the file, or None if it is complete."""
        for rank in range(self.world_size):
            try:
                verify_checkpoint(self.rank_file(step, rank))
            except CheckpointError as exc:
                return str(exc)
        return None

    def _step_from_path(self, path: Path) -> int:
        if path.is_file():
            path = path.parent
        match = _STEP_DIR.fullmatch(path.name)
        if match is None:
            raise CheckpointError(
                f"resume path {path} is not a checkpoint step directory "
                f"(expected {self.directory}/step-NNNNNNNN)"
            )
        if not path.is_dir():
            raise CheckpointError(f"checkpoint directory {path} does not exist")
        step = int(match.group(1))
        if path.resolve() != self.step_dir(step).resolve():
            raise CheckpointError(
                f"checkpoint directory {path} is not one of this run's; "
                f"this run keeps its checkpoints in {self.directory}"
            )
        return step


def _describe(values: dict[str, Any]) -> str:
    labels = {MODEL_KEY: "model", ALGORITHM_KEY: "algorithm", WORLD_SIZE_KEY: "world size"}
    return " / ".join(f"{labels[key]} {value!r}" for key, value in values.items())


def _check_storable(obj: Any, where: str) -> None:
    """Raise CheckpointError naming the first value that weights-only loading would refuse."""
    kind = type(obj)
    if kind in _SCALAR_TYPES or kind is torch.Size or isinstance(obj, torch.Tensor):
        return
    if kind in (dict, OrderedDict):
        for key, value in obj.items():
            _check_storable(key, f"{where} key {key!r}")
            _check_storable(value, f"{where}[{key!r}]")
        return
    if kind in (list, tuple, set):
        for index, value in enumerate(obj):
            _check_storable(value, f"{where}[{index}]")
        return
    raise CheckpointError(
        f"cannot save {where}: a {kind.__module__}.{kind.__qualname__} cannot be loaded back "
        "with weights_only=True; store tensors, numbers, strings, and dicts/lists of them"
    )


def _read_payload(path: Path) -> bytes:
    """Return the payload of a checkpoint file after checking magic, length and checksum."""
    try:
        with open(path, "rb") as file:
            header = file.read(HEADER_SIZE)
            data_size = os.fstat(file.fileno()).st_size - HEADER_SIZE
            if len(header) < len(MAGIC):
                if not header:
                    raise CheckpointError(f"checkpoint {path} is empty")
                if MAGIC.startswith(header):
                    raise CheckpointError(
                        f"checkpoint {path} is truncated (only {len(header)} bytes)"
                    )
            if header[: len(MAGIC)] != MAGIC:
                hint = " (it looks like a plain torch.save file)" if header[:2] == b"PK" else ""
                raise CheckpointError(f"checkpoint {path} is not a distrain checkpoint{hint}")
            if len(header) < HEADER_SIZE:
                raise CheckpointError(
                    f"checkpoint {path} is truncated (header has {len(header)} of "
                    f"{HEADER_SIZE} bytes)"
                )
            _, length, digest = _HEADER.unpack(header)
            if data_size < length:
                raise CheckpointError(
                    f"checkpoint {path} is truncated "
                    f"(expected {length} bytes of data, found {data_size})"
                )
            if data_size > length:
                raise CheckpointError(
                    f"checkpoint {path} has {data_size - length} unexpected bytes after its data "
                    f"(expected {length} bytes of data, found {data_size})"
                )
            payload = file.read(length)
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint {path} does not exist") from exc
    except IsADirectoryError as exc:
        raise CheckpointError(f"checkpoint {path} is a directory, not a file") from exc
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    if len(payload) != length:  # the file shrank while being read
        raise CheckpointError(
            f"checkpoint {path} is truncated (expected {length} bytes of data, "
            f"found {len(payload)})"
        )
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"checkpoint {path} has a checksum mismatch (corrupted)")
    return payload


def _write_atomic(path: Path, *chunks: bytes | memoryview) -> None:
    """Write ``chunks`` to a temporary file beside ``path``, fsync it, and rename it over ``path``."""
    directory = path.parent
    if not directory.is_dir():
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"cannot create checkpoint directory {directory}: {exc}") from exc
        _fsync_dir(directory.parent)  # so the new step directory itself survives a power cut
    # A hidden, unique name: concurrent writers never share it, and listings of rank files or
    # step directories never mistake it for a checkpoint.
    temp = directory / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        with os.fdopen(fd, "wb") as file:
            for chunk in chunks:
                file.write(chunk)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        if isinstance(exc, OSError):
            raise CheckpointError(f"cannot write checkpoint {path}: {exc}") from exc
        raise
    _fsync_dir(directory)


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
