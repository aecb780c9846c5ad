"""``distrain report`` on a real run directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_cli import QUICK, TIMEOUT, distrain


@pytest.mark.timeout(TIMEOUT + 10)
@pytest.mark.slow  # `make test-all`: test_report_plots.py draws every plot from recorded runs in CI
def test_report_plots_a_real_run(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "a"
    res = distrain("train", "--workers", "2", "--run-dir", str(run), *QUICK, "--eval-every", "0.25")
    assert res.returncode == 0, res.stderr[-3000:]
    res = distrain("report", str(run), "--out", str(tmp_path / "plots"))
    assert res.returncode == 0, res.stderr[-3000:]
    expected = ["accuracy_vs_epoch.png", "accuracy_vs_time.png", "bytes_sent_per_worker.png", "loss_distribution.png",
                "loss_vs_time.png", "quality_vs_bytes.png", "throughput_per_worker.png"]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == expected
    for name in expected:
        assert (tmp_path / "plots" / name).stat().st_size > 10_000
        assert f"wrote {tmp_path / 'plots' / name}" in res.stdout
    assert "allreduce (baseline)" in res.stdout
    # Without --out: a single run's report goes inside it.
    res = distrain("report", str(run))
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in (run / "report").iterdir()) == expected


def test_report_on_a_missing_directory_exits_2(tmp_path: Path) -> None:
    res = distrain("report", str(tmp_path / "nope"), timeout=60)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not exist" in lines[0]
