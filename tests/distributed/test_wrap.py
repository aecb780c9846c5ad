"""The user's own loop: a script calling distrain.wrap() run through distrain launch and torchrun,
for every algorithm, against references computed here."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from tests.reliability.common import cli_env, kill_tagged, run_launch, tagged

SCRIPT = Path(__file__).with_name("wrap_script.py")
_spec = importlib.util.spec_from_file_location("wrap_script", SCRIPT)
user = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(user)

WORKERS = 4


def run(launcher: str, algorithm: str, mode: str, out: Path, settings: dict | None = None,
        launch_flags: tuple[str, ...] = (), timeout: float = 150, servers: int = 0) -> subprocess.CompletedProcess:
    """Run the user script as WORKERS processes (and ``servers`` parameter servers); check it
    succeeded and left nothing running."""
    settings = dict(settings or {})
    if servers and launcher == "torchrun":
        settings["servers"] = servers  # the last ranks; distrain launch says it with --servers
    script_args = [str(SCRIPT), algorithm, mode, str(out), json.dumps(settings)]
    if launcher == "launch":
        command = [sys.executable, "-m", "distrain", "launch", "--workers", str(WORKERS), "--timeout", "60",
                   *(("--servers", str(servers)) if servers else ()), *launch_flags, *script_args]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(WORKERS + servers), *script_args]
    tag = uuid.uuid4().hex
    try:
        done = subprocess.run(command, env=cli_env(tag, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                              timeout=timeout)
        assert tagged(tag) == []
    finally:
        kill_tagged(tag)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def reference_sync(workers: int = WORKERS, seed: int = 1) -> dict[str, torch.Tensor]:
    """One process on the concatenation of the workers' batches, with the same schedule."""
    model = user.make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    x, y = user.make_data(3 * workers * user.BATCH, seed)
    for step in range(3):
        rows = slice(step * workers * user.BATCH, (step + 1) * workers * user.BATCH)
        torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        inner.step()
        scheduler.step()
        inner.zero_grad()
    return model.state_dict()


def saved(out: Path) -> list[dict[str, torch.Tensor]]:
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORKERS)]


SYNC = {"allreduce": {}, "allreduce-gloo": {"ring": "gloo"}, "allreduce-own": {"ring": "own"},
        "allreduce-hierarchical": {"workers_per_node": 2}}
#: In CI: the default (``ring="auto"``: this model's one small bucket by recursive doubling); gloo's
#: collective for every bucket, the own ring and hierarchical all-reduce have their own fast tests.
SYNC_CI = {"allreduce"}


@pytest.mark.parametrize("launcher", ["launch", pytest.param("torchrun", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", [n if n in SYNC_CI else pytest.param(n, marks=pytest.mark.slow) for n in SYNC])
def test_synchronous_equals_one_process_on_the_concatenated_batches(tmp_path: Path, launcher: str, name: str):
    run(launcher, "allreduce", "sync", tmp_path, SYNC[name])
    expected = reference_sync()
    for rank, state in enumerate(saved(tmp_path)):
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=1e-5, msg=f"rank {rank} {key}")


#: Parameter servers (2 of them): sync, and async at staleness 0 (a round of pushes is a sync step).
PS = {"ps-sync": {}, "ps-async": {"ps_mode": "async", "max_staleness": 0}}


@pytest.mark.parametrize("launcher", ["launch", pytest.param("torchrun", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", [pytest.param("ps-sync", marks=pytest.mark.slow),  # CI: test_elastic's ps case
                                  pytest.param("ps-async", marks=pytest.mark.slow)])
def test_parameter_servers_equal_one_process_on_the_concatenated_batches(tmp_path: Path, launcher: str, name: str):
    # The workers' StepLR halves the rate every step: the servers step at the rate each push carries.
    done = run(launcher, "ps", "sync", tmp_path, PS[name], servers=2)
    expected = reference_sync()
    for rank, state in enumerate(saved(tmp_path)):
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=1e-5, msg=f"rank {rank} {key}")
    assert not (tmp_path / f"rank{WORKERS}.pt").exists()  # the servers left inside wrap()
    assert "Traceback" not in done.stderr


#: Groups of half the processes (process_group=): the algorithms that train in one.
GROUPS = {"allreduce": ("allreduce", {}), "allreduce-own": ("allreduce", {"ring": "own"}),
          "diloco": ("diloco", {"sync_every": 1, "outer_optimizer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.0})}


@pytest.mark.parametrize("name", ["allreduce", pytest.param("allreduce-own", marks=pytest.mark.slow),
                                  pytest.param("diloco", marks=pytest.mark.slow)])
def test_each_process_group_equals_one_process_on_its_own_concatenated_batches(tmp_path: Path, name: str):
    # Processes 0-1 and 2-3 train in two groups on different data: each group's model is one
    # process on its two workers' batches, and nothing of the other group's reaches it.
    algorithm, settings = GROUPS[name]
    run("launch", algorithm, "groups", tmp_path, settings)
    half = WORKERS // 2
    expected = [reference_sync(half, seed=1 + g) for g in range(2)]
    assert not torch.allclose(expected[0]["0.weight"], expected[1]["0.weight"])  # the groups' runs differ
    for rank, state in enumerate(saved(tmp_path)):
        for key, value in expected[rank // half].items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=1e-5, msg=f"rank {rank} {key}")


@pytest.mark.slow  # ~8 s; all-reduce in groups above in CI, decentralized in the whole world in test_elastic
@pytest.mark.parametrize("algorithm", ["dpsgd", "d2"])
def test_decentralized_groups_keep_each_group_mean_and_never_mix(tmp_path: Path, algorithm: str):
    # lr 0, models moved by + their global rank: gossip inside each group keeps that group's mean
    # (0.5 and 2.5 above the start); a message from the other group would move it
    run("launch", algorithm, "groups-mean", tmp_path)
    start, states, half = user.make_model().state_dict(), saved(tmp_path), WORKERS // 2
    for g in range(2):
        members = range(g * half, (g + 1) * half)
        for key, value in start.items():
            mean = torch.stack([states[r][key] for r in members]).mean(0)
            torch.testing.assert_close(mean, value + sum(members) / half, rtol=0, atol=1e-5, msg=f"group {g} {key}")
            for r in members:  # they averaged: each stood 0.5 from the group's mean before
                assert (states[r][key] - mean).abs().max() < 0.45, (g, r, key)


# `make test-all`: a group of some processes stays in CI (the test above); this is its refusal
@pytest.mark.slow
def test_a_group_of_some_processes_refuses_what_makes_groups_over_the_world(tmp_path: Path):
    script = tmp_path / "groups.py"
    script.write_text("import torch, torch.distributed as dist, distrain\n"
                      "dist.init_process_group('gloo')\n"
                      "groups = [dist.new_group([0]), dist.new_group([1])]\n"
                      "model = torch.nn.Linear(2, 1)\n"
                      "distrain.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), algorithm='prague',\n"
                      "              process_group=groups[dist.get_rank()])\n")
    done = run_launch(["--workers", "2", "--timeout", "30", str(script)])
    assert done.returncode == 2  # a setting wrap() refused: bad input
    assert "process_group: a group of some of the processes trains with allreduce, dpsgd, d2, diloco; " \
           "'prague' makes process groups over the whole world" in done.stderr


def test_parameter_servers_refuse_an_optimizer_they_cannot_step(tmp_path: Path):
    script = tmp_path / "lbfgs.py"
    script.write_text("import torch, distrain\n"
                      "model = torch.nn.Linear(2, 1)\n"
                      "distrain.wrap(model, torch.optim.Rprop(model.parameters()), algorithm='ps', ps_mode='async')\n")
    done = run_launch(["--workers", "2", "--servers", "1", "--timeout", "30", str(script)])
    assert done.returncode == 2  # a setting wrap() refused: bad input
    assert "ps_mode: async servers step SGD, Adam or AdamW, not Rprop; use ps_mode sync" in done.stderr


@pytest.mark.slow  # `make test-all` (about 9 s): test_diloco.py checks the outer step against references in CI
def test_diloco_with_one_inner_step_and_plain_outer_sgd_is_allreduce_sgd(tmp_path: Path):
    # H = 1, outer SGD at lr 1 without momentum: the shared parameters move by the mean of the
    # workers' single SGD steps, which is all-reduce SGD (the StepLR acts on the inner optimizer).
    run("launch", "diloco", "sync", tmp_path, {"sync_every": 1, "outer_optimizer": "sgd", "outer_lr": 1.0,
                                              "outer_momentum": 0.0})
    expected = reference_sync()
    for rank, state in enumerate(saved(tmp_path)):
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=1e-5, msg=f"rank {rank} {key}")


@pytest.mark.slow  # CI: all-reduce through wrap() below, a GPT training in tests/e2e/test_lm.py
def test_a_gpt_under_allreduce_equals_one_process_on_the_concatenated_batches(tmp_path: Path):
    run("launch", "allreduce", "lm", tmp_path)
    model = user.make_gpt()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = user.make_tokens(3 * WORKERS * user.BATCH)
    for step in range(3):
        rows = slice(step * WORKERS * user.BATCH, (step + 1) * WORKERS * user.BATCH)
        torch.nn.functional.cross_entropy(model(x[rows]).reshape(-1, 256), y[rows].reshape(-1)).backward()
        inner.step()
        inner.zero_grad()
    for rank, state in enumerate(saved(tmp_path)):
        for key, value in model.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=1e-5, msg=f"rank {rank} {key}")


@pytest.mark.slow  # `make test-all`: test_launch_script.py runs wrap() with torchrun's environment in CI
def test_synchronous_under_torchrun(tmp_path: Path):
    run("torchrun", "allreduce", "sync", tmp_path)
    expected = reference_sync()
    for state in saved(tmp_path):
        for key, value in expected.items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=1e-5)


#: Settings whose state goes beyond the optimizer's: error-feedback residuals and momentum moved
#: into the compressor, the gossip's mixing, and the servers' momentum (2 servers).
RESUMABLE = {"allreduce-topk": ("allreduce", {"compress": "group_topk:0.1", "momentum_correction": "on"}, 0),
             "dpsgd": ("dpsgd", {}, 0), "ps": ("ps", {}, 2), "ps-async": ("ps", {"ps_mode": "async"}, 2)}


@pytest.mark.parametrize("name", [pytest.param("allreduce-topk", marks=pytest.mark.slow),  # CI: test_resume.py
                                  pytest.param("dpsgd", marks=pytest.mark.slow),
                                  pytest.param("ps", marks=pytest.mark.slow),  # CI: test_resume.py, test_ps_state.py
                                  pytest.param("ps-async", marks=pytest.mark.slow)])
def test_a_script_resumed_from_its_checkpoint_matches_the_uninterrupted_run(tmp_path: Path, name: str):
    algorithm, settings, servers = RESUMABLE[name]
    run("launch", algorithm, "full", tmp_path, settings, servers=servers)
    run("launch", algorithm, "first", tmp_path, settings, servers=servers)
    run("launch", algorithm, "second", tmp_path, settings, servers=servers)
    for rank in range(WORKERS):
        uninterrupted = torch.load(tmp_path / f"full{rank}.pt", weights_only=True)
        resumed = torch.load(tmp_path / f"second{rank}.pt", weights_only=True)
        for key, value in uninterrupted.items():
            torch.testing.assert_close(resumed[key], value, rtol=0, atol=1e-6, msg=f"rank {rank} {key}")
        first = torch.load(tmp_path / f"first{rank}.pt", weights_only=True)
        assert any(not torch.equal(first[k], v) for k, v in uninterrupted.items())  # it trained after the stop


@pytest.mark.parametrize("launcher", ["launch", pytest.param("torchrun", marks=pytest.mark.slow)])
@pytest.mark.parametrize("algorithm", [pytest.param("dpsgd", marks=pytest.mark.slow),  # CI: test_elastic.py's gossip
                                       pytest.param("d2", marks=pytest.mark.slow)])
def test_decentralized_keeps_the_global_mean_at_lr_zero(tmp_path: Path, launcher: str, algorithm: str):
    run(launcher, algorithm, "mean", tmp_path)
    start = user.make_model().state_dict()
    states = saved(tmp_path)
    mean_offset = sum(range(WORKERS)) / WORKERS
    for key, value in start.items():
        final = torch.stack([s[key] for s in states])
        torch.testing.assert_close(final.mean(0), value + mean_offset, rtol=0, atol=1e-5)
        # the models were mixed: closer together than the rank offsets they started with
        assert float((final - final.mean(0)).abs().max()) < 0.75 * (WORKERS - 1 - mean_offset)


def reference_accuracy(steps: int) -> float:
    """One process taking ``steps`` SGD steps of the script's batch on the whole training set."""
    model = user.make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = user.make_data(4000)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        rows = torch.randint(3200, (user.BATCH,), generator=g)
        torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        inner.step()
        inner.zero_grad()
    with torch.no_grad():
        return (model(x[3200:]).argmax(1) == y[3200:]).float().mean().item()


# `make test-all` (about 11 s a case): in CI Prague runs through wrap() and distrain launch in
# test_elastic.py's join test, with uneven steps (the joiner's)
@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["launch", "torchrun"])
@pytest.mark.parametrize("algorithm", ["adpsgd", "prague"])  # the same path
def test_asynchronous_finishes_with_uneven_steps(tmp_path: Path, launcher: str, algorithm: str):
    settings = {"epochs": 3, "batch_size": user.BATCH}
    if launcher == "launch":
        run(launcher, algorithm, "async", tmp_path, settings, launch_flags=("--slow-worker", "3:4x"))
    else:
        run(launcher, algorithm, "async", tmp_path, {**settings, "slow_worker": "3:4x"})
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORKERS)]
    steps = [r["steps"] for r in results]
    assert steps[3] < min(steps[:3]), steps  # the slow worker took fewer steps; nobody waited for it
    budget = 3 * (3200 // (WORKERS * user.BATCH))  # steps per worker in 3 epochs
    assert sum(steps) >= 0.9 * budget * WORKERS, steps  # the global budget was used
    accuracies = {round(r["accuracy"], 6) for r in results}
    assert len(accuracies) == 1, accuracies  # every worker holds the same consensus
    # as good as one worker alone taking a worker's share of the steps (the consensus averages
    # models trained on 4 shards at once, so it should not be worse)
    assert accuracies.pop() >= reference_accuracy(budget) - 0.03
