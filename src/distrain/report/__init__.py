"""Plots and tables from finished run directories (``distrain report``, and ``distrain compare``).

Example::

    from distrain.report import report
    files, table = report(["runs/allreduce-a", "runs/dpsgd-b"], out_dir="runs/report")
    print(table)
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from distrain.errors import ConfigError
from distrain.report.plots import make_plots
from distrain.report.runs import RunData, group_by_label, group_runs, load_run, load_runs
from distrain.report.table import add_speedups, config_row, format_table, run_record, write_csv


def rows_of(groups: dict[str, list[RunData]], baseline: str | None = None) -> list[dict[str, Any]]:
    """Table rows of finished runs grouped by configuration; speed-ups over ``baseline`` (default:
    the first configuration)."""
    rows = []
    for label, runs in groups.items():
        first = runs[0]
        rows.append(config_row(label, [run_record(r.summary, r.path) for r in runs], algorithm=first.algorithm,
                               compress=first.setting("compress", "none"), network=first.setting("network", "none")))
    add_speedups(rows, baseline or next(iter(groups)))
    return rows


def default_out_dir(paths: list[Path]) -> Path:
    """Where ``distrain report`` writes when no ``--out`` is given: a comparison's own directory,
    ``report/`` inside a single run directory, else ``report/`` next to the first run."""
    first = paths[0]
    if (first / "comparison.json").is_file():
        return first
    if len(paths) == 1 and (first / "summary.json").is_file():
        return first / "report"
    return first.resolve().parent / "report"


def report(paths: Iterable[str | Path], out_dir: str | Path | None = None,
           baseline: str | None = None, labels: dict[str, str] | None = None) -> tuple[list[Path], str]:
    """Plot the runs under ``paths`` into ``out_dir``; returns the files written and the table.

    Runs are grouped by configuration (every setting but the seed; see
    :func:`~distrain.report.runs.group_runs`); ``labels`` names the runs under a directory.
    """
    paths = [Path(p) for p in paths]
    runs = load_runs(paths)
    groups = group_runs(runs, labels)
    out = Path(out_dir) if out_dir is not None else default_out_dir(paths)
    files = make_plots(groups, out)
    target = runs[0].summary.get("target_accuracy")
    if baseline is not None and baseline not in groups:
        raise ConfigError("--baseline", f"names no configuration; choose one of: {', '.join(groups)}")
    label = baseline or next(iter(groups))
    return files, format_table(rows_of(groups, label), baseline=label, target=target,
                               target_loss=runs[0].summary.get("target_loss"))


__all__ = ["RunData", "add_speedups", "config_row", "format_table", "group_by_label", "group_runs", "load_run", "load_runs",
           "make_plots", "report", "rows_of", "run_record", "write_csv"]
