"""distrain.report on synthesized run directories: loading, grouping, aggregation, plots, table."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from distrain.errors import ConfigError, DataError
from distrain.report import report, rows_of
from distrain.report.plots import LOG_SPAN, aggregate, log_floor, make_plots
from distrain.report.runs import expand_paths, group_by_label, load_runs


def make_run(path: Path, *, algorithm: str = "allreduce", compress: str = "none", network: str = "none",
             workers: int = 2, steps: int = 20, evals: int = 4, speed: float = 1.0, acc_end: float = 0.9,
             extra: dict | None = None, target: float = 0.8) -> dict:
    """A finished run directory with the files the loop writes; returns its summary."""
    (path / "metrics").mkdir(parents=True)
    config = {"algo": {"algorithm": algorithm}, "compress": {"compress": compress},
              "network": {"network": network}, "run": {"target_accuracy": target}}
    every = steps // evals
    time_to_target = None
    for rank in range(workers):
        lines = []
        for step in range(1, steps + 1):
            t = step * 0.1 / speed
            line = {"step": step, "epoch": step / every, "time": t, "loss": 2.0 / step, "lr": 0.1,
                    "bytes_sent": 1000 * step, "bytes_received": 1000 * step, "compute_s": 0.01, "exposed_comm_s": 0.05}
            line.update({k: f(step, rank) for k, f in (extra or {}).items()})
            if rank == 0 and step % every == 0:
                acc = acc_end * step / steps
                line.update(test_accuracy=acc, test_loss=1 - acc)
                if time_to_target is None and acc >= target:
                    time_to_target = t
            lines.append(json.dumps(line))
        (path / "metrics" / f"rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    wall = steps * 0.1 / speed
    summary = {
        "algorithm": algorithm, "workers": workers, "epochs": evals, "steps": steps, "final_test_accuracy": acc_end,
        "target_accuracy": target, "time_to_target_s": time_to_target, "wall_time_s": wall,
        "samples_per_s": 16 * workers * steps / wall, "samples_per_s_per_worker": [16 * steps / wall / (1 + r) for r in range(workers)],
        "bytes_sent_per_worker": [1000 * steps * (r + 1) for r in range(workers)],
        "bytes_received_per_worker": [1000 * steps] * workers, "run_dir": str(path),
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "summary.json").write_text(json.dumps(summary))
    return summary


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    """Two configurations, two repeats each; the second has compression ratio and consensus metrics."""
    make_run(tmp_path / "ar" / "r0", speed=1.0, acc_end=0.90)
    make_run(tmp_path / "ar" / "r1", speed=1.25, acc_end=0.86)
    extra = {"compress_ratio": lambda s, r: 0.01, "consensus_distance": lambda s, r: 1.0 / s + r}
    make_run(tmp_path / "dp" / "r0", algorithm="dpsgd", compress="group_topk:0.01", speed=2.0, acc_end=0.84, extra=extra)
    make_run(tmp_path / "dp" / "r1", algorithm="dpsgd", compress="group_topk:0.01", speed=4.0, acc_end=0.80, extra=extra)
    return tmp_path


def test_runs_grouped_by_configuration_label(runs_dir: Path) -> None:
    runs = load_runs([runs_dir])
    groups = group_by_label(runs)
    assert list(groups) == ["allreduce", "dpsgd+group_topk:0.01"]
    assert [len(g) for g in groups.values()] == [2, 2]
    assert [m["step"] for m in groups["allreduce"][0].evals()] == [5, 10, 15, 20]


def test_aggregate_is_mean_min_max_point_by_point() -> None:
    xs, mean, lo, hi = aggregate([[(1.0, 10.0), (2.0, 20.0), (3.0, 30.0)], [(3.0, 14.0), (4.0, 16.0)]])
    assert xs == [2.0, 3.0] and mean == [12.0, 18.0] and lo == [10.0, 16.0] and hi == [14.0, 20.0]


def test_bytes_axis_turns_logarithmic_only_over_a_wide_span() -> None:
    # DiLoCo's 0.1 MB beside DDP's 500 MB: log, linear below the smallest positive value (a
    # configuration that has sent nothing yet keeps its point at 0)
    assert log_floor([0.0, 0.1, 3.0, 500.0]) == 0.1
    assert log_floor([1.0, LOG_SPAN]) is None  # within the span: linear
    assert log_floor([1.0, LOG_SPAN * 1.01]) == 1.0
    assert log_floor([0.0, 0.0]) is None and log_floor([]) is None


def test_rows_average_repeats_and_measure_speedups(runs_dir: Path) -> None:
    rows = rows_of(group_by_label(load_runs([runs_dir])))
    ar, dp = rows
    summaries = {p: json.loads((runs_dir / p / "summary.json").read_text()) for p in ("ar/r0", "ar/r1", "dp/r0", "dp/r1")}
    acc = [summaries["ar/r0"]["final_test_accuracy"], summaries["ar/r1"]["final_test_accuracy"]]
    assert ar["final_test_accuracy"] == pytest.approx({"mean": sum(acc) / 2, "min": min(acc), "max": max(acc)})
    sps = {k: s["samples_per_s"] for k, s in summaries.items()}
    assert dp["speedup_samples_per_s"] == pytest.approx((sps["dp/r0"] + sps["dp/r1"]) / (sps["ar/r0"] + sps["ar/r1"]))
    tta = {k: s["time_to_target_s"] for k, s in summaries.items()}
    assert ar["target_reached"] == 2 and dp["target_reached"] == 2
    assert dp["speedup_time_to_target"] == pytest.approx((tta["ar/r0"] + tta["ar/r1"]) / (tta["dp/r0"] + tta["dp/r1"]))
    assert ar["speedup_time_to_target"] == pytest.approx(1.0)
    assert ar["bytes_sent_per_worker"]["mean"] == pytest.approx((20_000 + 40_000) / 2)


def test_speedup_to_target_undefined_when_a_repeat_misses_it(tmp_path: Path) -> None:
    make_run(tmp_path / "a" / "r0")
    make_run(tmp_path / "b" / "r0", algorithm="dpsgd")
    make_run(tmp_path / "b" / "r1", algorithm="dpsgd", acc_end=0.5)  # never reaches 0.8
    _, b = rows_of(group_by_label(load_runs([tmp_path])))
    assert b["target_reached"] == 1 and b["speedup_time_to_target"] is None
    assert b["speedup_samples_per_s"] == pytest.approx(1.0)


def test_make_plots_writes_every_plot_the_metrics_support(runs_dir: Path, tmp_path: Path) -> None:
    files = make_plots(group_by_label(load_runs([runs_dir])), tmp_path / "out")
    names = sorted(p.name for p in files)
    assert names == ["accuracy_vs_epoch.png", "accuracy_vs_time.png", "bytes_sent_per_worker.png",
                     "compression_ratio.png", "consensus_distance.png", "loss_vs_time.png", "quality_vs_bytes.png",
                     "throughput_per_worker.png"]
    for path in files:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_optional_plots_left_out_without_their_metrics(tmp_path: Path) -> None:
    make_run(tmp_path / "runs" / "a")
    files, table = report([tmp_path / "runs" / "a"])
    assert sorted(p.name for p in files) == ["accuracy_vs_epoch.png", "accuracy_vs_time.png",
                                             "bytes_sent_per_worker.png", "loss_vs_time.png", "quality_vs_bytes.png",
                                             "throughput_per_worker.png"]
    assert all(p.parent == tmp_path / "runs" / "a" / "report" for p in files)  # a single run's report stays in it
    assert "allreduce (baseline)" in table and "90.0" in table


def test_report_reads_labels_from_a_comparison(tmp_path: Path) -> None:
    make_run(tmp_path / "cmp" / "x" / "r0")
    make_run(tmp_path / "cmp" / "y" / "r0", algorithm="ddp")
    comparison = {"configs": [
        {"label": "allreduce @edge", "runs": [{"run_dir": "x/r0", "status": "ok"}]},
        {"label": "ddp @edge", "runs": [{"run_dir": "y/r0", "status": "ok"}, {"run_dir": "y/r1", "status": "failed"}]},
    ]}
    (tmp_path / "cmp" / "comparison.json").write_text(json.dumps(comparison))
    assert [label for _, label in expand_paths([tmp_path / "cmp"])] == ["allreduce @edge", "ddp @edge"]
    files, table = report([tmp_path / "cmp"], baseline="ddp @edge")
    assert files[0].parent == tmp_path / "cmp"
    assert "ddp @edge (baseline)" in table


def test_bad_inputs_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        load_runs([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no run directories"):
        load_runs([tmp_path / "empty"])
    make_run(tmp_path / "a")
    with pytest.raises(ConfigError, match="--baseline"):
        report([tmp_path / "a"], baseline="nope")


def test_csv_has_one_line_per_configuration(runs_dir: Path, tmp_path: Path) -> None:
    from distrain.report import write_csv

    rows = rows_of(group_by_label(load_runs([runs_dir])))
    path = write_csv(rows, tmp_path / "c.csv")
    with open(path) as f:
        lines = list(csv.DictReader(f))
    assert [line["label"] for line in lines] == ["allreduce", "dpsgd+group_topk:0.01"]
    assert float(lines[0]["final_test_accuracy_mean"]) == pytest.approx(0.88)
    assert float(lines[0]["bytes_sent_per_worker_mean"]) == pytest.approx(30_000)


def test_snapshot_lines_of_asynchronous_runs(tmp_path: Path) -> None:
    """AD-PSGD / Prague append consensus snapshots (no step) after the step lines; the report
    puts them in time order and counts epochs over all workers' steps."""
    run_dir = tmp_path / "a"
    make_run(run_dir, algorithm="adpsgd")
    config = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**config, "steps_per_epoch": 5, "world_size": 2}))
    path = run_dir / "metrics" / "rank0.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    for line in lines:
        line["global_steps"] = 2 * line["step"]
    lines.append({"time": 0.25, "epoch": 0.5, "global_steps": 5, "consensus_distance": 3.0, "test_accuracy": 0.3, "snapshot": True})
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    (run,) = load_runs([run_dir])
    evals = run.evals()
    assert [m["time"] for m in evals] == [0.25, 0.5, 1.0, 1.5, 2.0]
    assert [run.epoch_of(m) for m in evals] == [0.5, 1.0, 2.0, 3.0, 4.0]
    assert run.series("consensus_distance") == [(0.25, 3.0)]
    files = make_plots(group_by_label([run]), tmp_path / "out")
    assert "consensus_distance.png" in [p.name for p in files]


@pytest.mark.parametrize("n", [1, 2, 7, 64])
def test_loss_quantiles_match_torch_quantile(n: int) -> None:
    import torch

    from distrain.train.loop import LOSS_QUANTILES, loss_quantiles

    losses = torch.rand(n, generator=torch.Generator().manual_seed(n)) * 5
    expected = torch.quantile(losses, torch.tensor(LOSS_QUANTILES)).tolist()
    assert loss_quantiles(losses) == pytest.approx(expected, rel=1e-3)


def test_language_model_runs_show_bits_per_byte_against_time_and_bytes(tmp_path: Path) -> None:
    from distrain.report.plots import quality_of
    from distrain.report.runs import load_run

    for name, end in (("a", 2.9), ("b", 3.1)):
        run_dir = tmp_path / "runs" / name
        summary = make_run(run_dir, compress="none" if name == "a" else "int8")
        path = run_dir / "metrics" / "rank0.jsonl"
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        for m in lines:  # a language model's evaluations: bits per byte, no accuracy
            if m.pop("test_accuracy", None) is not None:
                m["test_bpb"] = 4.0 - m["step"] / 10
        path.write_text("\n".join(json.dumps(m) for m in lines) + "\n")
        summary.update(final_test_accuracy=None, final_val_bpb=end, target_loss=2.0)
        (run_dir / "summary.json").write_text(json.dumps(summary))
    assert quality_of(load_run(tmp_path / "runs" / "a", label="a")) == ("test_bpb", "validation bits per byte")
    files, table = report([tmp_path / "runs"])
    assert "quality_vs_bytes.png" in [p.name for p in files]
    header = table.splitlines()[0]
    assert "val bpb" in header and "final acc" not in header and "time to loss 2" in header
    assert "2.900" in table and "3.100" in table
