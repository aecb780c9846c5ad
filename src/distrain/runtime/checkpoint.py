"""Checkpoints that survive a crash mid-write, are checked on load, and are kept in per-step sets.

A checkpoint file is a plain ``torch.save`` file of a dict, loadable anywhere with
``torch.load(path, weights_only=True)``. Besides the state it holds one more entry,
``"content_sha256"``: a SHA-256 digest of the state's contents (every key, scalar, dtype, shape
and tensor byte, in order). :func:`load_checkpoint` recomputes it, so a damaged file is refused
instead of training on: damage to the contents fails the digest, damage to the file's structure
fails to load, and damage to neither (zip padding, unused header fields) leaves the state exactly
as it was saved.

Files are written to a temporary name in the same directory, fsynced, then renamed over the final
name (:func:`distrain.runtime.files.atomic_write`), so a reader sees either the previous complete
file or the new complete file, never a mix.

In a multi-worker run every rank writes its own file of a step's *set*::

    <run_dir>/checkpoints/step-00001200/rank-0000.pt
    <run_dir>/checkpoints/step-00001200/rank-0001.pt

There is no barrier between ranks here, so a set counts as complete once all ``world_size`` rank
files exist and pass their checksum (the ``set_size`` its files name, where a run resumed with
another number of workers reads a set its first workers wrote). Ranks are expected to save the same steps in increasing
order; that is what lets rank 0 prune old sets without coordination.

An elastic run that lost workers goes on with fewer: its files then name the workers that write
the set (``"members"``), and the set is complete once each of those has written its file. A worker
missing from such a set when the run resumes starts from a member's file (:meth:`CheckpointStore.source`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import pickle
import re
import shutil
import struct
import time
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from distrain.errors import CheckpointError, ConfigError
from distrain.runtime.files import atomic_write

logger = logging.getLogger(__name__)

#: The entry of a checkpoint file that holds the digest of everything else in it.
CHECKSUM_KEY = "content_sha256"
#: How files of distrain's first checkpoint format began (a 48-byte header before the data);
#: they are recognised only to be refused in one line.
OLD_MAGIC = b"DSTRNCK1"

#: State keys that :func:`check_compatible` compares with the current run.
MODEL_KEY = "model_name"
ALGORITHM_KEY = "algorithm_name"
WORLD_SIZE_KEY = "world_size"
#: The settings that shape a run's model and data (``{flag: value}``, e.g. ``{"--dataset":
#: "mnist1d"}``), which a resumed run must share: another data set or model width would fail
#: deep in ``load_state_dict``, another seed deal the data out anew in silence. Checkpoints
#: before 2026-12-02 have none.
SHAPE_KEY = "shape_settings"
#: The entry naming the ranks whose files make up a step's set, where not every rank writes one
#: (an elastic run after losing workers); absent: every rank of ``world_size``.
MEMBERS_KEY = "members"
#: The entry giving how many processes write a step's set (workers and any servers), where a
#: run may be resumed with another number of them: the set is then read with its writers'
#: count, not the reader's. Absent (files of earlier versions): the reader's ``world_size``.
SET_SIZE_KEY = "set_size"

# Exactly the types torch.load(weights_only=True) rebuilds without extra allow-listing; exact type
# checks, because subclasses (numpy.float64 is a float, namedtuples are tuples) pickle as their
# own class and would only fail later, at load time.
_SCALAR_TYPES = (str, int, float, bool, complex, bytes, type(None), torch.dtype, torch.device)
_STEP_DIR = re.compile(r"step-(\d+)")
_RANK_FILE = re.compile(r"rank-(\d+)\.pt")


class OldCheckpointFormat(CheckpointError):
    """A checkpoint written by an earlier distrain in a format this version does not read."""


def save_checkpoint(path: str | os.PathLike[str], state: dict[str, Any]) -> None:
    """Write ``state`` to ``path`` atomically, with a digest of its contents that a reader checks.

    Only tensors, plain scalars and strings, ``torch.dtype``/``torch.device``/``torch.Size`` and
    dicts, lists, tuples and sets of them may be stored, because :func:`load_checkpoint` loads with
    ``weights_only=True``; anything else is refused here, before a file is touched. The parent
    directory is created if needed. The file is a plain ``torch.save`` file of ``state`` plus the
    entry ``"content_sha256"``.

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
        plain = torch.load("runs/x/ckpt.pt", weights_only=True)  # the same, plus "content_sha256"
    """
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint state must be a dict, got {type(state).__name__}")
    if CHECKSUM_KEY in state:
        raise CheckpointError(f"cannot save a state with a {CHECKSUM_KEY!r} entry: checkpoints keep their digest there")
    _check_storable(state, "state")
    stored = {**state, CHECKSUM_KEY: content_digest(state)}
    path = Path(path)
    try:
        atomic_write(path, lambda file: torch.save(stored, file))
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {path}: {exc}") from exc


def load_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_checkpoint` and check its digest.

    Tensors are loaded onto the CPU with ``weights_only=True``, so a file cannot run code.

    Args:
        path: the checkpoint file.

    Returns:
        The state dict that was saved (without the ``"content_sha256"`` entry).

    Raises:
        CheckpointError: one line naming the file and what is wrong: it does not exist, is not a
            distrain checkpoint, is damaged (truncated, unreadable, or fails its checksum), holds
            disallowed objects, or is in distrain's old format (:class:`OldCheckpointFormat`).

    Example::

        state = load_checkpoint("runs/x/ckpt.pt")
        model.load_state_dict(state["model"])
    """
    path = Path(path)
    _check_file(path)
    try:
        with warnings.catch_warnings():  # a damaged file can make torch warn before it fails
            warnings.simplefilter("ignore")
            state = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        match = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        if match is None:
            raise CheckpointError(f"checkpoint {path} is damaged: {_first_line(exc)}") from exc
        raise CheckpointError(
            f"checkpoint {path} holds an object that weights-only loading refuses ({match.group(1)})"
        ) from exc
    except Exception as exc:  # torch raises many types for a file it cannot parse
        raise CheckpointError(f"checkpoint {path} is damaged or not a checkpoint: {_first_line(exc)}") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(state).__name__}, expected a dict")
    digest = state.pop(CHECKSUM_KEY, None)
    if not isinstance(digest, str):
        raise CheckpointError(
            f"checkpoint {path} is not a distrain checkpoint (it has no {CHECKSUM_KEY!r} entry)"
        )
    if digest != content_digest(state):
        raise CheckpointError(f"checkpoint {path} has a checksum mismatch (corrupted)")
    return state


def verify_checkpoint(path: str | os.PathLike[str]) -> None:
    """Check that a checkpoint loads and matches its digest (see :func:`load_checkpoint`).

    Args:
        path: the checkpoint file.

    Raises:
        CheckpointError: as :func:`load_checkpoint`.

    Example::

        verify_checkpoint("runs/x/ckpt.pt")  # raises if truncated or corrupted
    """
    load_checkpoint(path)


def content_digest(state: Any) -> str:
    """Return the SHA-256 hex digest of a state's contents, independent of how it is stored.

    Covers every key and value in order, with its type; tensors by dtype, shape and bytes (so
    strides and shared storage do not matter); sets in an order independent of hashing.

    Example::

        content_digest({"w": torch.zeros(3), "step": 1}) == content_digest({"w": torch.zeros(3), "step": 1})
    """
    digest = hashlib.sha256()
    _feed(digest, state)
    return digest.hexdigest()


def epoch_steps(samples: int, workers: int, batch_size: int) -> int:
    """The steps of an epoch: ``samples`` training samples in global batches of ``workers`` x
    ``batch_size`` (at least one).

    Example::

        epoch_steps(1280, 4, 16)  # 20
    """
    return max(1, samples // (workers * batch_size))


def planned_steps(epochs: float, steps_per_epoch: int) -> int:
    """The number of steps of a run of ``epochs`` epochs (at least one).

    Example::

        planned_steps(2.5, 40)  # 100
    """
    return max(1, math.ceil(epochs * steps_per_epoch))


def finished_for(state: dict[str, Any], epochs: float) -> bool:
    """Whether a checkpoint already holds ``epochs`` epochs of training (or more).

    Uses the ``"step"`` and ``"steps_per_epoch"`` entries the training loop saves; False when
    either is missing.

    Example::

        finished_for({"step": 300, "steps_per_epoch": 20}, epochs=15)  # True
    """
    per_epoch = state.get("steps_per_epoch")
    if "step" not in state or not isinstance(per_epoch, int) or per_epoch < 1:
        return False
    return int(state["step"]) >= planned_steps(epochs, per_epoch)


def check_compatible(
    state: dict[str, Any], *, model: str, algorithm: str, world_size: int | None = None,
    shape: dict[str, Any] | None = None,
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
        shape: this run's :data:`SHAPE_KEY` settings, checked against the checkpoint's where it
            has them.

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
    saved = state.get(SHAPE_KEY) or {}
    # (None: the model's default on either side, which may be the other's value: load_state_dict tells)
    differ = [flag for flag, value in (shape or {}).items()
              if saved.get(flag) is not None and value is not None and saved[flag] != value]
    if differ:
        raise CheckpointError("checkpoint was written with " + ", ".join(f"{f} {saved[f]}" for f in differ)
                              + "; this run has " + ", ".join(f"{f} {shape[f]}" for f in differ)  # type: ignore[index]
                              + ": resume with the same settings, or start a new run in another --run-dir")


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
        #: the rank that prunes: 0, or the first member of the last set saved without rank 0
        self.pruner = 0
        self._members: dict[int, list[int]] = {}

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
            state: the state dict, as for :func:`save_checkpoint`; with a ``"members"`` entry
                when only those ranks write this step's set.

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
        members = state.get(MEMBERS_KEY)
        self.pruner = min(members) if members else 0  # rank 0 prunes unless it is not a member
        if self.rank == self.pruner:
            self.prune()
        return path

    def load(self, step: int, rank: int | None = None) -> dict[str, Any]:
        """Load one rank's file of ``step``'s set (this rank's when None); see :func:`load_checkpoint`."""
        return load_checkpoint(self.rank_file(step, rank))

    def members(self, step: int) -> list[int]:
        """The ranks whose files make up ``step``'s set: those its files name (an elastic run that
        had lost workers when it saved), else every rank of the run that wrote it (its files'
        ``set_size``, which a run resumed with another number of workers differs from)."""
        if step not in self._members:  # a set's files, written once, keep naming the same members
            self._members[step] = self._inspect(step)[0]
        return self._members[step]

    def source(self, step: int) -> int:
        """The rank whose file of ``step``'s set this rank resumes from: its own, or, for a worker
        the set lacks (lost before that step), the first member's.

        Example::

            state = store.load(step, store.source(step))
        """
        members = self.members(step)
        return self.rank if self.rank in members else min(members)

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

        Only rank 0 deletes (or the first member, in an elastic run that lost rank 0); on other
        ranks this does nothing. Nothing newer than the oldest kept
        set is touched (another rank may still be writing it), and with no complete set nothing
        is deleted, so the only complete set is never lost.
        The kept sets are re-read and checksummed each time, so a file damaged after it was
        written does not count as part of a complete set.

        Returns:
            The steps whose directories were deleted.

        Example::

            store.prune()  # called by save() on rank 0
        """
        if self.rank != self.pruner:
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
            if isinstance(problem, OldCheckpointFormat):
                # Not damage: starting afresh instead would silently redo (and overwrite) a run.
                raise problem
            logger.log(level, "skipping checkpoint step %d: %s", step, problem)
        if steps:
            logger.log(level, "no complete checkpoint set in %s", self.directory)
        return None

    def _problem(self, step: int) -> CheckpointError | None:
        """Return what is wrong with ``step``'s set, naming the file, or None if it is complete
        (then its members are kept for :meth:`members`, which need not read the files again)."""
        members, problem = self._inspect(step)
        if problem is None:
            self._members[step] = members
        return problem

    def _inspect(self, step: int) -> tuple[list[int], CheckpointError | None]:
        """The ranks ``step``'s set must hold (see :meth:`members`) and what is wrong with it,
        naming the file (None: complete). Every file there is checked. Of the files that name
        members, the one that names fewest wins: a process that had not yet heard of a loss when
        it saved names the lost one too (the others must include every member it names)."""
        named: dict[Path, list[int]] = {}
        sizes: list[tuple[float, int]] = []  # (when written, the set size it names)
        present = self._ranks_in(step)
        for rank in present:
            path = self.rank_file(step, rank)
            try:
                state = load_checkpoint(path)
            except CheckpointError as exc:
                return list(range(self.world_size)), exc
            members = state.get(MEMBERS_KEY)
            if members is not None:
                named[path] = sorted(int(m) for m in members)
            if isinstance(state.get(SET_SIZE_KEY), int):
                sizes.append((path.stat().st_mtime, int(state[SET_SIZE_KEY])))
        # the newest file's count: files a run of another size left in a set it never finished
        # are older than those of the run that wrote the set again
        size = max(sizes)[1] if sizes else self.world_size
        expected = min(named.values(), key=len) if named else list(range(size))
        for path, members in named.items():
            if not set(expected) <= set(members):
                return expected, CheckpointError(f"checkpoint {path} names members {members}, another file of "
                                                 f"its set {expected}")
        for rank in expected:
            if rank not in present:
                try:
                    verify_checkpoint(self.rank_file(step, rank))  # names the missing file
                except CheckpointError as exc:
                    return expected, exc
        return expected, None

    def _ranks_in(self, step: int) -> list[int]:
        """The ranks that have a file in ``step``'s directory (of any run size)."""
        try:
            names = [entry.name for entry in self.step_dir(step).iterdir()]
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(int(m.group(1)) for m in map(_RANK_FILE.fullmatch, names) if m)

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


def _check_file(path: Path) -> None:
    """Refuse, in one line, what is not a readable file or is in the old checkpoint format."""
    try:
        with open(path, "rb") as file:
            start = file.read(len(OLD_MAGIC))
    except FileNotFoundError as exc:
        raise CheckpointError(f"checkpoint {path} does not exist") from exc
    except IsADirectoryError as exc:
        raise CheckpointError(f"checkpoint {path} is a directory, not a file") from exc
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
    if not start:
        raise CheckpointError(f"checkpoint {path} is empty")
    if start == OLD_MAGIC:
        raise OldCheckpointFormat(
            f"checkpoint {path} is in distrain's old format (a 48-byte header before the data), "
            "which this version does not read; resume it with the distrain that wrote it, or "
            "start afresh with --resume none"
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def _feed(digest: Any, obj: Any) -> None:
    """Add ``obj`` to ``digest``: a type tag, then its contents, each length-prefixed."""
    kind = type(obj)

    def put(tag: str, data: bytes | memoryview = b"") -> None:
        digest.update(struct.pack(">I", len(tag)) + tag.encode() + struct.pack(">Q", len(data)))
        digest.update(data)

    if isinstance(obj, torch.Tensor):
        tensor = obj.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
        put(f"tensor {tensor.dtype} {tuple(obj.shape)}")
        if tensor.numel():
            digest.update(tensor.view(torch.uint8).numpy().data)
    elif kind is torch.Size:
        put(f"size {tuple(obj)}")
    elif kind in (dict, OrderedDict):
        put(f"{kind.__name__} {len(obj)}")
        for key, value in obj.items():
            _feed(digest, key)
            _feed(digest, value)
    elif kind in (list, tuple):
        put(f"{kind.__name__} {len(obj)}")
        for value in obj:
            _feed(digest, value)
    elif kind is set:
        put(f"set {len(obj)}")
        for part in sorted(content_digest(value) for value in obj):
            put(part)
    else:  # scalars: repr is exact for floats and distinguishes 1, 1.0 and True with the type
        put(f"{kind.__name__}", repr(obj).encode())
