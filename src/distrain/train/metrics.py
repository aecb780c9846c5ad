"""Per-step metrics lines, evaluation, and the run summary.

What each field means, in ``metrics/rank<r>.jsonl`` (one line per step of that worker) and in
``summary.json`` (one value per worker). Times are seconds of the worker's wall clock on its
training time (evaluation left out); "cumulative" counts from the run's start, across resumes.

================================ ============ ================================================
field                            kind         meaning
================================ ============ ================================================
``time``                         cumulative   training time when the step ended
``bytes_sent``, ``bytes_received`` cumulative  bytes this worker sent to / received from peers
``step_s``                       per step     the step's wall time (data, compute, waits, update)
``compute_s``                    per step     forward and backward (with an emulated slow
                                              device's extra time), less any wait on the
                                              network inside them
``exposed_comm_s``               per step     time the training thread was blocked on
                                              communication (``Transport`` waits, gossip lag
                                              waits): the part of the exchanges no compute hid;
                                              ``compute_s + exposed_comm_s <= step_s``
``comm_busy_s``                  per step     the step's exchanges from start to finish, added
                                              up; they overlap compute and each other, so this
                                              may exceed the step's time
``loss``, ``lr``                 per step     training loss of the batch, learning rate
``test_accuracy``, ``test_loss`` at evals     the (consensus) model on the test set
``test_bpb``                     at evals     language models: the test loss in bits per byte
``tokens_per_s``                 at evals     language models, synchronous algorithms: every
                                              worker's training tokens so far over ``time``
                                 run total    (summary) every worker's training tokens over
                                              ``wall_time_s``
``compute_s_per_worker``         run total    sum of ``compute_s``
``exposed_comm_s_per_worker``    run total    sum of ``exposed_comm_s``; with
                                              ``compute_s_per_worker`` it is at most
                                              ``wall_time_s`` of that worker
``wall_time_s``                  run total    training time of worker 0 (or the first
                                              survivor), all segments
``event``                        at changes   elastic runs: ``"lost"`` on the line of the step a
                                              survivor redid without ``workers`` (their ids);
                                              ``members`` went on from ``lost_at_step`` steps
                                              done, ``recovery_s`` after the failure showed
                                              (agreement and the new group), at ``unix_time``;
                                              ``"resized"`` on the line of the step a run
                                              resumed with another number of workers went on
                                              from (``workers_before``, ``members``, ``left``,
                                              ``joined``, ``resized_at_step``)
``membership``                   run total    (summary) those events, one per change;
                                              ``workers_at_end``: how many trained last;
                                              ``joined_workers``: id -> Unix time it last
                                              joined (``"joined"`` events, and
                                              ``joined`` of ``"resized"`` ones), beside
                                              ``lost_workers``
``lost_servers``                 run total    (summary, parameter servers) servers lost and
                                              taken over by the others: index -> Unix time
                                              (the last loss)
``returned_servers``             run total    (summary, parameter servers) servers started
                                              again that took their range back: index ->
                                              Unix time (the last return)
================================ ============ ================================================

The DDP baselines measure the same fields; DDP waits for its last buckets inside backward, and
that wait (from the last bucket's hook to the end of backward) plus the optimizer step and any
averaging after it is their exposed communication.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from distrain.runtime.files import atomic_write

log = logging.getLogger(__name__)


class MetricsWriter:
    """Appends one JSON object per line to ``metrics/rank<r>.jsonl`` in the run directory.

    ``resume_step``: the run continues from a checkpoint of that step, so the file is kept up to
    it and continued; lines of later steps (from a segment that died after the checkpoint, and
    that this one trains again) are dropped first.
    """

    def __init__(self, run_dir: str | Path, rank: int, resume_step: int | None = None) -> None:
        path = Path(run_dir) / "metrics" / f"rank{rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        if resume_step is not None and path.is_file():
            _keep_until(path, resume_step)
        self._file = open(path, "a" if resume_step is not None else "w", buffering=1 << 16)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, allow_nan=True) + "\n")

    def close(self) -> None:
        self._file.close()


def parse_record(line: str) -> dict[str, Any] | None:
    """One metrics line's record, or None for a line cut short when its writer died."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def _keep_until(path: Path, step: int) -> None:
    """Rewrite a metrics file (atomically) without its lines past ``step``, if it has any."""
    lines = path.read_text().splitlines(keepends=True)
    kept = []
    for line in lines:
        record = parse_record(line)
        if record is not None and record.get("step", 0) <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    if kept != lines:
        atomic_write(path, "".join(kept).encode())


def read_metrics(run_dir: str | Path, rank: int = 0) -> list[dict[str, Any]]:
    """The metrics lines of one worker of a finished run."""
    path = Path(run_dir) / "metrics" / f"rank{rank}.jsonl"
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write ``data`` as JSON (NaN and infinity as null) so that readers never see half a file."""
    text = json.dumps(_finite(data), indent=2, allow_nan=False, default=_json_default)
    atomic_write(path, text.encode())


def write_summary(path: str | Path, summary: dict[str, Any]) -> bool:
    """Write ``summary.json`` atomically, unless a resumed run would replace a better one.

    A resumed run (``segments`` above 1) never replaces a summary that covers more training
    steps (every worker's; the furthest step where the number of workers changed), or as many
    with a final accuracy where the new one has none: e.g. one resumed from
    an earlier checkpoint and stopped before reaching the step the recorded result has. Returns
    whether the file was written.
    """
    path = Path(path)
    if summary.get("segments", 1) > 1 and path.is_file():
        try:
            old = json.loads(path.read_text())
        except (OSError, ValueError):
            old = None
        if isinstance(old, dict) and _covers_more(old, summary):
            log.warning("kept %s: it records a fuller result (%d steps) than this resumed run (%d steps)",
                        path, _steps(old), _steps(summary))
            return False
    write_json_atomic(path, summary)
    return True


def _steps(summary: dict[str, Any]) -> int:
    return int(sum(summary.get("steps_per_worker") or [0]))


def _furthest(summary: dict[str, Any]) -> int:
    return int(max(summary.get("steps_per_worker") or [0]))


def _covers_more(old: dict[str, Any], new: dict[str, Any]) -> bool:
    if len(old.get("steps_per_worker") or []) != len(new.get("steps_per_worker") or []):
        # resumed with another number of workers: the run that got further covers more
        if _furthest(old) != _furthest(new):
            return _furthest(old) > _furthest(new)
    elif _steps(old) != _steps(new):
        return _steps(old) > _steps(new)
    return old.get("final_test_accuracy") is not None and _finite(new.get("final_test_accuracy")) is None


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return _finite(value.tolist())
    raise TypeError(f"cannot write {type(value).__name__} to JSON")
