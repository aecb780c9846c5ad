"""Reading finished run directories and grouping repeats of one configuration.

A run directory holds ``config.json``, ``summary.json`` and ``metrics/rank<r>.jsonl``. A
*configuration* is every setting of a run but its seed and the settings that cannot change what
it computes (:data:`NOT_CONFIGURATION`: where it writes, how it reports progress, how long it
waits); runs of one configuration are repeats of it, and the report draws their mean with a
shaded min-max band. A group's label is ``algorithm[+compressor][ @network]``, followed by the
settings that tell it apart from other groups of that name (``allreduce workers=2
dataset=digits``), unless a comparison or the user (``--label DIR=NAME``) names it.

Example::

    from distrain.report.runs import load_runs, group_runs
    runs = load_runs(["runs/a", "runs/b"])
    for label, repeats in group_runs(runs).items():
        print(label, [r.summary["final_test_accuracy"] for r in repeats])
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distrain.errors import DataError

log = logging.getLogger(__name__)

#: Metric names that hold a compression ratio (kept fraction), in the order they are looked for.
RATIO_KEYS = ("compression_ratio", "compress_ratio", "ratio")
CONSENSUS_KEY = "consensus_distance"


@dataclass
class RunData:
    """One finished run: its settings, summary and per-worker metrics lines."""

    path: Path
    config: dict[str, Any]
    summary: dict[str, Any]
    metrics: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    label: str = ""

    def setting(self, name: str, default: Any = None) -> Any:
        """A config setting by its field name, from a sectioned or flat config.json."""
        if name in self.config and not isinstance(self.config[name], dict):
            return self.config[name]
        for section in self.config.values():
            if isinstance(section, dict) and name in section:
                return section[name]
        return default

    @property
    def algorithm(self) -> str:
        return str(self.summary.get("algorithm") or self.setting("algorithm", "?"))

    def evals(self, metric: str = "test_accuracy") -> list[dict[str, Any]]:
        """Rank 0's metrics lines that carry ``metric`` (an evaluation's test accuracy or test
        loss; regression runs have no accuracy), in time order.

        Asynchronous algorithms (AD-PSGD, Prague) add ``snapshot`` lines (no ``step``): the
        consensus model evaluated during training, at a global ``epoch``.
        """
        lines = [m for m in self.metrics.get(0, []) if m.get(metric) is not None and "time" in m]
        return sorted(lines, key=lambda m: float(m["time"]))

    def epoch_of(self, line: dict[str, Any]) -> float:
        """The epoch of a metrics line, counted over all workers' samples when the run counts
        ``global_steps`` (asynchronous workers each run at their own pace)."""
        spe, world = self.config.get("steps_per_epoch"), self.config.get("world_size")
        if "step" in line and "global_steps" in line and spe and world:
            return float(line["global_steps"]) / (float(spe) * float(world))
        return float(line["epoch"])

    def membership_events(self) -> list[tuple[str, dict[str, Any]]]:
        """Each change of members in ``summary.json``'s ``membership`` (elastic runs), as
        ``(event, metrics line)``: ``"lost"``, ``"joined"`` or ``"resized"``, and the first step's line (any
        worker's; worker 0 may be the one lost) at or after the step it happened at, which gives
        its time and epoch. A change after the last recorded step is left out."""
        lines = sorted((int(m["step"]), r, m) for r, ms in self.metrics.items() for m in ms
                       if "step" in m and "time" in m and "event" not in m)
        out = []
        for change in self.summary.get("membership") or []:
            step = change.get("lost_at_step", change.get("joined_at_step", change.get("resized_at_step")))
            line = next((m for s, _, m in lines if step is not None and s >= int(step)), None)
            if line is not None:
                out.append((str(change["event"]), line))
        return out

    def series(self, key: str, rank: int | None = None) -> list[tuple[float, float]]:
        """(time, value) of a metric over the run, in time order: one worker's, or the mean over
        workers per step (lines without a step, such as snapshots, count on their own)."""
        ranks = [rank] if rank is not None else sorted(self.metrics)
        by_step: dict[Any, list[tuple[float, float]]] = {}
        for r in ranks:
            for i, m in enumerate(self.metrics.get(r, [])):
                value = m.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and "time" in m:
                    group = ("step", int(m["step"])) if "step" in m else ("line", r, i)
                    by_step.setdefault(group, []).append((float(m["time"]), float(value)))
        points = [(sum(t for t, _ in pts) / len(pts), sum(v for _, v in pts) / len(pts)) for pts in by_step.values()]
        return sorted(points)

    def has_metric(self, key: str) -> bool:
        return any(key in m for lines in self.metrics.values() for m in lines)

    def ratio_key(self) -> str | None:
        """Which compression-ratio field this run's metrics use, if any."""
        return next((k for k in RATIO_KEYS if self.has_metric(k)), None)


def default_label(config: dict[str, Any], summary: dict[str, Any]) -> str:
    """``algorithm[+compressor][ @network]``: what distinguishes runs in a comparison."""
    run = RunData(Path("."), config, summary)
    label = run.algorithm
    compress = run.setting("compress", "none")
    if compress and compress != "none":
        label += f"+{compress}"
    network = run.setting("network", "none")
    if network and network != "none":
        label += f" @{network}"
    return label


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise DataError(f"{path} does not hold a JSON object")
    return data


def read_metrics_dir(path: Path) -> dict[int, list[dict[str, Any]]]:
    """Every ``metrics/rank<r>.jsonl`` of a run; unreadable lines (a crash mid-write) are skipped."""
    out: dict[int, list[dict[str, Any]]] = {}
    for file in sorted((path / "metrics").glob("rank*.jsonl")):
        suffix = file.stem[len("rank"):]
        if not suffix.isdigit():
            continue
        lines = []
        for line in file.read_text().splitlines():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("%s: skipping an unreadable line", file)
        out[int(suffix)] = lines
    return out


def load_run(path: str | Path, label: str | None = None) -> RunData:
    """Load one run directory; DataError if it has no summary.json (an unfinished or failed run)."""
    path = Path(path)
    if not (path / "summary.json").is_file():
        raise DataError(f"{path} is not a finished run directory (no summary.json)")
    summary = _read_json(path / "summary.json")
    config = _read_json(path / "config.json") if (path / "config.json").is_file() else {}
    run = RunData(path, config, summary, read_metrics_dir(path))
    run.label = label or default_label(config, summary)
    return run


def expand_paths(paths: Iterable[str | Path]) -> list[tuple[Path, str | None]]:
    """Run directories named by ``paths``, with a label when a comparison gave one.

    Each path is a run directory, a ``distrain compare`` output directory (its
    ``comparison.json`` lists the runs and their labels), or a directory whose sub-directories
    (up to two levels down) are run directories.
    """
    out: list[tuple[Path, str | None]] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise DataError(f"{path} does not exist")
        if (path / "summary.json").is_file():
            out.append((path, None))
        elif (path / "comparison.json").is_file():
            comparison = _read_json(path / "comparison.json")
            for cfg in comparison.get("configs", []):
                for run in cfg.get("runs", []):
                    if run.get("status") == "ok":  # run_dir: relative to the comparison's directory
                        out.append((path / run["run_dir"], cfg["label"]))
        else:
            found = sorted({p.parent for p in [*path.glob("*/summary.json"), *path.glob("*/*/summary.json")]})
            if not found:
                raise DataError(f"{path} holds no run directories (no summary.json in it or below it)")
            out.extend((p, None) for p in found)
    return out


def load_runs(paths: Iterable[str | Path], labels: Iterable[str | None] | None = None) -> list[RunData]:
    """Load run directories (see :func:`expand_paths`); ``labels`` overrides the labels per run."""
    expanded = expand_paths(paths) if labels is None else [(Path(p), lab) for p, lab in zip(paths, labels, strict=True)]
    runs = [load_run(p, lab) for p, lab in expanded]
    if not runs:
        raise DataError("no run directories to report on")
    return runs


#: Settings that do not change what a run computes: runs differing only in these (and the seed)
#: are repeats of one configuration.
NOT_CONFIGURATION = frozenset({
    "seed", "run_dir", "name", "progress", "master_addr", "master_port", "resume", "overwrite",
    "checkpoint_every", "timeout", "peer_timeout",
})


def configuration(run: RunData) -> dict[str, str]:
    """A run's settings but those in :data:`NOT_CONFIGURATION`, as text, from its config.json."""
    from distrain.config import SECTIONS

    out: dict[str, str] = {}
    for key, value in run.config.items():
        items = value.items() if key in SECTIONS and isinstance(value, dict) else []
        for name, inner in items:
            if name not in NOT_CONFIGURATION:
                out[name] = json.dumps(inner) if not isinstance(inner, str) else inner
    return out


def group_runs(runs: Iterable[RunData], labels: dict[str, str] | None = None) -> dict[str, list[RunData]]:
    """Runs grouped by configuration (every setting but the seed), in first-seen order.

    ``labels`` maps a directory to a name: every run in or below it gets that name, and runs
    given one name form one group whatever their settings (the user says they belong together).
    Other groups are named by :func:`default_label` (or the comparison's label), with the
    settings that differ between groups of the same name appended.
    """
    keyed: dict[tuple[str, tuple[tuple[str, str], ...]], list[RunData]] = {}
    for run in runs:
        named = _user_label(run.path, labels or {})
        key = (named, ()) if named is not None else (run.label, tuple(sorted(configuration(run).items())))
        keyed.setdefault(key, []).append(run)
    by_name: dict[str, list[tuple[tuple[str, str], ...]]] = {}
    for name, settings in keyed:
        by_name.setdefault(name, []).append(settings)
    groups: dict[str, list[RunData]] = {}
    for (name, settings), members in keyed.items():
        label = name
        siblings = by_name[name]
        if len(siblings) > 1:
            differing = _differing(siblings)
            label += " " + " ".join(f"{k}={v}" for k, v in settings if k in differing)
        for run in members:
            run.label = label
        groups.setdefault(label, []).extend(members)
    return groups


def _user_label(path: Path, labels: dict[str, str]) -> str | None:
    resolved = path.resolve()
    for directory, name in labels.items():
        base = Path(directory).resolve()
        if resolved == base or base in resolved.parents:
            return name
    return None


def _differing(variants: list[tuple[tuple[str, str], ...]]) -> set[str]:
    """The settings whose values are not the same in every variant."""
    dicts = [dict(v) for v in variants]
    names = {k for d in dicts for k in d}
    return {k for k in names if len({d.get(k) for d in dicts}) > 1}


def group_by_label(runs: Iterable[RunData]) -> dict[str, list[RunData]]:
    """Runs grouped by label, in first-seen order (repeats of one configuration together)."""
    groups: dict[str, list[RunData]] = {}
    for run in runs:
        groups.setdefault(run.label, []).append(run)
    return groups
