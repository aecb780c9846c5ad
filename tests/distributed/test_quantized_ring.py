"""int8/int4 sums over a ring whose every message is quantized (requantizing_ring), on real gloo
processes, against the ring written out by hand here: the same result on every worker, the bytes
of 2(n-1)/n of the quantized tensor, error feedback for each worker's own quantization."""

from __future__ import annotations

import math

import pytest
import torch

from distrain.comm.transport import Transport
from distrain.compress import CompressInfo, allreduce_compressed, build_compressor
from tests.harness import run_group

WORKERS, NUMEL, BLOCK = 4, 1000, 64  # 16 blocks, the last one partly padding


def values(rank: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank)) * (rank + 1)


def by_hand(x: torch.Tensor, levels: int) -> torch.Tensor:
    """Per-block absmax quantization of ``x``, decoded: blocks of BLOCK from x's first element."""
    blocks = math.ceil(x.numel() / BLOCK)
    rows = torch.cat([x, torch.zeros(blocks * BLOCK - x.numel())]).view(blocks, BLOCK)
    scale = rows.abs().amax(1, keepdim=True) / levels
    codes = torch.where(scale > 0, torch.round(rows / torch.where(scale > 0, scale, 1)), 0).clamp(-levels, levels)
    return (codes * scale).reshape(-1)[: x.numel()]


def _sum(rank: int, world: int, spec: str) -> dict:
    transport = Transport()
    compressor = build_compressor(spec, error_feedback=True)
    total = allreduce_compressed(transport, compressor, values(rank), CompressInfo(key=7))
    return {"total": total, "sent": sum(transport.stats.sent), "residual": compressor.residuals[7]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("spec", "levels", "code_bytes"), [("int8", 127, 1.0), ("int4", 7, 0.5)])
def test_a_requantizing_ring_sums_like_the_ring_written_out_by_hand(spec: str, levels: int, code_bytes: float):
    results = run_group(_sum, WORKERS, args=(spec,), timeout=90)
    # by hand: chunk c (whole blocks) starts at worker c and gathers each next worker's quantized
    # values, its partial sum quantized again before every hop; its owner quantizes the sum once
    mine = [by_hand(values(r), levels) for r in range(WORKERS)]
    blocks = math.ceil(NUMEL / BLOCK)
    edges = [min(NUMEL, blocks * i // WORKERS * BLOCK) for i in range(WORKERS + 1)]
    want = torch.empty(NUMEL)
    for c in range(WORKERS):
        lo, hi = edges[c], edges[c + 1]
        partial = mine[c][lo:hi].clone()
        for j in range(1, WORKERS):
            partial = by_hand(partial, levels) + mine[(c + j) % WORKERS][lo:hi]
        want[lo:hi] = by_hand(partial, levels)
    exact = sum(values(r) for r in range(WORKERS))
    for r, got in enumerate(results):
        torch.testing.assert_close(got["total"], results[0]["total"], rtol=0, atol=0)  # every worker alike
        torch.testing.assert_close(got["total"], want, rtol=0, atol=1e-5)
        torch.testing.assert_close(got["residual"], values(r) - mine[r], rtol=0, atol=1e-6)  # its own quantization
    assert (results[0]["total"] - exact).abs().max() < (0.02 if levels == 127 else 0.4) * exact.abs().max()
    # each worker sends 2 (n - 1) chunks: codes and one float32 scale per block of each
    size = [math.ceil((edges[c + 1] - edges[c]) / BLOCK) * (BLOCK * code_bytes + 4) for c in range(WORKERS)]
    for r, got in enumerate(results):
        hops = [(r - k) % WORKERS for k in range(WORKERS - 1)] + [(r + 1 - k) % WORKERS for k in range(WORKERS - 1)]
        assert got["sent"] == sum(size[c] for c in hops)
        assert got["sent"] < (0.28 if levels == 127 else 0.16) * 2 * (WORKERS - 1) / WORKERS * 4 * NUMEL
