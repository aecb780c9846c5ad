"""PNG plots of finished runs: one line (or bar group) per configuration, repeats aggregated.

Lines show the mean over a configuration's repeats with a shaded min-max band; bars show the
mean with min-max error bars. Matplotlib's object API is used (no pyplot), so plotting works in
worker processes and headless machines and leaves no global figure state behind.

Example::

    from distrain.report.plots import plot_accuracy
    from distrain.report.runs import group_by_label, load_runs
    plot_accuracy(group_by_label(load_runs(["runs/a"])), "time", "acc.png")
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from distrain.extras import require
from distrain.report.runs import CONSENSUS_KEY, RunData

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Groups = dict[str, list[RunData]]
#: (x, mean, min, max) of one configuration's curve.
Curve = tuple[list[float], list[float], list[float], list[float]]

DPI = 110
#: Largest figure drawn (inches): with 20 configurations panels go into a grid, not a taller page.
MAX_WIDTH, MAX_HEIGHT = 16.0, 12.0
#: Beyond this many lines a legend goes beside the axes instead of over the data.
LEGEND_INSIDE_MAX = 4


def _matplotlib(module: str = "matplotlib") -> ModuleType:
    """matplotlib (or one of its modules), imported on first use: it is the ``plots`` extra."""
    return require(module, feature="plotting", setting="plots")


def colors(groups: Groups) -> dict[str, Any]:
    """One colour per configuration, the same in every plot of a report."""
    cmap = _matplotlib().colormaps["tab10" if len(groups) <= 10 else "tab20"]
    return {label: cmap(i % cmap.N) for i, label in enumerate(groups)}


def _figure(width: float = 7.5, height: float = 4.5) -> tuple[Figure, Any]:
    fig = _matplotlib("matplotlib.figure").Figure(figsize=(min(width, MAX_WIDTH), min(height, MAX_HEIGHT)), dpi=DPI,
                                                  layout="constrained")
    return fig, fig.add_subplot(1, 1, 1)


def _legend(ax: Any, entries: int) -> None:
    """A legend that does not hide data: inside for a few lines, beside the axes for more."""
    if entries <= LEGEND_INSIDE_MAX:
        ax.legend(fontsize="small")
    else:
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
                  ncol=1 if entries <= 25 else 2)


def _save(fig: Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)  # constrained layout keeps titles, labels and outside legends apart
    return path


def aggregate(curves: list[list[tuple[float, float]]]) -> Curve:
    """Mean x, and mean / min / max y, point by point over repeats (cut to the shortest)."""
    n = min((len(c) for c in curves), default=0)
    xs, mean, lo, hi = [], [], [], []
    for i in range(n):
        points = [c[i] for c in curves]
        ys = [y for _, y in points]
        xs.append(sum(x for x, _ in points) / len(points))
        mean.append(sum(ys) / len(ys))
        lo.append(min(ys))
        hi.append(max(ys))
    return xs, mean, lo, hi


#: How a change of members is marked: a dotted vertical line with this marker at the top.
EVENT_MARKERS = {"lost": "v", "joined": "^"}


def _mark_events(ax: Any, runs: list[RunData], color: Any, x_of: Callable[[RunData, dict[str, Any]], float]) -> set[str]:
    """A dotted vertical line, marked at the top, where a worker was lost or joined in each run
    (``x_of``: the x of a metrics line); returns the kinds drawn."""
    kinds = set()
    for run in runs:
        for event, line in run.membership_events():
            x = x_of(run, line)
            ax.axvline(x, color=color, linestyle=":", linewidth=1.0, alpha=0.8)
            ax.plot([x], [1.0], marker=EVENT_MARKERS.get(event, "o"), color=color, markersize=6,
                    transform=ax.get_xaxis_transform(), clip_on=False)
            kinds.add(event)
    return kinds


def _event_legend(ax: Any, kinds: set[str]) -> int:
    """Legend entries for the kinds of change drawn; returns how many."""
    for event in sorted(kinds):
        ax.plot([], [], linestyle=":", marker=EVENT_MARKERS.get(event, "o"), color="0.3", label=f"worker {event}")
    return len(kinds)


#: How many times the largest positive x must exceed the smallest for ``logx`` to take effect.
LOG_SPAN = 30.0


def log_floor(xs: list[float]) -> float | None:
    """The smallest positive x when the positive ``xs`` span more than :data:`LOG_SPAN` (a log
    axis, linear below it), else None (a linear axis)."""
    positive = [x for x in xs if x > 0]
    return min(positive) if positive and max(positive) > LOG_SPAN * min(positive) else None


def _time_of(run: RunData, line: dict[str, Any]) -> float:
    return float(line["time"])


def _lines(groups: Groups, curve_of: Callable[[RunData], list[tuple[float, float]]], path: str | Path, *,
           title: str, xlabel: str, ylabel: str, logy: bool = False, logx: bool = False,
           event_x: Callable[[RunData, dict[str, Any]], float] | None = None) -> Path | None:
    """One mean line with a min-max band per configuration; None when no run has data. With
    ``event_x`` (the x of a metrics line), changes of members are marked (:func:`_mark_events`).
    ``logx``: a logarithmic x axis (linear below the smallest positive x, so zeros stay) when the
    positive xs span more than :data:`LOG_SPAN`."""
    fig, ax = _figure()
    palette = colors(groups)
    drawn, positive, entries = False, True, 0
    all_xs: list[float] = []
    kinds: set[str] = set()
    for label, runs in groups.items():
        curves = [c for c in (curve_of(r) for r in runs) if c]
        if not curves:
            continue
        if event_x is not None:
            kinds |= _mark_events(ax, runs, palette[label], event_x)
        entries += 1
        xs, mean, lo, hi = aggregate(curves)
        suffix = f" (n={len(curves)})" if len(curves) > 1 else ""
        ax.plot(xs, mean, marker="o" if len(xs) <= 30 else None, markersize=3, color=palette[label],
                label=label + suffix)
        if len(curves) > 1:
            ax.fill_between(xs, lo, hi, color=palette[label], alpha=0.2, linewidth=0)
        drawn, positive = True, positive and min(lo) > 0
        all_xs += xs
    if not drawn:
        return None
    if logx and (floor := log_floor(all_xs)) is not None:
        ax.set_xscale("symlog", linthresh=floor)
        xlabel += " (log scale)"
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logy and positive:  # a zero (exact consensus, say) has no place on a log axis
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    _legend(ax, entries + _event_legend(ax, kinds))
    return _save(fig, path)


def plot_accuracy(groups: Groups, x: str, path: str | Path) -> Path | None:
    """Test accuracy (%) against training wall time (``x="time"``, s) or epochs (``x="epoch"``)."""
    def curve(run: RunData) -> list[tuple[float, float]]:
        points = [(float(m["time"]) if x == "time" else run.epoch_of(m), 100.0 * float(m["test_accuracy"]))
                  for m in run.evals()]
        return sorted(points)

    xlabel = "training wall time (s, evaluation excluded)" if x == "time" else "epoch"
    return _lines(groups, curve, path, title=f"Test accuracy vs {'wall time' if x == 'time' else 'epochs'}",
                  xlabel=xlabel, ylabel="test accuracy (%)",
                  event_x=_time_of if x == "time" else lambda run, line: run.epoch_of(line))


def quality_of(run: RunData) -> tuple[str, str] | None:
    """(metric, axis label) a run's evaluations are judged by: test accuracy, else validation
    bits per byte (a language model), else test loss; None without evaluations."""
    for metric, label in (("test_accuracy", "test accuracy (%)"), ("test_bpb", "validation bits per byte"),
                          ("test_loss", "test loss")):
        if run.evals(metric):
            return metric, label
    return None


def plot_quality_vs_bytes(groups: Groups, path: str | Path) -> Path | None:
    """Test accuracy (or a language model's validation bits per byte, or test loss) against the
    bytes worker 0 had sent at each evaluation: what a configuration buys per byte."""
    kinds = {q for runs in groups.values() for r in runs if (q := quality_of(r)) is not None}
    if len(kinds) != 1:  # nothing evaluated, or runs judged by different measures
        return None
    metric, ylabel = kinds.pop()
    scale = 100.0 if metric == "test_accuracy" else 1.0

    def curve(run: RunData) -> list[tuple[float, float]]:
        return sorted((float(m["bytes_sent"]) / 1e6, scale * float(m[metric])) for m in run.evals(metric)
                      if "bytes_sent" in m)

    title = "Test accuracy" if metric == "test_accuracy" else "Validation bits per byte" if metric == "test_bpb" else "Test loss"
    # log x: configurations that send hundreds of times fewer bytes than others (DiLoCo beside
    # DDP) would otherwise all stand against zero
    return _lines(groups, curve, path, title=f"{title} vs bytes sent", xlabel="MB sent by worker 0", ylabel=ylabel,
                  logx=True)


def plot_metric(groups: Groups, key_of: Callable[[RunData], str | None], path: str | Path, *, title: str,
                ylabel: str, logy: bool = False) -> Path | None:
    """A per-step metric (mean over workers) against wall time; None when no run records it."""
    def curve(run: RunData) -> list[tuple[float, float]]:
        key = key_of(run)
        return run.series(key) if key else []

    return _lines(groups, curve, path, title=title, xlabel="training wall time (s)", ylabel=ylabel, logy=logy)


def plot_per_worker_bars(groups: Groups, key: str, path: str | Path, *, title: str, ylabel: str,
                         scale: float = 1.0) -> Path | None:
    """Grouped bars: one group per configuration, one bar per worker (mean over repeats, min-max
    error bars); ``key`` is a per-worker list in summary.json."""
    fig, ax = _figure(max(7.5, 1.2 * len(groups) + 3), 4.5)
    values: dict[str, list[list[float]]] = {}
    for label, runs in groups.items():
        per_run = [[float(v) * scale if v is not None else 0.0 for v in r.summary.get(key) or []] for r in runs]
        per_run = [v for v in per_run if v]
        if per_run:
            values[label] = per_run
    if not values:
        return None
    workers = max(len(v) for runs in values.values() for v in runs)
    width = 0.8 / workers
    cmap = _matplotlib().colormaps["viridis"]
    for w in range(workers):
        xs, heights, err_lo, err_hi = [], [], [], []
        for i, per_run in enumerate(values.values()):
            ys = [run[w] for run in per_run if w < len(run)]
            if not ys:
                continue
            mean = sum(ys) / len(ys)
            xs.append(i - 0.4 + width * (w + 0.5))
            heights.append(mean)
            err_lo.append(max(0.0, mean - min(ys)))  # equal repeats: rounding must not make them negative
            err_hi.append(max(0.0, max(ys) - mean))
        color = cmap(w / max(1, workers - 1) * 0.85)
        ax.bar(xs, heights, width=width, color=color, label=f"worker {w}",
               yerr=[err_lo, err_hi] if any(err_lo) or any(err_hi) else None, capsize=2)
    ax.set_xticks(range(len(values)))
    ax.set_xticklabels(list(values), rotation=20 if len(values) > 3 else 0, ha="right" if len(values) > 3 else "center",
                       fontsize="small")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    ax.margins(y=0.2)
    _legend(ax, workers)
    return _save(fig, path)


def _panels(count: int, height: float = 2.6) -> tuple[Figure, list[Any]]:
    """One axes per configuration, sharing the x axis: a column for a few, a grid of up to four
    columns for more, the figure no larger than MAX_WIDTH x MAX_HEIGHT."""
    cols = 1 if count <= 3 else 2 if count <= 8 else 3 if count <= 15 else 4
    rows = -(-count // cols)
    width = min(MAX_WIDTH, 7.5 if cols == 1 else 4.2 * cols)
    fig = _matplotlib("matplotlib.figure").Figure(figsize=(width, min(MAX_HEIGHT, 1.0 + height * rows)), dpi=DPI,
                                                  layout="constrained")
    grid = fig.subplots(rows, cols, sharex=True, squeeze=False)
    axes = [ax for row in grid for ax in row]
    for ax in axes[count:]:
        ax.set_visible(False)
    return fig, axes[:count]


def plot_ratio_per_worker(groups: Groups, path: str | Path) -> Path | None:
    """The kept ratio each worker chose over time (first repeat of each configuration whose ratio
    changes during the run, e.g. adaptive compression); None when no configuration's does."""
    chosen = []
    for label, runs in groups.items():
        run = runs[0]
        key = run.ratio_key()
        if key is None:
            continue
        per_worker = {r: run.series(key, rank=r) for r in sorted(run.metrics)}
        values = {v for pts in per_worker.values() for _, v in pts}
        if len(values) > 1:
            chosen.append((label, per_worker))
    if not chosen:
        return None
    fig, axes = _panels(len(chosen))
    cmap = _matplotlib().colormaps["viridis"]
    for ax, (label, per_worker) in zip(axes, chosen, strict=True):
        n = len(per_worker)
        for r, points in per_worker.items():
            ax.plot([t for t, _ in points], [v for _, v in points], linewidth=0.8,
                    color=cmap(r / max(1, n - 1) * 0.85), label=f"worker {r}")
        ax.set_yscale("log")
        ax.set_title(label, fontsize="small")
        ax.set_ylabel("kept fraction")
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("training wall time (s)")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncol=min(len(names), 8), fontsize="x-small")
    fig.suptitle("Compression ratio per worker over time")
    return _save(fig, path)


LOSS_QUANTILES_KEY = "loss_quantiles"


def plot_loss_quantiles(groups: Groups, path: str | Path) -> Path | None:
    """How the per-sample losses of worker 0's batches spread over training: median, 25-75 % and
    10-90 % bands and the maximum, per step (first repeat of each configuration); lines hold
    ``loss_quantiles`` = [min, q10, q25, q50, q75, q90, max]."""
    chosen = []
    for label, runs in groups.items():
        lines = [m for m in runs[0].metrics.get(0, [])
                 if isinstance(m.get(LOSS_QUANTILES_KEY), list) and len(m[LOSS_QUANTILES_KEY]) == 7 and "step" in m]
        if lines:
            chosen.append((label, lines))
    if not chosen:
        return None
    fig, axes = _panels(len(chosen))
    for ax, (label, lines) in zip(axes, chosen, strict=True):
        steps = [int(m["step"]) for m in lines]
        q = list(zip(*[m[LOSS_QUANTILES_KEY] for m in lines], strict=True))
        ax.fill_between(steps, q[1], q[5], alpha=0.2, color="C0", linewidth=0, label="10-90 %")
        ax.fill_between(steps, q[2], q[4], alpha=0.35, color="C0", linewidth=0, label="25-75 %")
        ax.plot(steps, q[3], color="C0", linewidth=1.0, label="median")
        ax.plot(steps, q[6], color="C3", linewidth=0.5, alpha=0.6, label="max")
        ax.set_title(label, fontsize="small")
        ax.set_ylabel("per-sample loss")
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncol=4, fontsize="x-small")
    fig.suptitle("Distribution of per-sample losses in worker 0's batches")
    return _save(fig, path)


def loss_curves(run: RunData) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(time, training loss) per step, the mean over workers, and (time, test loss) at rank 0's
    evaluations: what ``loss_vs_time.png`` draws for one run."""
    train = run.series("loss")
    test = sorted((float(m["time"]), float(m["test_loss"])) for m in run.evals("test_loss"))
    return train, test


def plot_loss(groups: Groups, path: str | Path) -> Path | None:
    """Training loss (mean over workers, per step) and test loss (at evaluations) against wall
    time, one colour per configuration (mean over repeats); None when no run records a loss."""
    fig, ax = _figure(8.5, 4.8)
    palette = colors(groups)
    entries = 0
    kinds: set[str] = set()
    for label, runs in groups.items():
        kinds |= _mark_events(ax, runs, palette[label], _time_of)
        pairs = [loss_curves(r) for r in runs]
        for index, style, kind in ((0, "-", "train"), (1, "--", "test")):
            curves = [p[index] for p in pairs if p[index]]
            if not curves:
                continue
            xs, mean, _, _ = aggregate(curves)
            ax.plot(xs, mean, style, color=palette[label], linewidth=1.0 if kind == "train" else 1.6,
                    label=f"{label} ({kind})")
            entries += 1
    if not entries:
        return None
    ax.set_title("Training loss (solid) and test loss (dashed) vs wall time")
    ax.set_xlabel("training wall time (s, evaluation excluded)")
    ax.set_ylabel("loss")
    ax.grid(True, alpha=0.3)
    _legend(ax, entries + _event_legend(ax, kinds))
    return _save(fig, path)


def make_plots(groups: Groups, out_dir: str | Path) -> list[Path]:
    """Every plot that the runs have data for, written into ``out_dir``; returns the files."""
    _matplotlib("matplotlib.figure")  # missing: say so before any plot is drawn
    out = Path(out_dir)
    written = [
        plot_accuracy(groups, "time", out / "accuracy_vs_time.png"),
        plot_accuracy(groups, "epoch", out / "accuracy_vs_epoch.png"),
        plot_loss(groups, out / "loss_vs_time.png"),
        plot_quality_vs_bytes(groups, out / "quality_vs_bytes.png"),
        plot_per_worker_bars(groups, "bytes_sent_per_worker", out / "bytes_sent_per_worker.png", scale=1e-6,
                             title="Bytes sent per worker (whole run)", ylabel="sent (MB)"),
        plot_per_worker_bars(groups, "samples_per_s_per_worker", out / "throughput_per_worker.png",
                             title="Training throughput per worker", ylabel="samples/s"),
        plot_metric(groups, RunData.ratio_key, out / "compression_ratio.png",
                    title="Compression ratio over time (kept fraction)", ylabel="kept fraction", logy=True),
        plot_ratio_per_worker(groups, out / "compression_ratio_per_worker.png"),
        plot_loss_quantiles(groups, out / "loss_distribution.png"),
        plot_metric(groups, lambda r: CONSENSUS_KEY if r.has_metric(CONSENSUS_KEY) else None,
                    out / "consensus_distance.png", title="Consensus distance over time",
                    ylabel="consensus distance (mean over workers)", logy=True),
    ]
    return [p for p in written if p is not None]
