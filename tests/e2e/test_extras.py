"""Without the optional packages, as a user without the extras has them: real processes.

Stand-in packages named ``mnist1d``, ``sklearn``, ``matplotlib``, ``yaml`` and ``tokenizers`` go
first on PYTHONPATH, so every process (the launcher and the workers it spawns) sees them instead
of the installed ones. Importing one records the attempt in a log and raises ModuleNotFoundError, as
for a package that is not installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TIMEOUT = 120
#: The optional packages (distrain[data], [plots], [yaml], [lm]), by the name they are imported as.
OPTIONAL = ("mnist1d", "sklearn", "matplotlib", "yaml", "tokenizers")

STAND_IN = """\
import os
with open(os.environ["DISTRAIN_TEST_IMPORT_LOG"], "a") as log:
    log.write(__name__ + "\\n")
raise ModuleNotFoundError("No module named " + repr(__name__), name=__name__)
"""

OWN_MODEL = """\
import json
import sys

import torch
from torch.utils.data import TensorDataset

import distrain


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))


if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1200, 8, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    train, test = TensorDataset(x[:1000], y[:1000]), TensorDataset(x[1000:], y[1000:])
    summary = distrain.fit(make_model, train, test, workers=2, epochs=2, batch_size=16, lr=0.05,
                           progress=False, timeout=60, run_dir=sys.argv[1])
    majority = max(float(y[1000:].float().mean()), 1 - float(y[1000:].float().mean()))
    print(json.dumps({"accuracy": summary["final_test_accuracy"], "majority": majority}))
"""


def without_extras(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """An environment whose processes cannot import the optional packages, and the log of tries."""
    shadow = tmp_path / "shadow"
    for module in OPTIONAL:
        (shadow / module).mkdir(parents=True)
        (shadow / module / "__init__.py").write_text(STAND_IN)
    log = tmp_path / "imports.log"
    path = os.pathsep.join(p for p in (str(shadow), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "DISTRAIN_TEST_IMPORT_LOG": str(log),
           "DISTRAIN_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    return env, log


@pytest.mark.timeout(TIMEOUT + 10)
def test_own_model_trains_without_the_extras(tmp_path: Path) -> None:
    env, log = without_extras(tmp_path)
    script = tmp_path / "own_model.py"
    script.write_text(OWN_MODEL)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "run")], capture_output=True, text=True,
                         timeout=TIMEOUT, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["accuracy"] > result["majority"] + 0.1
    # Not even tried, by the launcher or by either worker.
    assert not log.exists(), log.read_text()
    assert (tmp_path / "run" / "metrics" / "rank1.jsonl").is_file()


@pytest.mark.timeout(TIMEOUT + 10)
def test_default_dataset_without_mnist1d_is_one_line(tmp_path: Path) -> None:
    env, log = without_extras(tmp_path)
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "distrain", "train", "--run-dir", str(run)], capture_output=True,
                         text=True, timeout=TIMEOUT, env=env, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.splitlines() == [
        "distrain: --dataset mnist1d needs the 'mnist1d' package: pip install 'distrain[data]'"]
    assert log.read_text().split() == ["mnist1d"]
    assert not (tmp_path / "cache").exists()
    assert not [p for p in run.rglob("*") if p.is_file()]  # no worker started, nothing written
