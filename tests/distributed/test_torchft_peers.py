"""torchft's DiLoCo as a peer: real replica groups (one lighthouse, a Manager per worker, gloo on
127.0.0.1) against a reference computed here with distrain's outer Nesterov step, and the bytes
its process group counts. (tests/e2e/test_compare_torchft.py checks that torchft's LocalSGD makes
the same steps as DiLoCo with outer SGD at lr 1, i.e. averages.)"""

from __future__ import annotations

import copy
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distrain.baselines.common import launch_peer
from distrain.baselines.wire import WireMeter
from distrain.comm.transport import ring_share
from distrain.config import TrainConfig
from distrain.errors import WorkerFailure
from tests.conftest import small_config
from tests.harness import run_group

pytest.importorskip("torchft", reason="the torchft peers need torchft: pip install 'distrain[peers]'")

from distrain.baselines import build_peer  # noqa: E402
from distrain.baselines.lighthouse import Lighthouse  # noqa: E402
from distrain.baselines.torchft_peers import TorchftDiLoCo  # noqa: E402

WORKERS, H, ROUNDS, TAIL = 2, 3, 2, 1  # the TAIL steps after the last sync are not in the synced model
INNER_LR, INNER_MOMENTUM = 0.1, 0.5
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def inner(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=INNER_LR, momentum=INNER_MOMENTUM)


def loss_of(net: torch.nn.Module, worker: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * worker + step)
    x, y = torch.randn(5, 3, generator=g), torch.randn(5, 1, generator=g)
    return ((net(x) - y) ** 2).mean()


def flat(net: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def config() -> TrainConfig:
    return TrainConfig.from_dict({"workers": WORKERS, "sync_every": H, "outer_optimizer": "nesterov",
                                  "outer_lr": OUTER_LR, "outer_momentum": OUTER_MOMENTUM, "timeout": 30}).validate()


def _body(rank: int, world: int, lighthouse: str) -> dict:
    torch.set_num_threads(1)
    steps = H * ROUNDS + TAIL
    net = model()
    optimizer = inner(net)
    meter = WireMeter(world, rank)
    peer = build_peer(f"torchft-diloco:{H}")
    peer.lighthouse = lighthouse  # what the launcher's serve() sets before the workers start
    try:
        peer.register(net, optimizer, meter, config(), steps, steps)
        for step in range(steps):
            optimizer.zero_grad()
            loss_of(net, rank, step).backward()
            optimizer.step()  # torchft syncs in here every H steps
            peer.after_step(net)
        return {"eval": flat(peer.eval_model(net)), "local": flat(net), "sent": torch.tensor(meter.bytes_sent),
                "rounds": torch.tensor(peer.replica.manager.current_step())}
    finally:
        peer.close()


def reference() -> tuple[torch.Tensor, torch.Tensor]:
    """The shared parameters after ROUNDS syncs, and worker 0's own after the TAIL steps."""
    shared = model()
    nets = [copy.deepcopy(shared) for _ in range(WORKERS)]
    optimizers = [inner(net) for net in nets]  # the inner optimizers keep their momentum across rounds
    state: dict = {}
    for r in range(ROUNDS):
        for w, (net, optimizer) in enumerate(zip(nets, optimizers, strict=True)):
            net.load_state_dict(shared.state_dict())
            for step in range(r * H, (r + 1) * H):
                optimizer.zero_grad()
                loss_of(net, w, step).backward()
                optimizer.step()
        delta = sum(flat(shared) - flat(net) for net in nets) / WORKERS
        new = nesterov(flat(shared), delta, state)
        torch.nn.utils.vector_to_parameters(new, shared.parameters())
    net, optimizer = nets[0], optimizers[0]
    net.load_state_dict(shared.state_dict())
    optimizer.zero_grad()
    loss_of(net, 0, H * ROUNDS).backward()
    optimizer.step()
    return flat(shared), flat(net)


def nesterov(start: torch.Tensor, delta: torch.Tensor, state: dict) -> torch.Tensor:
    """distrain's --outer-optimizer nesterov: buf = mu buf + delta; start -= lr (delta + mu buf)."""
    state["buf"] = OUTER_MOMENTUM * state["buf"] + delta if "buf" in state else delta.clone()
    return start - OUTER_LR * (delta + OUTER_MOMENTUM * state["buf"])


def _listening(address: str) -> bool:
    host, port = address.removeprefix("http://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except OSError:
        return False


@pytest.mark.timeout(120)
def test_torchft_diloco_matches_distrains_outer_step(tmp_path: Path) -> None:
    # The workers start while the lighthouse does, as under the launcher: their Managers wait.
    house = Lighthouse(WORKERS, tmp_path / "lighthouse.log", start_timeout=None)
    with house as address:
        results = run_group(_body, world=WORKERS, args=(address,), timeout=90)
        proc = house.proc
        assert proc is not None and proc.poll() is None and _listening(address)
    assert proc.returncode is not None and not _listening(address)  # stopped and reaped

    shared, local0 = reference()
    sizes = [p.numel() * p.element_size() for p in model().parameters()]
    for result in results:
        # Every replica evaluates the shared parameters of the last sync; the TAIL step is not in them.
        torch.testing.assert_close(result["eval"], shared, rtol=1e-5, atol=1e-6)
        assert int(result["rounds"]) == ROUNDS
        # One ring all-reduce per parameter tensor per round (torchft's default), counted by the
        # metered process group: 2(n-1)/n of each tensor's bytes.
        assert int(result["sent"]) == ROUNDS * sum(ring_share(n, WORKERS) for n in sizes)
    # After the last sync each worker goes on from the shared parameters with its own data.
    torch.testing.assert_close(results[0]["local"], local0, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(results[0]["local"], results[1]["local"])


class FailingDiLoCo(TorchftDiLoCo):
    """torchft-diloco whose worker 1 fails after its first sync (module level: the workers import it)."""

    def after_step(self, model: torch.nn.Module) -> None:
        super().after_step(model)
        if dist.get_rank() == 1 and self.steps == H + 1:
            raise RuntimeError("worker 1 fails on purpose")


def _children() -> list[int]:
    """Live processes whose parent is this one (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
def test_a_failed_worker_stops_the_run_and_the_lighthouse(tmp_path: Path) -> None:
    before = _children()
    cfg = small_config(str(tmp_path / "run"), workers=2, sync_every=H, timeout=10)
    with pytest.raises(WorkerFailure, match="worker 1 exited with status 1"):
        launch_peer(cfg, FailingDiLoCo(None))
    assert (tmp_path / "run" / "logs" / "lighthouse.log").exists()
    assert _children() == before  # the lighthouse and both workers were stopped and reaped
