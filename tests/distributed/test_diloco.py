"""DiLoCo: H local steps, then an outer optimizer step on the averaged pseudo-gradient, against
references computed here (real gloo processes)."""

from __future__ import annotations

import itertools
import json
import statistics
from typing import Any

import pytest
import torch

from distrain.algorithms import StepContext
from distrain.assemble import build_algorithm
from distrain.comm.transport import Transport
from distrain.config import TrainConfig
from tests.harness import run_group

WORKERS, H, PERIODS, INNER_LR = 2, 2, 3, 0.1
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1)  # 4 parameters


def batch(worker: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * worker + step)
    return torch.randn(5, 3, generator=g), torch.randn(5, 1, generator=g)


def loss_of(net: torch.nn.Module, worker: int, step: int) -> torch.Tensor:
    x, y = batch(worker, step)
    return ((net(x) - y) ** 2).mean()


def config(optimizer: str, momentum: float, compress: str = "none") -> TrainConfig:
    return TrainConfig.from_dict({"algorithm": "diloco", "workers": WORKERS, "sync_every": H, "compress": compress,
                                  "outer_optimizer": optimizer, "outer_lr": OUTER_LR, "outer_momentum": momentum})


def _body(rank: int, world: int, optimizer: str, momentum: float, compress: str = "none") -> dict:
    net = model()
    inner = torch.optim.SGD(net.parameters(), lr=INNER_LR)
    algorithm = build_algorithm("diloco", config(optimizer, momentum, compress))
    transport = Transport()
    algorithm.setup(net, inner, transport)
    algorithm.start(H * PERIODS, H)
    for step in range(H * PERIODS):
        inner.zero_grad()
        loss_of(net, rank, step).backward()
        ctx = StepContext(step=step, epoch=(step + 1) / H, batch_size=5)
        algorithm.after_backward(ctx)
        algorithm.apply_update(ctx)
        algorithm.after_update(ctx)
    return {"params": torch.cat([p.detach().reshape(-1) for p in net.parameters()]),
            "eval": torch.cat([p.detach().reshape(-1) for p in algorithm.eval_model().parameters()]),
            "sent": sum(transport.stats.sent), "outer_steps": algorithm.outer_steps}


def reference(optimizer: str, momentum: float, quantize: Any = None, decay: float = 1.0) -> torch.Tensor:
    """The outer optimizer written out by hand: per period each worker takes H SGD steps from the
    shared parameters; the mean of (shared - local) is the outer gradient. ``quantize``: what a
    worker's pseudo-gradient becomes on the wire (with error feedback: the residual it left,
    times ``decay``, is added to the next one)."""
    shared = torch.cat([p.detach().reshape(-1) for p in model().parameters()])
    buffer = None
    residual = [torch.zeros(4) for _ in range(WORKERS)]
    for period in range(PERIODS):
        deltas = []
        for w in range(WORKERS):
            net = model()
            with torch.no_grad():
                net.weight.copy_(shared[:3].view(1, 3))
                net.bias.copy_(shared[3:])
            for step in range(period * H, (period + 1) * H):
                net.zero_grad()
                loss_of(net, w, step).backward()
                with torch.no_grad():
                    for p in net.parameters():
                        p -= INNER_LR * p.grad
            delta = shared - torch.cat([p.detach().reshape(-1) for p in net.parameters()])
            if quantize is not None:
                meant = delta + decay * residual[w]
                delta = quantize(meant)
                residual[w] = meant - delta
            deltas.append(delta)
        g = sum(deltas) / WORKERS
        buffer = g.clone() if buffer is None else momentum * buffer + g
        update = g + momentum * buffer if optimizer == "nesterov" else buffer
        shared = shared - OUTER_LR * update
    return shared


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer, momentum", [("nesterov", OUTER_MOMENTUM), ("sgd", 0.5)])
def test_outer_step_matches_the_hand_computed_reference(optimizer: str, momentum: float):
    results = run_group(_body, WORKERS, args=(optimizer, momentum), timeout=90)
    want = reference(optimizer, momentum)
    for r in results:
        torch.testing.assert_close(r["params"], want, rtol=0, atol=1e-6)  # every worker starts from the shared
        torch.testing.assert_close(r["eval"], want, rtol=0, atol=1e-6)
        assert r["outer_steps"] == PERIODS
        # one all-reduce of the 4 float32 parameters per period: 2 (n - 1) / n of 16 bytes, PERIODS times
        assert r["sent"] == PERIODS * 16 * 2 * (WORKERS - 1) // WORKERS


def int8_by_hand(x: torch.Tensor) -> torch.Tensor:
    """One block of 64 (the 4 values, zero-padded): scale max|x| / 127, codes rounded."""
    scale = x.abs().max() / 127
    return torch.round(x / scale).clamp(-127, 127) * scale


@pytest.mark.timeout(120)
def test_int8_pseudo_gradients_with_error_feedback_match_the_reference():
    results = run_group(_body, WORKERS, args=("nesterov", OUTER_MOMENTUM, "int8"), timeout=90)
    want = reference("nesterov", OUTER_MOMENTUM, int8_by_hand)
    dense = reference("nesterov", OUTER_MOMENTUM)
    for r in results:
        torch.testing.assert_close(r["params"], want, rtol=0, atol=1e-6)
        # gathered: each worker sends its payload (64 int8 codes + one float32 scale) once per period
        assert r["sent"] == PERIODS * (64 + 4) * (WORKERS - 1)
    assert not torch.allclose(want, dense, rtol=0, atol=1e-7)  # the quantization did change something


def sparseloco_by_hand(x: torch.Tensor) -> torch.Tensor:
    """Chunks of 3 at ratio 0.67: the first (3 values) keeps its 2 largest magnitudes, the second
    (1 value) its one; 2 bits each: the sign, and which half of the chunk's kept range [lo, hi]
    the magnitude falls in, decoded at that half's centre."""
    out = torch.zeros_like(x)
    for start, stop, k in ((0, 3, 2), (3, 4, 1)):
        part = x[start:stop]
        keep = part.abs().topk(k).indices
        magnitude = part[keep].abs()
        lo, hi = magnitude.min(), magnitude.max()
        half = (hi - lo) / 2
        upper = (magnitude - lo >= half) & (half > 0)
        out[start + keep] = torch.sign(part[keep]) * (lo + torch.where(upper, 1.5, 0.5) * half)
    return out


@pytest.mark.timeout(120)
def test_sparseloco_pseudo_gradients_with_decaying_error_feedback_match_the_reference():
    # SparseLoCo's arrangement: the decaying residual in place of outer momentum, a plain outer step
    results = run_group(_body, WORKERS, args=("sgd", 0.0, "sparseloco:0.67:chunk=3:decay=0.5"), timeout=90)
    want = reference("sgd", 0.0, sparseloco_by_hand, decay=0.5)
    for r in results:
        torch.testing.assert_close(r["params"], want, rtol=0, atol=1e-6)
        torch.testing.assert_close(r["eval"], want, rtol=0, atol=1e-6)
        # gathered once per period: 3 entries of 2 index bits + 2 code bits (2 bytes), 2 chunks' (lo, hi)
        assert r["sent"] == PERIODS * (2 + 2 * 8) * (WORKERS - 1)
    assert not torch.allclose(want, reference("sgd", 0.0, top2_by_hand, decay=0.5), rtol=0, atol=1e-6)  # quantized
    assert not torch.allclose(want, reference("sgd", 0.0, sparseloco_by_hand), rtol=0, atol=1e-6)  # decayed


def top2_by_hand(x: torch.Tensor) -> torch.Tensor:
    """Group top-k at ratio 0.5 of the 4 values: the 2 largest magnitudes."""
    out = torch.zeros_like(x)
    keep = x.abs().topk(2).indices
    out[keep] = x[keep]
    return out


@pytest.mark.timeout(120)
def test_adaptive_spends_h_steps_of_its_ratio_on_each_round():
    # base 0.25 per step, H = 2 steps a round: each round keeps half of the pseudo-gradient (no
    # link model on loopback: the sizes cost nothing measurable, so the policy keeps its base)
    results = run_group(_body, WORKERS, args=("nesterov", OUTER_MOMENTUM, "adaptive:base=0.25:min=0.05:max=0.5"), timeout=90)
    want = reference("nesterov", OUTER_MOMENTUM, top2_by_hand)
    for r in results:
        torch.testing.assert_close(r["params"], want, rtol=0, atol=1e-6)
        assert r["outer_steps"] == PERIODS
    assert not torch.allclose(want, reference("nesterov", OUTER_MOMENTUM), rtol=0, atol=1e-7)  # it did sparsify


def test_settings_are_checked():
    from distrain.errors import ConfigError

    for settings, flag in [({"sync_every": 0}, "--sync-every"), ({"outer_lr": 0}, "--outer-lr"),
                           ({"outer_momentum": 1.0}, "--outer-momentum"), ({"outer_optimizer": "adam"}, "--outer-optimizer")]:
        with pytest.raises(ConfigError, match=flag):
            TrainConfig.from_dict({"algorithm": "diloco", **settings}).validate()


@pytest.mark.timeout(180)
def test_distrain_train_diloco_syncs_every_h_steps(tmp_path):
    from distrain.launch import launch_local
    from distrain.models import build_model, count_parameters
    from distrain.train.metrics import read_metrics
    from tests.conftest import small_config

    cfg = small_config(str(tmp_path / "run"), workers=2, algorithm="diloco", sync_every=4, epochs=2)
    summary = launch_local(cfg)
    steps = summary["steps"]
    lines = [m for m in read_metrics(tmp_path / "run", 0) if "step" in m]
    assert [m["outer_steps"] for m in lines] == [(s + 1) // 4 if s + 1 < steps else -(-steps // 4) for s in range(steps)]
    params = count_parameters(build_model("mlp", (32,), 10, width=32, depth=2))
    per_sync = params * 4 * 2 * (2 - 1) // 2  # one all-reduce of the float32 parameters, 2 workers
    assert summary["bytes_sent_per_worker"][0] == -(-steps // 4) * per_sync
    assert summary["final_test_accuracy"] > 0.5


def test_fragments_cover_the_model_once_and_each_syncs_once_per_period():
    from distrain.algorithms.diloco import fragment_bounds

    sizes = [100, 3, 40, 40, 7, 60, 1, 50]
    for fragments in (1, 2, 3, 4, 8):
        bounds = fragment_bounds(sizes, fragments)
        assert bounds[0][0] == 0 and bounds[-1][1] == sum(sizes) and len(bounds) <= fragments
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))  # consecutive: no gap, no overlap
        edges = {0}
        for s in sizes:
            edges.add(max(edges) + s)
        assert {lo for lo, _ in bounds} <= edges  # cut between tensors only
    assert len(fragment_bounds(sizes, 4)) == 4
    cfg = TrainConfig.from_dict({"algorithm": "diloco", "workers": 1, "sync_every": 8, "fragments": 4})
    algorithm = build_algorithm("diloco", cfg)
    net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    algorithm.setup(net, torch.optim.SGD(net.parameters(), lr=0.0), None)  # the schedule needs no network
    syncs = {i: [] for i in range(len(algorithm.bounds))}
    for step in range(1, 3 * 8 + 1):
        for i, offset in enumerate(algorithm.offsets):
            if step % 8 == offset:
                syncs[i].append(step)
    assert len(algorithm.bounds) == 4 and all(len(s) == 3 for s in syncs.values())
    assert sorted(algorithm.offsets) == [0, 2, 4, 6]  # staggered through the period


def _streaming_body(rank: int, world: int, merge: dict) -> dict:
    net = model()
    inner = torch.optim.SGD(net.parameters(), lr=INNER_LR)
    cfg = TrainConfig.from_dict({"algorithm": "diloco", "workers": WORKERS, "sync_every": 4, "fragments": 2,
                                 "overlap_steps": 1, "outer_lr": OUTER_LR, "outer_momentum": OUTER_MOMENTUM, **merge})
    algorithm = build_algorithm("diloco", cfg)
    algorithm.setup(net, inner, Transport())
    steps = 10  # ends mid-period: the last step syncs what moved and applies what is pending
    algorithm.start(steps, 4)
    for step in range(steps):
        inner.zero_grad()
        loss_of(net, rank, step).backward()
        ctx = StepContext(step=step, epoch=(step + 1) / 4, batch_size=5)
        algorithm.after_backward(ctx)
        algorithm.apply_update(ctx)
        algorithm.after_update(ctx)
    return {"params": torch.cat([p.detach().reshape(-1) for p in net.parameters()]),
            "shared": algorithm.shared.clone(), "bounds": algorithm.bounds}


def streaming_reference(steps: int = 10, h: int = 4, overlap: int = 1, w: float = 0.5) -> tuple[torch.Tensor, list]:
    """Two fragments (the weight, then the bias): fragment 0 syncs at steps = 2 mod 4, fragment 1
    at 0 mod 4; an exchange is applied ``overlap`` steps later and merged with weight ``w`` on the
    synced fragment (1: the workers take it)."""
    frags = [(0, 3), (3, 4)]
    offsets = [2, 0]
    start = torch.cat([p.detach().reshape(-1) for p in model().parameters()])
    shared, local = start.clone(), [start.clone() for _ in range(WORKERS)]
    buffer, has = torch.zeros(4), [False, False]
    synced, pending = [0, 0], []

    def grad_at(params: torch.Tensor, worker: int, step: int) -> torch.Tensor:
        net = model()
        with torch.no_grad():
            net.weight.copy_(params[:3].view(1, 3))
            net.bias.copy_(params[3:])
        loss_of(net, worker, step).backward()
        return torch.cat([net.weight.grad.reshape(-1), net.bias.grad.reshape(-1)])

    def apply(fragment: int, delta: torch.Tensor) -> None:
        lo, hi = frags[fragment]
        if has[fragment]:
            buffer[lo:hi] = OUTER_MOMENTUM * buffer[lo:hi] + delta
        else:
            buffer[lo:hi], has[fragment] = delta, True
        shared[lo:hi] -= OUTER_LR * (delta + OUTER_MOMENTUM * buffer[lo:hi])
        for wk in range(WORKERS):
            local[wk][lo:hi] = w * shared[lo:hi] + (1 - w) * local[wk][lo:hi]

    for step in range(steps):
        for wk in range(WORKERS):
            local[wk] = local[wk] - INNER_LR * grad_at(local[wk], wk, step)
        t = step + 1
        for i, (lo, hi) in enumerate(frags):
            if t % h == offsets[i] or (t == steps and t > synced[i]):
                pending.append((t + overlap, i, sum(shared[lo:hi] - local[wk][lo:hi] for wk in range(WORKERS)) / WORKERS))
                synced[i] = t
        while pending and (pending[0][0] <= t or t == steps):
            _, i, delta = pending.pop(0)
            apply(i, delta)
    return shared, local


@pytest.mark.timeout(120)
@pytest.mark.parametrize("merge, w", [({"merge_weight": 0.5}, 0.5), ({}, 1.0)], ids=["half", "default"])
def test_streaming_fragments_with_overlap_match_the_reference(merge: dict, w: float):
    results = run_group(_streaming_body, WORKERS, args=(merge,), timeout=90)
    shared, local = streaming_reference(w=w)
    assert not torch.allclose(streaming_reference(w=1.5 - w)[1][0], local[0])  # the weight matters here
    for rank, r in enumerate(results):
        assert r["bounds"] == [(0, 3), (3, 4)]
        torch.testing.assert_close(r["shared"], shared, rtol=0, atol=1e-6)
        torch.testing.assert_close(r["params"], local[rank], rtol=0, atol=1e-6)


def test_auto_proposes_the_h_at_which_syncing_costs_the_overhead():
    from distrain.algorithms.diloco import propose_sync_every

    assert propose_sync_every(0.5, 0.01, 0.1, 4, 512, current=8) == 500  # 0.5 s = 10% of 500 steps of 10 ms
    assert propose_sync_every(0.5, 0.01, 0.1, 4, 64, current=8) == 64  # bounded above
    assert propose_sync_every(1e-4, 0.01, 0.1, 4, 64, current=8) == 4  # and below
    assert propose_sync_every(None, 0.01, 0.1, 4, 64, current=8) == 8  # nothing measured yet: keep H
    assert propose_sync_every(0.5, 0.0, 0.1, 4, 64, current=8) == 8


def test_auto_settings_are_checked():
    from distrain.cli import build_parser, config_from_args
    from distrain.errors import ConfigError

    cfg = config_from_args(build_parser().parse_args(["train", "--algorithm", "diloco", "--sync-every", "auto"]))
    assert cfg.outer.sync_every == "auto" and (cfg.outer.sync_every_min, cfg.outer.sync_every_max) == (4, 512)
    assert TrainConfig.from_dict({"algorithm": "diloco", "sync_every": 16}).validate().outer.sync_every == 16
    for settings, flag in [({"sync_every": "Auto"}, "--sync-every"), ({"sync_every": "auto", "fragments": 2}, "--sync-every"),
                           ({"sync_every": "auto", "overlap_steps": 4}, "--overlap-steps"),
                           ({"sync_every_min": 8, "sync_every_max": 4}, "--sync-every-max"),
                           ({"comm_overhead": 0}, "--comm-overhead")]:
        with pytest.raises(ConfigError, match=flag):
            TrainConfig.from_dict({"algorithm": "diloco", **settings}).validate()


def _admission_body(rank: int, world: int) -> dict:
    net = model()
    inner = torch.optim.SGD(net.parameters(), lr=INNER_LR)
    cfg = TrainConfig.from_dict({"algorithm": "diloco", "workers": WORKERS, "sync_every": "auto",
                                 "sync_every_min": 2, "sync_every_max": 8, "outer_optimizer": "sgd", "outer_lr": 1.0,
                                 "outer_momentum": 0.0})
    algorithm = build_algorithm("diloco", cfg)
    algorithm.setup(net, inner, Transport())
    algorithm.start(100, 100)
    for step in range(3):  # the first round (H = 2) ends at step 2; step 3 is in the next one
        inner.zero_grad()
        loss_of(net, rank, step).backward()
        ctx = StepContext(step=step, epoch=0.0, batch_size=5)
        algorithm.after_backward(ctx)
        algorithm.apply_update(ctx)
        algorithm.after_update(ctx)
    mid = (algorithm.synced_at[0], algorithm.next_sync, algorithm.admission_step(3))
    local = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    algorithm.before_admission()
    return {"mid": mid, "local": local, "synced_at": algorithm.synced_at[0], "next_sync": algorithm.next_sync,
            "sync_every": algorithm.sync_every, "kept": algorithm.kept_steps(3),
            "params": torch.cat([p.detach().reshape(-1) for p in net.parameters()]),
            "shared": algorithm.shared.clone()}


def test_auto_members_end_the_round_where_workers_join_when_it_is_not_a_rounds_end():
    """--sync-every auto: should the agreed admission step fall inside a round (H changed after
    the agreement), the members sync there before the joiners enter: both hold the average of
    their local models (plain averaging) and the next round runs from that step."""
    results = run_group(_admission_body, WORKERS)
    for r in results:
        synced, next_sync, admit = r["mid"]
        assert synced == 2 and next_sync > 3 and admit == next_sync  # inside the round; joins are planned at its end
        assert r["synced_at"] == 3 and r["next_sync"] == 3 + r["sync_every"] and r["kept"] == 2
        mean = torch.stack([q["local"] for q in results]).mean(0)
        torch.testing.assert_close(r["shared"], mean)
        torch.testing.assert_close(r["params"], mean)
    assert not torch.allclose(results[0]["local"], results[1]["local"])  # the round had moved them apart


@pytest.mark.timeout(180)
def test_auto_raises_h_on_a_slow_link_and_every_worker_follows_the_same_periods(tmp_path):
    from distrain.algorithms.diloco import propose_sync_every
    from distrain.launch import launch_local
    from distrain.train.metrics import read_metrics
    from tests.conftest import small_config

    low, high, overhead = 2, 64, 1.0
    auto = {"algorithm": "diloco", "sync_every": "auto", "sync_every_min": low, "sync_every_max": high,
            "comm_overhead": overhead, "workers": 2, "epochs": 5, "latency": "1ms"}
    syncs, finals = {}, {}
    for name, bandwidth in (("fast", "100mbit"), ("slow", "500kbit")):
        summary = launch_local(small_config(str(tmp_path / name), **auto, bandwidth=bandwidth))
        lines = {r: [m for m in read_metrics(tmp_path / name, r) if "step" in m] for r in range(2)}
        assert summary["steps"] == len(lines[0])
        # the workers agree on every period: the same H and the same outer steps at every step
        assert [(m["sync_every"], m["outer_steps"]) for m in lines[0]] == [(m["sync_every"], m["outer_steps"]) for m in lines[1]]
        assert lines[0][0]["sync_every"] == low and all(low <= m["sync_every"] <= high for m in lines[0])
        # once a sync's exchange is done, each worker proposes from that exchange's time and the
        # compute of the period it ended (the first sync included), the next period is the mean
        # of the proposals, and it runs from that sync
        at_sync = [i for i, m in enumerate(lines[0]) if m["outer_steps"] > (lines[0][i - 1]["outer_steps"] if i else 0)]
        at_sync = [i for i in at_sync if i < len(lines[0]) - 1]  # the last step's flush chooses nothing
        assert len(at_sync) >= 3 and lines[0][at_sync[0]]["step"] == low
        for now, following in itertools.pairwise(at_sync):
            proposals = [propose_sync_every(lines[r][now]["sync_seconds"], lines[r][now]["step_seconds"], overhead, low,
                                            high, current=lines[r][now - 1]["sync_every"] if now else low)
                         for r in range(2)]
            assert [lines[r][now]["sync_every_proposed"] for r in range(2)] == proposals
            assert lines[0][now]["sync_every"] == min(high, max(low, round(sum(proposals) / 2)))
            assert lines[0][following]["step"] - lines[0][now]["step"] == lines[0][now]["sync_every"]
        syncs[name] = statistics.median(m["sync_seconds"] for m in lines[0] if "sync_seconds" in m)
        finals[name] = lines[0][-1]["sync_every"]
        params = json.loads((tmp_path / name / "config.json").read_text())["model_parameters"]
    # the link model times each exchange: a ring all-reduce of 2 workers is 2 rounds, each half the
    # float32 parameters over the link plus one latency; H follows, to the largest allowed when slow
    for name, rate in (("fast", 100e6 / 8), ("slow", 500e3 / 8)):
        assert syncs[name] == pytest.approx(2 * (params * 4 / 2 / rate + 0.001), rel=0.05), (name, syncs)
    assert finals["slow"] == high and finals["fast"] < finals["slow"], finals


@pytest.mark.slow  # ~6 s; the reference test above runs SparseLoCo through DiLoCo in CI
@pytest.mark.timeout(240)
def test_distrain_train_diloco_with_sparseloco_sends_the_packed_size_and_ends_in_consensus(tmp_path):
    from distrain.compress import build_compressor
    from distrain.launch import launch_local
    from distrain.models import build_model, count_parameters
    from distrain.runtime.checkpoint import CheckpointStore
    from tests.conftest import small_config

    world, spec = 3, "sparseloco:0.02:chunk=256:decay=0.9"
    cfg = small_config(str(tmp_path / "run"), workers=world, algorithm="diloco", sync_every=4, epochs=2, compress=spec,
                       outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0)
    summary = launch_local(cfg)
    steps = summary["steps"]
    params = count_parameters(build_model("mlp", (32,), 10, width=32, depth=2))
    payload = build_compressor(spec).wire_bytes(params)
    assert payload < 0.02 * params * 4  # under 2% of the float32 bytes, ranges and indices included
    per_sync = payload * (world - 1)  # the packed payload, gathered
    assert summary["bytes_sent_per_worker"] == [-(-steps // 4) * per_sync] * world
    finals = [CheckpointStore(tmp_path / "run", r, world).load(steps)["model"] for r in range(world)]
    for other in finals[1:]:
        for name, tensor in finals[0].items():
            assert torch.equal(other[name], tensor), name
    # 10 syncs of 2% of the pseudo-gradient learn little (0.35 here, 0.74 dense), but well above chance (0.1)
    assert summary["final_test_accuracy"] > 0.2, summary["final_test_accuracy"]
