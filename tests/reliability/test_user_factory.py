"""A user's model factory (``--model module:function``) as a user runs it: found in the current
directory by the ``distrain`` command, and, when it raises, one line for the whole run with the
traceback kept in the run directory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.reliability.common import QUICK, ROOT, Result, kill_tagged, tagged

pytestmark = pytest.mark.timeout(180)

MODULE = '''
import torch


def make_net(input_shape, num_classes, width):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(input_shape[-1], width), torch.nn.ReLU(),
                               torch.nn.Linear(width, num_classes))


def broken(input_shape, num_classes):
    raise RuntimeError("no weights for this input shape")
'''

#: QUICK's data, optimizer and timeouts, without its model.
SETTINGS = [a for i, a in enumerate(QUICK) if not (a.startswith("--model") or QUICK[i - 1].startswith("--model"))]

#: What pip writes as the ``distrain`` command: its own directory, not the current one, starts sys.path.
CONSOLE_SCRIPT = "import sys\nfrom distrain.cli import main\nif __name__ == '__main__':\n    sys.exit(main())\n"


def distrain_command(cwd: Path, *args: str, env_path: str = "") -> Result:
    """``distrain train ARGS`` typed in ``cwd`` (the console script, not ``python -m``), with the
    distrain this test session imports (PYTHONPATH first) and ``env_path`` on PYTHONPATH."""
    script = cwd / "bin" / "distrain"
    script.parent.mkdir(exist_ok=True)
    script.write_text(CONSOLE_SCRIPT)
    tag = uuid.uuid4().hex
    env = {**os.environ, "DISTRAIN_TEST_TAG": tag,
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT / "src"), env_path]))}
    proc = subprocess.Popen([sys.executable, str(script), "train", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=150)
        orphans = tagged(tag)
    finally:
        proc.kill()
        kill_tagged(tag)
    return Result(proc.returncode, out, err, 0.0, orphans)


def test_a_factory_in_the_current_directory_is_found_without_pythonpath(tmp_path):
    (tmp_path / "mynets.py").write_text(MODULE)
    run = distrain_command(tmp_path, *SETTINGS, "--workers", "2", "--epochs", "0.5", "--model", "mynets:make_net",
                           "--model-width", "24", "--run-dir", "run")
    assert run.returncode == 0, run.stderr
    assert run.orphans == []
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["model"] == "mynets:make_net" and summary["workers"] == 2


def test_a_factory_that_raises_gives_one_line_and_keeps_the_traceback(tmp_path):
    (tmp_path / "mynets.py").write_text(MODULE)
    # PYTHONPATH names the module's directory, so this fails only for the factory's own reason.
    run = distrain_command(tmp_path, *SETTINGS, "--workers", "4", "--model", "mynets:broken", "--run-dir", "run",
                           env_path=str(tmp_path))
    # 1, not 2: the settings were valid and the workers started; the user's code then failed
    # at run time, as a script that raises exits with 1.
    assert run.returncode == 1, run.stderr
    assert run.orphans == []
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    match = re.fullmatch(r"distrain: worker (\d) failed: --model mynets:broken: the factory raised RuntimeError: "
                         r"no weights for this input shape; the run was stopped \(traceback in (.+)\)", lines[0])
    assert match, lines[0]
    log = tmp_path / match.group(2)  # --run-dir run: relative to where the user typed the command
    assert log == tmp_path / "run" / "failures" / f"rank-{match.group(1)}.log"
    trace = log.read_text()
    assert trace.startswith("Traceback (most recent call last):")
    assert 'raise RuntimeError("no weights for this input shape")' in trace  # the user's own line
    assert not (tmp_path / "run" / "summary.json").exists()
