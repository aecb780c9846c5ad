"""``distrain launch`` forks every rank from one process that imported torch once
(:mod:`distrain.launch.preload`): each rank's script must still find what ``python SCRIPT``
gives it, and end as it would. Each test compares a preloaded launch with ``--no-preload`` (a
fresh ``python`` per rank, as torchrun starts them) on the same script."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.reliability.common import kill_tagged, tagged

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).parents[2]

FACTS = r'''
import atexit, json, os, random, signal, sys
preloaded = "torch" in sys.modules
import torch
out = __import__("pathlib").Path(sys.argv[1])
facts = {
    "name": __name__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(),
    "rank": os.environ["RANK"], "world": os.environ["WORLD_SIZE"], "join": os.environ.get("DISTRAIN_JOIN"),
    "own_group": os.getpgid(0) == os.getpid(), "stdin": sys.stdin.read(),
    "sigint": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "random": random.random(), "torch_random": torch.rand(1).item(), "preloaded": preloaded,
    "threads": torch.get_num_threads(), "file": __file__,
}
atexit.register(lambda: (out / f"atexit{facts['rank']}").write_text("1"))
(out / f"facts{facts['rank']}.json").write_text(json.dumps(facts))
print(f"hello from {facts['rank']}")
how = sys.argv[2] if len(sys.argv) > 2 else "ok"
if facts["rank"] == "1" and how == "exit3":
    sys.exit(3)
if facts["rank"] == "1" and how == "raise":
    raise RuntimeError("the script's own error")
if how == "hang":
    import time
    time.sleep(600)
'''


def _launch(tmp_path: Path, *flags: str, how: str = "ok", module: bool = False, env: dict | None = None,
            workers: int = 2) -> subprocess.CompletedProcess:
    script = tmp_path / "facts_script.py"
    script.write_text(FACTS)
    out = tmp_path / ("fork" if "--no-preload" not in flags else "exec")
    out.mkdir(exist_ok=True)
    target = ["-m", "facts_script"] if module else [script.name]  # (relative, from its directory)
    command = [sys.executable, "-m", "distrain", "launch", "--workers", str(workers), *flags, *target, str(out), how]
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path) if module else ""]),
               **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, timeout=100, cwd=tmp_path, env=environ)


def _facts(tmp_path: Path, kind: str, workers: int = 2) -> dict[str, dict]:
    return {r: json.loads((tmp_path / kind / f"facts{r}.json").read_text()) for r in map(str, range(workers))}


@pytest.mark.parametrize("module", [False, True], ids=["script", "module"])
def test_a_forked_rank_finds_what_a_fresh_python_gives_it(tmp_path: Path, module: bool):
    forked, fresh = _launch(tmp_path, module=module), _launch(tmp_path, "--no-preload", module=module)
    assert forked.returncode == 0 and fresh.returncode == 0, (forked.stderr, fresh.stderr)
    fork, exec_ = _facts(tmp_path, "fork"), _facts(tmp_path, "exec")
    for r in fork:
        assert fork[r]["preloaded"] and not exec_[r]["preloaded"]  # the one difference meant
        for key in ("name", "path0", "cwd", "rank", "world", "join", "own_group", "stdin", "sigint", "sigterm",
                    "blocked", "threads", "file"):
            assert fork[r][key] == exec_[r][key], (key, fork[r][key], exec_[r][key])
        assert fork[r]["argv"][0] == exec_[r]["argv"][0] and Path(fork[r]["argv"][0]).name == "facts_script.py"
        assert fork[r]["argv"][1:] == [str(tmp_path / "fork"), "ok"] and exec_[r]["argv"][1:] == [str(tmp_path / "exec"), "ok"]
        assert (tmp_path / "fork" / f"atexit{r}").exists()  # the interpreter's exit ran its handlers
        assert f"[rank {r}] hello from {r}" in forked.stdout
    assert fork["0"]["name"] == "__main__" and fork["0"]["own_group"] and fork["0"]["stdin"] == ""
    for facts in (fork, exec_):  # seeded afresh in each rank, not the starter's state
        assert facts["0"]["random"] != facts["1"]["random"] and facts["0"]["torch_random"] != facts["1"]["torch_random"]


@pytest.mark.parametrize("how,line", [("exit3", "rank 1 failed: exit status 3"),
                                      ("raise", "rank 1 failed: RuntimeError: the script's own error (exit status 1)")])
def test_a_forked_rank_ends_as_a_fresh_one_would(tmp_path: Path, how: str, line: str):
    for flags in ((), ("--no-preload",)):
        done = _launch(tmp_path, *flags, how=how)
        assert done.returncode == 1, done.stderr
        assert done.stderr.strip().splitlines()[-1] == f"distrain: {line}", (flags, done.stderr)


def _hanging_launch(tmp_path: Path, tag: str, **popen: object) -> subprocess.Popen:
    """Two ranks of the script that hang once they wrote their facts, launched (tagged ``tag``);
    returned once both wrote them."""
    script = tmp_path / "facts_script.py"
    script.write_text(FACTS)
    (tmp_path / "fork").mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DISTRAIN_TEST_TAG": tag}
    launcher = subprocess.Popen([sys.executable, "-m", "distrain", "launch", "--workers", "2", str(script),
                                 str(tmp_path / "fork"), "hang"], cwd=tmp_path, env=env, **popen)  # type: ignore[call-overload]
    deadline = time.monotonic() + 60
    while not all((tmp_path / "fork" / f"facts{r}.json").exists() for r in range(2)):
        if time.monotonic() > deadline or launcher.poll() is not None:
            launcher.kill()
            raise AssertionError(f"the ranks did not start (launcher: {launcher.poll()})")
        time.sleep(0.05)
    return launcher


def test_a_killed_launcher_leaves_no_forked_rank_or_starter_running(tmp_path: Path):
    tag = f"preload-{tmp_path.parent.name}-{tmp_path.name}"
    launcher = _hanging_launch(tmp_path, tag, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert len(tagged(tag)) >= 4  # the launcher, its starter and the two ranks
        launcher.kill()
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 10
        while tagged(tag) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tagged(tag) == []
    finally:
        launcher.kill()
        kill_tagged(tag)


def test_ctrl_c_reaches_every_forked_rank_through_the_launcher(tmp_path: Path):
    tag = f"preload-int-{tmp_path.parent.name}-{tmp_path.name}"
    launcher = _hanging_launch(tmp_path, tag, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               start_new_session=True)
    try:
        os.killpg(launcher.pid, signal.SIGINT)  # as a terminal's Ctrl-C reaches the launcher's group
        _, err = launcher.communicate(timeout=30)
        assert launcher.returncode == 130
        assert err.strip().splitlines()[-1] == "distrain: interrupted (SIGINT); stopped 2 processes"
        assert tagged(tag) == []
    finally:
        launcher.kill()
        kill_tagged(tag)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (an orphan's zombie waits for whoever adopted it: not alive)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_starter_that_ended_hands_the_rank_back_to_be_started_with_python(tmp_path: Path):
    """The starter forks a rank and reports its exit status; once the starter is gone (killed), a
    rank it was running counts as killed with it, and a new request is refused (None), so that
    the launcher starts that rank with ``python`` instead."""
    from distrain.launch.preload import Starter

    script = tmp_path / "ends.py"
    script.write_text("import sys, time\nprint('ran', flush=True)\nsys.exit(int(sys.argv[1]))\n")
    hang = tmp_path / "hang.py"
    hang.write_text("import time\ntime.sleep(600)\n")
    starter = Starter()
    try:
        rank = starter.start(dict(os.environ), str(script), None, ["5"])
        assert rank is not None and rank.wait(timeout=60) == 5 and rank.stdout.read() == b"ran\n"
        running = starter.start(dict(os.environ), str(hang), None, [])
        assert running is not None and running.poll() is None
        starter.proc.kill()
        assert running.wait(timeout=30) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while _alive(running.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(running.pid)  # it died with the starter
        assert starter.start(dict(os.environ), str(script), None, ["0"]) is None and starter.refused == "it ended"
    finally:
        starter.proc.kill()
        starter.close()


def test_a_starter_that_ends_before_it_answers_hands_the_rank_back_to_be_started_with_python(tmp_path: Path):
    """Killed while it still imports torch, the starter never answers a request already sent:
    the request is refused (None, so the launcher starts that rank with python), not handed back
    as a rank that has no process and counts as killed."""
    import threading

    from distrain.launch.preload import Starter

    script = tmp_path / "ends.py"
    script.write_text("print('ran')\n")
    starter = Starter()
    got: list = []
    asking = threading.Thread(target=lambda: got.append(starter.start(dict(os.environ), str(script), None, [])))
    try:
        asking.start()
        deadline = time.monotonic() + 10
        while not starter._waiting and time.monotonic() < deadline:  # the request is sent, not answered
            time.sleep(0.001)
        assert starter._waiting and starter.proc.poll() is None
        starter.proc.kill()  # (it is importing torch: it answers nothing before its imports are done)
        asking.join(timeout=30)
        assert got == [None] and starter.refused == "it ended"
    finally:
        starter.proc.kill()
        asking.join(timeout=30)
        starter.close()
