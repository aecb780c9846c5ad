"""Errors distrain raises for bad input; each carries the setting it is about."""

from __future__ import annotations


def flag(name: str) -> str:
    """The command-line flag of a config field: ``batch_size`` -> ``--batch-size``."""
    return "--" + name.replace("_", "-")


class DistrainError(Exception):
    """Base class for errors that the command line reports in one line."""


class ConfigError(DistrainError, ValueError):
    """A setting has a value that is not allowed.

    Args:
        setting: the flag or field name, e.g. ``--lr`` or ``lr``.
        message: what is allowed, e.g. ``"must be a finite number > 0, got -1"``.
    """

    def __init__(self, setting: str, message: str) -> None:
        self.setting = setting
        self.message = message
        super().__init__(f"{setting}: {message}")


class DataError(DistrainError, ValueError):
    """A data set or data file cannot be used (missing arrays, bad format, empty)."""


class CheckpointError(DistrainError, RuntimeError):
    """A checkpoint file is missing, truncated, corrupted or belongs to another run."""


class WorkerFailure(DistrainError, RuntimeError):
    """A peer stopped answering or a worker process failed."""


class PeerTimeout(RuntimeError):
    """A peer did not answer: its heartbeat stopped while we waited for it, or it stayed silent
    past the ceiling. A communication error (:func:`distrain.runtime.faults.is_comm_error`),
    whatever its message says."""


class Interrupted(Exception):
    """The run was asked to stop (SIGTERM / Ctrl-C); a checkpoint was written at ``step``
    (-1: unknown) in ``run_dir``."""

    def __init__(self, step: int, run_dir: object = None) -> None:
        self.step, self.run_dir = step, run_dir
        message = "stopped on request" + (f" after step {step}" if step >= 0 else "")
        if run_dir is not None:
            message += f"; continue with --resume auto --run-dir {run_dir}"
        super().__init__(message)
