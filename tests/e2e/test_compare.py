"""``distrain compare`` as a user runs it: a real two-configuration grid, its table and files."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.e2e.test_cli import QUICK, TIMEOUT, distrain

GRID = ["--workers", "2", *QUICK, "--eval-every", "0.5", "--lr", "0.05", "--warmup-epochs", "0", "--lr-decay", "none",
        "--target-accuracy", "0.3"]


@pytest.mark.timeout(TIMEOUT + 10)
@pytest.mark.slow  # CI: distrain compare runs in test_compare_torchft.py and test_compare_baselines.py
def test_compare_two_configurations(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    res = distrain("compare", "--algorithms", "allreduce", "--baselines", "ddp", "--out", str(out), *GRID)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "allreduce (baseline)" in res.stdout and "\nddp " in res.stdout and "speed-up" in res.stdout

    comparison = json.loads((out / "comparison.json").read_text())
    assert [c["label"] for c in comparison["configs"]] == ["allreduce", "ddp"]
    assert comparison["machine"]["torch"] and comparison["machine"]["cpu"] and comparison["grid"]["baselines"] == ["ddp"]
    runs = {}
    for config in comparison["configs"]:
        assert config["status"] == "ok" and config["repeats_ok"] == 1
        run = config["runs"][0]
        summary = json.loads((out / run["run_dir"] / "summary.json").read_text())
        for key in ("final_test_accuracy", "time_to_target_s", "wall_time_s", "samples_per_s", "bytes_sent_per_worker"):
            assert run[key] == summary[key], key
        assert config["final_test_accuracy"]["mean"] == summary["final_test_accuracy"]
        assert config["bytes_sent_per_worker"]["mean"] == sum(summary["bytes_sent_per_worker"]) / 2
        assert not (out / run["run_dir"] / "checkpoints").exists()
        runs[config["label"]] = run
    ddp = comparison["configs"][1]
    assert ddp["speedup_samples_per_s"] == pytest.approx(runs["ddp"]["samples_per_s"] / runs["allreduce"]["samples_per_s"])

    with open(out / "comparison.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["label"] for r in rows] == ["allreduce", "ddp"]
    assert float(rows[1]["samples_per_s_mean"]) == pytest.approx(runs["ddp"]["samples_per_s"])
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["accuracy_vs_epoch.png", "accuracy_vs_time.png", "bytes_sent_per_worker.png",
                    "loss_distribution.png", "loss_vs_time.png", "quality_vs_bytes.png", "throughput_per_worker.png"]  # every run logs its loss quantiles
    assert all((out / p).stat().st_size > 10_000 for p in pngs)

    # Same data, seed, schedule and averaging: DDP must follow distrain's all-reduce step by step.
    def losses(label: str) -> list[float]:
        lines = (out / runs[label]["run_dir"] / "metrics" / "rank1.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in lines]

    assert losses("ddp") == pytest.approx(losses("allreduce"), rel=1e-4, abs=1e-5)
    assert runs["ddp"]["bytes_sent_per_worker"] == runs["allreduce"]["bytes_sent_per_worker"]


# More bad grids are refused in tests/unit/test_report_compare.py; these check the command line's plumbing.
@pytest.mark.parametrize("args,flag", [
    (["--algorithms", "allreduce,nope"], "--algorithms"),
    (["--compress", "none,topk:7"], "--compress"),
    (["--baseline", "dpsgd"], "--baseline"),
    (["--lr", "-1"], "--lr"),
])
def test_bad_grids_exit_2_with_one_line_naming_the_flag(tmp_path: Path, args: list[str], flag: str) -> None:
    res = distrain("compare", "--out", str(tmp_path / "c"), *GRID, *args, timeout=120)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], lines
    assert not (tmp_path / "c" / "comparison.json").exists()


@pytest.mark.parametrize("args,flag", [([], "--out"), (["--resume", "auto"], "--resume")])
def test_an_earlier_comparison_is_not_run_over(tmp_path: Path, args: list[str], flag: str) -> None:
    """An --out holding a comparison is refused before any run (each of its runs would be deleted
    as the new grid reached it), and so is --resume (every run of a comparison starts afresh);
    --overwrite lets a new comparison replace the old one."""
    from distrain.cli import claim_compare_out
    from distrain.config import TrainConfig

    out = tmp_path / "c"
    (out / "allreduce" / "r0").mkdir(parents=True)
    (out / "comparison.json").write_text('{"configs": []}\n')
    (out / "allreduce" / "r0" / "notes.txt").write_text("mine\n")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    res = distrain("compare", "--out", str(out), *GRID, *args, timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"distrain: {flag}:"), res.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    claim_compare_out(out, TrainConfig.from_dict({"overwrite": True}))  # replaced on request: no error
    claim_compare_out(tmp_path / "new", TrainConfig())  # a new --out: no error
