"""The group top-k DDP communication hook, in real DDP over gloo processes."""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import threading
import warnings
import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from distrain.data import load_dataset
from distrain.data.batches import batches_of
from distrain.ddp_hooks import GroupTopKState, group_topk_hook
from distrain.launch.common import free_port
from distrain.models import build_model
from tests.harness import run_group


def make_data(rank: int, n: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, 20, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return x, y


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 3))


def train(rank: int, state: GroupTopKState | None, steps: int, lr: float) -> tuple[torch.nn.Module, list[float]]:
    # A tiny bucket cap gives several buckets, so error feedback is kept per bucket.
    model = DDP(make_model(), bucket_cap_mb=0.01)
    if state is not None:
        model.register_comm_hook(state, group_topk_hook)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    x, y = make_data(rank)
    losses = []
    for step in range(steps):
        batch = slice((step * 32) % len(x), (step * 32) % len(x) + 32)
        opt.zero_grad()
        loss = F.cross_entropy(model(x[batch]), y[batch])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model.module, losses


def train_default_job(rank: int, world: int, state: GroupTopKState | None) -> tuple[torch.nn.Module, list[float], float]:
    """The default job's data and model (MNIST-1D, the 1-D CNN), shortened: each rank its half."""
    train_set, test_set = load_dataset("mnist1d", num_samples=8000, seed=0)
    torch.manual_seed(0)
    model = DDP(build_model("cnn1d", train_set.input_shape, train_set.num_classes), bucket_cap_mb=0.02)
    if state is not None:
        model.register_comm_hook(state, group_topk_hook)
    # with the hook, momentum is applied inside it (momentum correction), not by the optimizer
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9 if state is None else 0.0)
    mine = torch.arange(rank, len(train_set), world)
    order = mine[torch.randperm(len(mine), generator=torch.Generator().manual_seed(rank))]
    losses = []
    for step in range(STEPS):
        batch = order[(step * 64) % (len(order) - 63):][:64]
        x, y = batches_of(train_set, batch)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        x, y = batches_of(test_set, torch.arange(len(test_set)))
        accuracy = float((model.module(x).argmax(1) == y).float().mean())
    return model.module, losses, accuracy


STEPS = 800  # about 13 epochs of each rank's 4,000 samples
WARMUP = 62  # dense iterations (one epoch) before 1%, as the density warm-up of --compress does


def futures_done_after_last_bucket(rank: int, steps: int) -> list[bool]:
    """Train with the hook wrapped; after the last bucket of each iteration, whether every
    future the hook returned in that iteration is already complete."""
    model = DDP(make_model(), bucket_cap_mb=0.01)
    futures: list[torch.futures.Future] = []
    done: list[bool] = []

    def watched(state, bucket):  # noqa: ANN001, ANN202 (DDP checks real annotations, not strings)
        future = group_topk_hook(state, bucket)
        futures.append(future)
        if bucket.is_last():
            done.append(all(f.done() for f in futures))
            futures.clear()
        return future

    model.register_comm_hook(GroupTopKState(ratio=0.1, group=64), watched)
    x, y = make_data(rank)
    for step in range(steps):
        F.cross_entropy(model(x[step * 32:(step + 1) * 32]), y[step * 32:(step + 1) * 32]).backward()
    return done


def threads_releasing_collective_tensors(rank: int, steps: int) -> tuple[int, int]:
    """Train with the hook while watching every tensor it hands to a collective: how many of them
    were released in all, and how many by a thread other than this one (the backend's)."""
    released: list[int] = []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather")}

    def watching(collective):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a]
            for t in tensors:
                weakref.finalize(t, lambda: released.append(threading.get_ident()))
            return collective(*args, **kwargs)
        return call

    try:
        for name, collective in originals.items():
            setattr(dist, name, watching(collective))
        model = DDP(make_model(), bucket_cap_mb=0.01)
        state = GroupTopKState(ratio=0.1, group=64)
        model.register_comm_hook(state, group_topk_hook)
        x, y = make_data(rank)
        for step in range(steps):
            F.cross_entropy(model(x[step * 32:(step + 1) * 32]), y[step * 32:(step + 1) * 32]).backward()
        del model, state
        gc.collect()
    finally:
        for name, collective in originals.items():
            setattr(dist, name, collective)
    return len(released), sum(ident != threading.get_ident() for ident in released)


def _exact_body(rank: int, world: int) -> dict:
    plain, _ = train(rank, None, steps=12, lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ratio 1.0 warns that it is pointless
        dense_state = GroupTopKState(ratio=1.0, group=64)
    hooked, _ = train(rank, dense_state, steps=12, lr=0.05)
    return {"plain": torch.cat([p.detach().reshape(-1) for p in plain.parameters()]),
            "hooked": torch.cat([p.detach().reshape(-1) for p in hooked.parameters()]),
            "futures_done": torch.tensor(futures_done_after_last_bucket(rank, steps=6)),
            "released": torch.tensor(threads_releasing_collective_tensors(rank, steps=6))}


def _converge_body(rank: int, world: int) -> dict:
    _, _, dense_accuracy = train_default_job(rank, world, None)
    sparse_state = GroupTopKState(ratio=0.01, group=1024, momentum=0.9, start_iter=WARMUP)
    sparse, losses, accuracy = train_default_job(rank, world, sparse_state)
    return {"sparse": torch.cat([p.detach().reshape(-1) for p in sparse.parameters()]),
            "losses": torch.tensor(losses), "accuracy": accuracy, "dense_accuracy": dense_accuracy,
            "residual_keys": torch.tensor(sorted(sparse_state.residuals)), "iter": torch.tensor(sparse_state.iter)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_group(_exact_body, 2, timeout=120)


@pytest.mark.timeout(180)
def test_hook_at_ratio_one_matches_ddp_without_hook(results):
    for r in results:
        torch.testing.assert_close(r["hooked"], r["plain"], rtol=1e-5, atol=1e-6)
    assert torch.equal(results[0]["hooked"], results[1]["hooked"])


@pytest.mark.slow  # `make test-all`: 2 x 800 steps of the default job; the hook's arithmetic is checked above
@pytest.mark.timeout(180)
def test_hook_at_one_percent_still_converges():
    results = run_group(_converge_body, 2, timeout=120)
    r = results[0]
    assert torch.equal(r["sparse"], results[1]["sparse"])  # replicas stay identical
    assert len(r["residual_keys"]) > 1 and int(r["iter"]) == STEPS  # memory per bucket
    print(f"accuracy with the hook at 1%: {r['accuracy']:.4f}, plain DDP: {r['dense_accuracy']:.4f}")
    first, last = r["losses"][:20].mean(), r["losses"][-50:].mean()
    assert last < 0.5 * first, (float(first), float(last))
    assert r["accuracy"] > r["dense_accuracy"] - 0.1  # ten classes: chance is 0.1


@pytest.mark.timeout(180)
def test_no_future_is_left_to_the_backend_after_the_last_bucket(results):
    """Every bucket's future is complete when the hook returns for the last one: no Python
    callback is left to run (and be released) on a gloo thread while the program goes on, and
    perhaps exits."""
    for r in results:
        assert r["futures_done"].tolist() == [True] * 6  # dense iterations (2) and sparse ones


@pytest.mark.timeout(180)
def test_the_hook_leaves_releasing_its_tensors_to_the_training_thread(results):
    """Dropping the last reference to a collective's tensor takes the GIL (its Python object);
    a gloo thread doing so while Python exits aborts the process. The hook keeps each
    iteration's works until the next one, so the training thread releases them. (A work just
    completed can still be held by its gloo thread for a moment; here the model and state are
    deleted right after the last backward, so the last collectives may go either way.)"""
    for r in results:
        released, by_backend = r["released"].tolist()
        assert released >= 6 * 3  # non-vacuous: 6 iterations of at least 3 buckets, each a collective
        assert by_backend <= 6, f"{by_backend} of {released} released by a backend thread"  # 48 of 51 before


#: The README's DDP-hook script, run as its users run it.
README = Path(__file__).resolve().parents[2] / "README.md"


def readme_hook_script() -> str:
    match = re.search(r"```python\n(# ddp_topk\.py\n.*?)```", README.read_text(), re.S)
    assert match, "README.md has no ddp_topk.py script"
    return match.group(1)


def run_readme_hook_script(tmp_path: Path, runs: int) -> list[str]:
    """Run the README's script ``runs`` times under torchrun; the failures, one line each."""
    script = tmp_path / "ddp_topk.py"
    script.write_text(readme_hook_script())
    failures = []
    for i in range(runs):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), str(script)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        if out.returncode != 0 or "terminate called" in out.stderr or not re.fullmatch(r"loss \d\.\d{3}\n", out.stdout):
            failures.append(f"run {i}: status {out.returncode}: {out.stderr[-500:]!r} {out.stdout!r}")
    assert (tmp_path / "topk-state-1.pt").is_file()
    return failures


@pytest.mark.timeout(300)
def test_readme_hook_script_exits_cleanly(tmp_path):
    assert run_readme_hook_script(tmp_path, runs=1) == []


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_readme_hook_script_exits_cleanly_twenty_times(tmp_path):
    assert run_readme_hook_script(tmp_path, runs=20) == []


def test_state_rejects_bad_settings_and_round_trips():
    with pytest.raises(ValueError, match="ratio"):
        GroupTopKState(ratio=0.0)
    with pytest.raises(ValueError, match="group"):
        GroupTopKState(group=0)
    with pytest.raises(ValueError, match="start_iter"):
        GroupTopKState(start_iter=1)
    with pytest.raises(ValueError, match="momentum"):
        GroupTopKState(momentum=1.0)
    with pytest.warns(UserWarning, match="ratio=1.0"):
        GroupTopKState(ratio=1.0)
    state = GroupTopKState()
    state.iter, state.residuals = 7, {0: torch.ones(3), 2: torch.zeros(5)}
    state.velocities = {1: torch.full((4,), 2.0)}
    other = GroupTopKState()
    other.load_state_dict(state.state_dict())
    assert other.iter == 7 and sorted(other.residuals) == [0, 2] and torch.equal(other.residuals[0], torch.ones(3))
    assert sorted(other.velocities) == [1] and torch.equal(other.velocities[1], torch.full((4,), 2.0))
