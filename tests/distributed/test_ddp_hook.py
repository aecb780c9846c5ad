"""The group top-k DDP communication hook, in real DDP over gloo processes."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from distrain.ddp_hooks import GroupTopKState, group_topk_hook
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


def _body(rank: int, world: int) -> dict:
    plain, _ = train(rank, None, steps=12, lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ratio 1.0 warns that it is pointless
        dense_state = GroupTopKState(ratio=1.0, group=64)
    hooked, _ = train(rank, dense_state, steps=12, lr=0.05)
    sparse_state = GroupTopKState(ratio=0.01, group=256)
    sparse, losses = train(rank, sparse_state, steps=300, lr=0.1)
    x, y = make_data(10)  # held-out data, the same on every rank
    with torch.no_grad():
        accuracy = (sparse(x).argmax(1) == y).float().mean()
    return {"plain": torch.cat([p.detach().reshape(-1) for p in plain.parameters()]),
            "hooked": torch.cat([p.detach().reshape(-1) for p in hooked.parameters()]),
            "sparse": torch.cat([p.detach().reshape(-1) for p in sparse.parameters()]),
            "losses": torch.tensor(losses), "accuracy": accuracy,
            "residual_keys": torch.tensor(sorted(sparse_state.residuals)), "iter": torch.tensor(sparse_state.iter)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_group(_body, 2, timeout=120)


@pytest.mark.timeout(180)
def test_hook_at_ratio_one_matches_ddp_without_hook(results):
    for r in results:
        torch.testing.assert_close(r["hooked"], r["plain"], rtol=1e-5, atol=1e-6)
    assert torch.equal(results[0]["hooked"], results[1]["hooked"])


@pytest.mark.timeout(180)
def test_hook_at_one_percent_still_converges(results):
    r = results[0]
    assert torch.equal(r["sparse"], results[1]["sparse"])  # replicas stay identical
    assert len(r["residual_keys"]) > 1 and int(r["iter"]) == 300  # memory per bucket
    first, last = r["losses"][:20].mean(), r["losses"][-50:].mean()
    assert last < 0.5 * first, (float(first), float(last))
    assert float(r["accuracy"]) > 0.8  # about 0.89 measured; guessing the majority class gives 0.5


def test_state_rejects_bad_settings_and_round_trips():
    with pytest.raises(ValueError, match="ratio"):
        GroupTopKState(ratio=0.0)
    with pytest.raises(ValueError, match="group"):
        GroupTopKState(group=0)
    with pytest.raises(ValueError, match="start_iter"):
        GroupTopKState(start_iter=1)
    with pytest.warns(UserWarning, match="ratio=1.0"):
        GroupTopKState(ratio=1.0)
    state = GroupTopKState()
    state.iter, state.residuals = 7, {0: torch.ones(3), 2: torch.zeros(5)}
    other = GroupTopKState()
    other.load_state_dict(state.state_dict())
    assert other.iter == 7 and sorted(other.residuals) == [0, 2] and torch.equal(other.residuals[0], torch.ones(3))
