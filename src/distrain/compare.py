"""``distrain compare``: run a grid of configurations on the same model, data and seed, and compare.

The grid is networks x (algorithms x compressors, then named configurations, then baselines):
a named configuration (``Grid.configs``, a scenario's ``[[configs]]`` tables) is one algorithm
or baseline with its own settings over the shared ones, e.g. DiLoCo at H = 16 and at H = 64 in
one comparison. Every configuration runs
``repeats`` times, one run after another, each in its own directory ``OUT/<config>/r<k>``
(repeat k uses seed + k, the same for every configuration). Then it writes
``OUT/comparison.json`` (every run's numbers, copied from its summary.json, with its
``run_dir`` relative to OUT, and the mean, min and max per configuration),
``OUT/comparison.csv`` and the plots of :mod:`distrain.report`.

A combination that cannot run (e.g. a compressor an algorithm does not support) is skipped with
the reason; a run that fails is recorded as failed; neither stops the grid.

Example::

    from distrain.compare import Grid, run_comparison
    from distrain.config import TrainConfig
    grid = Grid(algorithms=["allreduce", "dpsgd"], compress=["none", "group_topk:0.01"],
                networks=["edge"], baselines=["ddp"], repeats=2, out="runs/cmp")
    comparison = run_comparison(grid, TrainConfig.from_dict({"workers": 4, "epochs": 5}))
    print(comparison["table"])
"""

from __future__ import annotations

import copy
import datetime
import logging
import os
import platform
import re
import shutil
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distrain.config import TrainConfig, read_config_file
from distrain.errors import ConfigError, DistrainError, Interrupted
from distrain.report import add_speedups, config_row, format_table, run_record, write_csv
from distrain.report.plots import make_plots
from distrain.report.runs import group_by_label, load_run
from distrain.train.metrics import write_json_atomic

log = logging.getLogger(__name__)

#: Keys of a scenario file besides its [train] table of shared settings.
SCENARIO_KEYS = ("name", "description", "algorithms", "compress", "networks", "baselines", "configs", "repeats",
                 "baseline", "train")
#: Keys of a named configuration besides the settings it overrides.
CONFIG_KEYS = ("label", "algorithm", "baseline", "compress")


@dataclass
class Grid:
    """What to compare; lists are run in order, the first configuration is the default baseline.

    Args:
        algorithms: distrain algorithm names (``allreduce``, ``dpsgd``, ...).
        compress: compressor specs tried with every algorithm (``none``, ``group_topk:0.01``, ...).
        networks: emulated network presets (``none`` = the real network).
        baselines: PyTorch and torchft baselines (``ddp``, ``ddp-fp16``, ``ddp-powersgd:2``,
            ``localsgd:4``, ``torchft-diloco``, ``torchft-localsgd:16``), run once per network.
        configs: named configurations, each a dict with ``label``, either ``algorithm`` (with an
            optional ``compress``) or ``baseline`` (a spec as in ``baselines``), and any settings
            (TrainConfig field names) that differ from the shared ones, e.g.
            ``{"label": "diloco H=16", "algorithm": "diloco", "sync_every": 16}``; run on every
            network after the algorithms x compressors.
        repeats: runs per configuration (repeat k uses seed + k).
        out: output directory.
        baseline: label of the configuration speed-ups are measured against (default: the first).
        skip_unknown: skip algorithm names this build does not have (scenario files) instead of
            refusing them.
        keep_checkpoints: keep each run's final checkpoint (removed by default: comparisons do not
            resume, and checkpoints dwarf the results).
    """

    algorithms: list[str] = field(default_factory=lambda: ["allreduce"])
    compress: list[str] = field(default_factory=lambda: ["none"])
    networks: list[str] = field(default_factory=lambda: ["none"])
    baselines: list[str] = field(default_factory=list)
    configs: list[dict[str, Any]] = field(default_factory=list)
    repeats: int = 1
    out: str | Path = "runs/compare"
    baseline: str | None = None
    skip_unknown: bool = False
    keep_checkpoints: bool = False
    scenario: dict[str, str] | None = None  # name and description, when it came from a scenario file


@dataclass
class Cell:
    """One configuration of the grid."""

    label: str
    kind: str  # "algorithm" or "baseline"
    algorithm: str  # the algorithm name, or the baseline spec
    compress: str
    network: str
    cfg: TrainConfig
    reason: str | None = None  # why it is skipped

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9._+-]+", "_", self.label.replace(" @", "@")).strip("_")


def split_list(text: str | list[str] | None, flag: str) -> list[str]:
    """``"a, b"`` or ``["a", "b"]`` -> ``["a", "b"]``; ConfigError naming ``flag`` when empty or repeated."""
    if text is None:
        return []
    items = [s.strip() for s in (text.split(",") if isinstance(text, str) else text)]
    items = [s for s in items if s]
    dupes = sorted({s for s in items if items.count(s) > 1})
    if dupes:
        raise ConfigError(flag, f"lists {', '.join(dupes)} more than once")
    return items


def check_grid(grid: Grid) -> None:
    """Refuse a grid that is wrong as a whole (unknown names, no configuration), before any run."""
    from distrain.algorithms import ALGORITHMS
    from distrain.baselines import build_peer
    from distrain.compress import validate_spec
    from distrain.emulation import PRESETS

    if not isinstance(grid.repeats, int) or grid.repeats < 1:
        raise ConfigError("--repeats", f"must be an integer >= 1, got {grid.repeats!r}")
    if not grid.algorithms and not grid.baselines and not grid.configs:
        raise ConfigError("--algorithms", "the grid is empty: give --algorithms and/or --baselines")
    if not grid.algorithms and grid.compress != ["none"]:
        raise ConfigError("--compress", "needs --algorithms: the baselines bring their own compression")
    if not grid.compress:
        raise ConfigError("--compress", "must list at least one compressor spec ('none' for dense)")
    if not grid.networks:
        raise ConfigError("--network", "must list at least one network preset ('none' for the real network)")
    unknown = [a for a in grid.algorithms if a not in ALGORITHMS]
    if unknown and not grid.skip_unknown:
        raise ConfigError("--algorithms", f"unknown algorithm {unknown[0]!r}; choose one of: {', '.join(sorted(ALGORITHMS))}")
    for spec in grid.compress:
        try:
            validate_spec(spec)
        except ConfigError as exc:
            raise ConfigError("--compress", str(exc).split(": ", 1)[-1]) from None
    for net in grid.networks:
        if net not in PRESETS:
            raise ConfigError("--network", f"unknown preset {net!r}; choose one of: {', '.join(PRESETS)}")
    for spec in grid.baselines:
        build_peer(spec)
    for config in grid.configs:
        check_named(config, ALGORITHMS, build_peer)
    labels = [c["label"] for c in grid.configs]
    dupes = sorted({str(x) for x in labels if labels.count(x) > 1})
    if dupes:
        raise ConfigError("configs", f"label {dupes[0]!r} names more than one configuration")


def check_named(config: Any, algorithms: dict[str, Any], build_peer: Callable[[str], Any]) -> None:
    """Refuse a named configuration without a label, with no or two kinds, or an unknown name."""
    if not isinstance(config, dict):
        raise ConfigError("configs", f"each configuration must be a table of settings, got {config!r}")
    label = config.get("label")
    if not isinstance(label, str) or not label.strip():
        raise ConfigError("configs", f"every configuration needs a label (a non-empty string), got {label!r}")
    if "network" in config:
        raise ConfigError("configs", f"configuration {label!r}: the scenario's networks apply to every configuration "
                                     "(no 'network' of its own)")
    if ("algorithm" in config) == ("baseline" in config):
        raise ConfigError("configs", f"configuration {label!r} must name exactly one of 'algorithm' and 'baseline'")
    if "baseline" in config:
        if "compress" in config:
            raise ConfigError("configs", f"configuration {label!r}: a baseline brings its own compression (no 'compress')")
        build_peer(config["baseline"])
    elif config["algorithm"] not in algorithms:
        raise ConfigError("configs", f"configuration {label!r}: unknown algorithm {config['algorithm']!r}; "
                                     f"choose one of: {', '.join(sorted(algorithms))}")


def make_cell(label: str, kind: str, name: str, comp: str, net: str, cfg: TrainConfig,
              own: Collection[str] = ()) -> Cell:
    """A configuration of the grid: ``cfg`` set to run algorithm (or baseline) ``name`` with
    compressor ``comp`` on network ``net``, and why it cannot run, if it cannot. An algorithm
    takes the shared settings it uses only; those of a named configuration (``own``) must all
    take effect."""
    from distrain.algorithms import ALGORITHMS
    from distrain.assemble import check_in_effect, drop_out_of_effect
    from distrain.baselines import check_baseline

    cfg.algo.algorithm, cfg.compress.compress, cfg.network.network = name if kind == "algorithm" else "allreduce", comp, net
    cell = Cell(label, kind, name, comp, net, cfg)
    if kind == "baseline":
        cell.reason = _invalid(cfg.validate) or _invalid(lambda: check_baseline(name, cfg))
    elif name not in ALGORITHMS:
        cell.reason = f"algorithm {name!r} is not in this build (available: {', '.join(sorted(ALGORITHMS))})"
    elif comp != "none" and not getattr(ALGORITHMS[name], "compresses", False):
        cell.reason = f"{name} does not compress its traffic (--compress {comp} would be ignored)"
    else:
        drop_out_of_effect(cfg, keep=own)
        cell.reason = _invalid(cfg.validate) or _invalid(lambda: check_in_effect(cfg))
    return cell


def named_cell(config: dict[str, Any], base: TrainConfig, net: str, where: str) -> Cell:
    """The cell of one named configuration on network ``net`` (its settings over ``base``)."""
    label = config["label"]
    cfg = copy.deepcopy(base)
    try:
        for key, value in config.items():
            if key not in CONFIG_KEYS:
                cfg.set(key, value)
    except ConfigError as exc:  # an unknown or mistyped setting is the file's mistake: refuse the grid
        raise ConfigError("configs", f"configuration {label!r}: {exc}") from None
    kind = "baseline" if "baseline" in config else "algorithm"
    return make_cell(label + where, kind, config.get("baseline") or config["algorithm"],
                     config.get("compress", "none"), net, cfg, own=[key for key in config if key not in CONFIG_KEYS])


def build_cells(grid: Grid, base: TrainConfig) -> list[Cell]:
    """The grid's configurations in run order, each with its own config (validated, or a reason)."""
    check_grid(grid)
    shared = copy.deepcopy(base)  # the shared settings must be valid on their own (exit 2 naming the flag)
    shared.algo.algorithm, shared.compress.compress, shared.network.network = "allreduce", "none", "none"
    shared.validate()
    many_networks = len(grid.networks) > 1
    cells: list[Cell] = []
    for net in grid.networks:
        where = f" @{net}" if many_networks else ""
        for algo in grid.algorithms:
            for comp in grid.compress:
                label = algo + (f"+{comp}" if comp != "none" else "") + where
                cells.append(make_cell(label, "algorithm", algo, comp, net, copy.deepcopy(base)))
        cells += [named_cell(config, base, net, where) for config in grid.configs]
        cells += [make_cell(spec + where, "baseline", spec, "none", net, copy.deepcopy(base)) for spec in grid.baselines]
    labels = [c.label for c in cells]
    if grid.baseline is not None and grid.baseline not in labels:
        raise ConfigError("--baseline", f"names no configuration of the grid; choose one of: {', '.join(labels)}")
    return cells


def _invalid(check: Callable[[], Any]) -> str | None:
    """The one-line reason ``check()`` refuses a configuration, or None."""
    try:
        check()
    except ConfigError as exc:
        return str(exc)
    return None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}".rstrip(": ")


def run_cell(cell: Cell, run_dir: Path, seed: int) -> dict[str, Any]:
    """Run one repeat of a configuration; its record (numbers from summary.json, or the failure)."""
    from distrain.baselines import run_baseline
    from distrain.launch import launch_local

    cfg = copy.deepcopy(cell.cfg)
    cfg.run.run_dir, cfg.run.seed = str(run_dir), seed
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a stale summary.json must not pass for this run's
    start = time.perf_counter()
    try:
        summary = run_baseline(cell.algorithm, cfg) if cell.kind == "baseline" else launch_local(cfg)
        record = run_record(summary, run_dir)
    except (KeyboardInterrupt, Interrupted):  # Ctrl-C or SIGTERM stops the grid, not only this run
        raise
    except SystemExit as exc:  # the launcher's "bad input" exit from inside a worker
        record = {"run_dir": str(run_dir), "status": "failed", "error": f"workers stopped with status {exc.code}"}
    except (DistrainError, Exception) as exc:  # noqa: BLE001 - recorded in the table, the grid goes on
        record = {"run_dir": str(run_dir), "status": "failed", "error": _one_line(exc)}
    record["elapsed_s"] = time.perf_counter() - start
    record["seed"] = seed
    return record


def run_comparison(grid: Grid, base: TrainConfig, *, echo: Callable[[str], None] = log.info,
                   command: str | None = None) -> dict[str, Any]:
    """Run the grid; write comparison.json, comparison.csv and the plots into ``grid.out``.

    comparison.json and comparison.csv are rewritten after every configuration, so an
    interrupted grid keeps what it finished. Returns the comparison (what comparison.json
    holds, plus ``table``, the text table, and ``files``, the files written).
    """
    out = Path(grid.out)
    cells = build_cells(grid, base)
    out.mkdir(parents=True, exist_ok=True)
    total = sum(1 for c in cells if c.reason is None) * grid.repeats
    for cell in cells:
        if cell.reason is not None:
            echo(f"skipping {cell.label}: {cell.reason}")
    baseline = grid.baseline or next((c.label for c in cells if c.reason is None), cells[0].label)
    comparison: dict[str, Any] = {
        "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command, "scenario": grid.scenario, "machine": machine_info(), "baseline": baseline,
        "grid": {"algorithms": grid.algorithms, "compress": grid.compress, "networks": grid.networks,
                 "baselines": grid.baselines, "configs": grid.configs, "repeats": grid.repeats},
        "settings": base.to_dict(), "configs": [], "plots": [],
    }
    rows: list[dict[str, Any]] = comparison["configs"]
    done = 0
    for cell in cells:
        settings = {"kind": cell.kind, "algorithm": cell.algorithm, "compress": cell.compress, "network": cell.network}
        if cell.reason is not None:
            rows.append(config_row(cell.label, [], status="skipped", reason=cell.reason, **settings))
            continue
        records = []
        for k in range(grid.repeats):
            done += 1
            run_dir = out / cell.slug / f"r{k}"
            echo(f"[{done}/{total}] {cell.label}" + (f" (repeat {k + 1}/{grid.repeats})" if grid.repeats > 1 else ""))
            record = run_cell(cell, run_dir, base.run.seed + k)
            record["run_dir"] = str(run_dir.relative_to(out))  # comparison.json stays valid when moved
            if not grid.keep_checkpoints:
                shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
            echo("    " + _describe(record))
            records.append(record)
        row = config_row(cell.label, records, **settings)
        failures = [r["error"] for r in records if r["status"] != "ok"]
        if failures:
            row["reason"] = f"{len(failures)} of {len(records)} runs failed: {failures[0]}"
        rows.append(row)
        _save(comparison, out)

    plots: list[Path] = []
    try:
        plots = comparison_plots(rows, out)
    except Exception as exc:  # noqa: BLE001 - the numbers are worth keeping without the pictures
        log.warning("plotting failed: %s", _one_line(exc))
        echo(f"plots failed ({_one_line(exc)}); the numbers are in comparison.json")
    comparison["plots"] = [p.name for p in plots]
    _save(comparison, out)
    comparison["table"] = format_table(rows, baseline=baseline, target=base.run.target_accuracy,
                                       target_loss=base.run.target_loss)
    comparison["files"] = [out / "comparison.json", out / "comparison.csv", *plots]
    return comparison


def _save(comparison: dict[str, Any], out: Path) -> None:
    add_speedups(comparison["configs"], comparison["baseline"])
    write_json_atomic(out / "comparison.json", comparison)
    write_csv(comparison["configs"], out / "comparison.csv")


def _describe(record: dict[str, Any]) -> str:
    if record["status"] != "ok":
        return f"failed after {record['elapsed_s']:.0f} s: {record['error']}"
    tta = record.get("time_to_target_s")
    accuracy = record.get("final_test_accuracy")
    bpb = record.get("final_val_bpb")
    quality = (f"accuracy {accuracy:.4f}" if accuracy is not None else f"val {bpb:.3f} bpb" if bpb is not None
               else f"test loss {record.get('final_test_loss', float('nan')):.4g}")
    return (f"{quality}, wall {record['wall_time_s']:.1f} s, "
            f"{record['samples_per_s']:.0f} samples/s, {record['bytes_sent_per_worker_mean'] / 1e6:.2f} MB sent/worker, "
            f"target {'not reached' if tta is None else f'at {tta:.1f} s'} ({record['elapsed_s']:.0f} s in all)")


def comparison_plots(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """The plots of :mod:`distrain.report` over the runs of ``rows`` (a comparison's rows, run
    directories relative to ``out``), written into ``out``."""
    runs = [load_run(out / r["run_dir"], row["label"]) for row in rows for r in row["runs"] if r["status"] == "ok"]
    return make_plots(group_by_label(runs), out) if runs else []


def cpu_model() -> str:
    """The processor's model name (on Linux from ``/proc/cpuinfo``), else what ``platform`` says.

    Results name it because a run's numbers follow it: the same commit, seed and settings gave
    final losses 1% apart on two machines (the matmul kernels torch picks round differently, and
    256 steps of training carry the difference on)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.cuda.is_available()}


def load_scenario(path: str | Path) -> tuple[Grid, dict[str, Any], str]:
    """A scenario file (TOML/JSON/YAML): the grid, the shared [train] settings, and its name.

    Example (``benchmarks/scenarios/edge.toml``)::

        name = "edge"
        algorithms = ["allreduce", "dpsgd"]
        compress = ["none", "group_topk:0.01"]
        networks = ["edge"]
        baselines = ["ddp", "ddp-powersgd:2"]
        repeats = 1
        [train]
        workers = 4
        epochs = 5
        [[configs]]              # named configurations: their own settings over [train]
        label = "diloco H=16"
        algorithm = "diloco"
        sync_every = 16
    """
    data = read_config_file(path, flag="--scenario")
    unknown = sorted(set(data) - set(SCENARIO_KEYS))
    if unknown:
        raise ConfigError("--scenario", f"{path}: unknown key {unknown[0]!r}; allowed: {', '.join(SCENARIO_KEYS)}")
    grid = Grid(skip_unknown=True)  # a scenario may name algorithms that land later
    for key, flag in (("algorithms", "--algorithms"), ("compress", "--compress"), ("networks", "--network"),
                      ("baselines", "--baselines")):
        if key in data:
            setattr(grid, key, split_list(data[key], flag))
    configs = data.get("configs", [])
    if not isinstance(configs, list):
        raise ConfigError("--scenario", f"{path}: configs must be an array of tables ([[configs]])")
    grid.configs = configs
    grid.repeats = data.get("repeats", grid.repeats)
    grid.baseline = data.get("baseline")
    name = str(data.get("name") or Path(path).stem)
    grid.scenario = {"name": name, "description": str(data.get("description", "")), "file": str(path)}
    train = data.get("train", {})
    if not isinstance(train, dict):
        raise ConfigError("--scenario", f"{path}: [train] must be a table of settings")
    return grid, train, name


def default_out(name: str = "compare") -> Path:
    return Path("runs") / f"{name}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def command_line() -> str:
    return " ".join(["distrain", *sys.argv[1:]]) if sys.argv and sys.argv[0].endswith("distrain") else " ".join(sys.argv)
