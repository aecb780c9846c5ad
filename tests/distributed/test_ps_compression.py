"""Compressed pushes to sharded parameter servers, over real gloo processes.

Workers and servers are the real ``ParameterServer`` and ``ShardServer``; every worker pushes a
different ratio at every step (as adaptive compression does), after a dense warm-up. The test
replays the same steps in one process (each worker's gradient, compressed with its own error
feedback and momentum correction, decoded and averaged per shard, one SGD step) and compares the
parameters and the bytes each worker sent to each server.
"""

from __future__ import annotations

import statistics

import pytest
import torch
import torch.nn.functional as F

from distrain.algorithms.base import StepContext
from distrain.algorithms.parameter_server import ParameterServer, ShardServer, shard_bounds
from distrain.assemble import ps_settings, server_settings
from distrain.comm import Transport
from distrain.compress import CompressInfo, MomentumCorrection, build_compressor
from distrain.compress.pushes import PushDecoder, ShardPush
from distrain.launch import launch_local
from distrain.models import build_model
from distrain.optim.schedule import scaled_lr
from distrain.train.metrics import read_metrics
from tests.conftest import small_config
from tests.distributed.test_allreduce import reference_parameters
from tests.distributed.test_parameter_server import final_models
from tests.harness import run_group

WORKERS, SERVERS, STEPS, STEPS_PER_EPOCH, BATCH = 3, 2, 7, 2, 16
SPEC = "group_topk:0.05:group=16"
RATIOS = [0.05, 0.2, 0.01, 0.5, 1.0]
INPUT, CLASSES = (10,), 3


class VaryingRatio(ParameterServer):
    """Pushes a ratio that depends on the worker and the step."""

    def compress_ratio(self, ctx: StepContext) -> float | None:
        return ratio_of(self.transport.rank, ctx.step)


def ratio_of(worker: int, step: int) -> float:
    return RATIOS[(worker + step) % len(RATIOS)]


def config(run_dir: str):
    # one epoch of dense pushes (2 steps), then compressed ones
    return small_config(run_dir, algorithm="ps", servers=SERVERS, workers=WORKERS, compress=SPEC,
                        batch_size=BATCH, density_warmup_epochs=1.0)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model("mlp", INPUT, CLASSES, width=24, depth=2)


def batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + worker)
    return torch.randn(BATCH, *INPUT, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def optimizer(cfg, params) -> torch.optim.Optimizer:
    """The workers' optimizer (the servers step its kind at the rate each push carries)."""
    lr = scaled_lr(cfg.optim.lr, WORKERS * BATCH, cfg.optim.reference_batch)
    return torch.optim.SGD(params, lr=lr, momentum=cfg.optim.momentum, weight_decay=cfg.optim.weight_decay)


def _body(rank: int, world: int, run_dir: str) -> dict:
    cfg = config(run_dir)
    transport = Transport()
    if rank >= WORKERS:
        ShardServer(server_settings(cfg), transport, run_dir, optimizer(cfg, [torch.zeros(1, requires_grad=True)])).run()
        return {}
    net = model()
    algorithm = VaryingRatio(ps_settings(cfg))
    algorithm.setup(net, optimizer(cfg, net.parameters()), transport)
    algorithm.start(STEPS, STEPS_PER_EPOCH)
    for step in range(STEPS):
        net.zero_grad()
        x, y = batch(rank, step)
        F.cross_entropy(net(x), y).backward()
        algorithm.after_backward(StepContext(step=step, epoch=(step + 1) / STEPS_PER_EPOCH, batch_size=BATCH))
    algorithm.end()
    return {"model": net.state_dict(), "sent": torch.tensor(transport.stats.sent)}


def reference(cfg) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """Parameters after STEPS steps, and the bytes each worker sends each server."""
    net = model()
    params = [p for p in net.parameters()]
    numel = sum(p.numel() for p in params)
    bounds = shard_bounds(numel, SERVERS)
    inner = build_compressor(SPEC, error_feedback=False)
    pushes = [ShardPush(MomentumCorrection(build_compressor(SPEC, error_feedback=False), cfg.optim.momentum))
              for _ in range(WORKERS)]
    decoders = [PushDecoder(inner, hi - lo) for lo, hi in bounds]
    lr = scaled_lr(cfg.optim.lr, WORKERS * BATCH, cfg.optim.reference_batch)
    sent = [[0] * SERVERS for _ in range(WORKERS)]
    for step in range(STEPS):
        grads = []
        for w in range(WORKERS):
            net.zero_grad()
            x, y = batch(w, step)
            F.cross_entropy(net(x), y).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in params]))
        update = torch.empty(numel)
        for s, (lo, hi) in enumerate(bounds):
            decoded = []
            for w in range(WORKERS):
                info = CompressInfo(step=step, key=s, ratio=ratio_of(w, step), worker=w)
                message = pushes[w].encode(grads[w][lo:hi], info, dense=step < STEPS_PER_EPOCH)
                sent[w][s] += 16 + message.nbytes  # the int64 clock and learning rate, then the push
                decoded.append(decoders[s].decode(message))
            update[lo:hi] = torch.stack(decoded).sum(0).div_(WORKERS)
        with torch.no_grad():
            offset = 0
            for p in params:
                p.add_(update[offset : offset + p.numel()].view_as(p), alpha=-lr)
                offset += p.numel()
    return net.state_dict(), sent


@pytest.mark.timeout(180)
def test_compressed_pushes_with_a_ratio_per_worker_and_step_match_a_replay(tmp_path):
    results = run_group(_body, WORKERS + SERVERS, args=(str(tmp_path),), timeout=120)
    want, sent = reference(config(str(tmp_path)))
    for w in range(WORKERS):
        for name, tensor in want.items():
            torch.testing.assert_close(results[w]["model"][name], tensor, rtol=1e-5, atol=1e-6, msg=f"worker {w} {name}")
        for s, (lo, hi) in enumerate(shard_bounds(sum(t.numel() for t in want.values()), SERVERS)):
            got = int(results[w]["sent"][WORKERS + s])
            got -= 16  # the end of training: [STOP, 0]
            if w == 0:  # worker 0 also sent each server the start header (3 int64), its shard and
                got -= 3 * 8 + 4 * (hi - lo) + 8  # whether a saved optimizer state follows (1 int64; none)
            assert got == sent[w][s], (w, s)


@pytest.mark.slow  # make test-all: compressed pushes are checked exactly in CI by the replay test above
@pytest.mark.timeout(240)
def test_ps_with_group_topk_at_ratio_one_equals_dense_sgd(tmp_path):
    # ratio 1 keeps everything: with momentum correction the workers' velocities average to the
    # momentum buffer of momentum SGD, so the run equals one process on the concatenated batches.
    cfg = small_config(str(tmp_path / "run"), algorithm="ps", servers=2, workers=2, compress="group_topk:1.0:group=64")
    summary = launch_local(cfg)
    expected = reference_parameters(cfg, 2, summary["steps"])
    for rank, got in enumerate(final_models(tmp_path / "run", 2, 2, summary["steps"])):
        for name, tensor in expected.items():
            torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
    assert read_metrics(tmp_path / "run")[-1]["compress_ratio"] == 1.0


# `make test-all`: CI checks compressed pushes exactly (the replay and ratio one above) and the
# asynchronous mode exactly (test_parameter_server.py); this runs both modes end to end.
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode,spec", [("sync", "topk:0.05"), ("async", "fp16")])
def test_compressed_ps_trains_and_pushes_fewer_bytes(tmp_path, mode, spec):
    settings = {"algorithm": "ps", "servers": 2, "workers": 2, "epochs": 2, "ps_mode": mode}
    dense = launch_local(small_config(str(tmp_path / "dense"), **settings))
    # compressed from the first step (a sparsifier's default warm-up would send its first epochs dense)
    compressed = launch_local(small_config(str(tmp_path / "comp"), compress=spec, density_warmup_epochs=0,
                                           density_decay_epochs=0, **settings))
    losses = [r["loss"] for r in read_metrics(tmp_path / "comp", 0)]
    assert statistics.mean(losses[-10:]) < 0.9 * statistics.mean(losses[:5])
    # pushes shrink, pulls stay dense: the workers send less than half of the dense run's bytes
    for got, full in zip(compressed["bytes_sent_per_worker"], dense["bytes_sent_per_worker"], strict=True):
        assert got < 0.55 * full, (got, full)
