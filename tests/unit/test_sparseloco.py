"""SparseLoCo: chunked top-k against a reference computed here, the quantization bound, the packed
wire size, and error feedback with and without a decaying residual."""

from __future__ import annotations

import math

import pytest
import torch

from distrain.compress import CompressInfo, ErrorFeedback, build_compressor, payload_nbytes
from distrain.compress.sparseloco import SparseLoCo, pack_bits, unpack_bits


def randn(numel: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()


def reference_chunks(x: torch.Tensor, ratio: float, chunk: int) -> list[tuple[int, torch.Tensor]]:
    """(first element, kept flat indices) of every chunk: its round(ratio * size) (at least 1)
    largest magnitudes, found by sorting."""
    out = []
    for start in range(0, x.numel(), chunk):
        part = x[start : start + chunk]
        k = min(part.numel(), max(1, round(ratio * part.numel())))
        order = part.abs().argsort(descending=True)
        out.append((start, order[:k] + start))
    return out


@pytest.mark.parametrize("numel,ratio,bits,chunk", [
    (1000, 0.02, 2, 128), (4096 * 3 + 5, 0.01, 2, 4096), (777, 0.1, 1, 100), (300, 0.05, 3, 64),
    (2000, 0.03, 4, 256), (500, 0.5, 8, 50), (10, 1.0, 2, 4), (1, 0.01, 2, 4096), (70_000, 0.02, 2, 65_536),
])
def test_decoded_is_the_reference_top_k_of_each_chunk_within_the_quantization_bound(numel, ratio, bits, chunk):
    x = randn(numel, seed=numel)
    c = SparseLoCo(ratio, bits=bits, chunk=chunk)
    payload, ctx = c.compress(x, CompressInfo())
    y = c.decompress(payload, ctx)
    assert y.shape == x.shape and y.dtype == x.dtype
    levels = 2 ** (bits - 1)
    want_support = torch.zeros(numel, dtype=torch.bool)
    for _, keep in reference_chunks(x, ratio, chunk):
        want_support[keep] = True
        magnitudes = x[keep].abs()
        bound = float(magnitudes.max() - magnitudes.min()) / (2 * levels)
        error = (y[keep] - x[keep]).abs().max()
        assert float(error) <= bound * (1 + 1e-5) + 1e-7, (float(error), bound)
        assert torch.equal(torch.sign(y[keep]), torch.sign(x[keep]))
    assert torch.equal(y != 0, want_support)


def test_a_chunk_is_decoded_at_the_centres_of_its_bins():
    # 2 bits: bins [1, 2) and [2, 3] of the kept magnitudes 1 .. 3 decode to 1.5 and 2.5
    x = torch.tensor([3.0, -1.0, 0.1, 2.2, -0.2, -1.9, 0.0, 0.3])
    c = SparseLoCo(0.5, bits=2, chunk=8)
    y = c.decompress(*c.compress(x, CompressInfo()))
    assert y.tolist() == [2.5, -1.5, 0.0, 2.5, 0.0, -1.5, 0.0, 0.0]
    equal = torch.tensor([0.5, -0.5, 0.5, 0.01])  # equal kept magnitudes come back exactly
    assert SparseLoCo(0.75, chunk=4).decompress(*SparseLoCo(0.75, chunk=4).compress(equal, CompressInfo())).tolist() == [
        0.5, -0.5, 0.5, 0.0]


def packed_size(numel: int, ratio: float, bits: int, chunk: int) -> int:
    """Bytes written out by hand: per chunk k entries of (index bits + bits), one (lo, hi) pair."""
    sizes = [min(chunk, numel - start) for start in range(0, numel, chunk)]
    entries = sum(min(s, max(1, round(ratio * s))) for s in sizes)
    index_bits = math.ceil(math.log2(min(chunk, numel))) if numel > 1 else 0
    return math.ceil(entries * (index_bits + bits) / 8) + 8 * len(sizes)


@pytest.mark.parametrize("numel,ratio,bits,chunk", [
    (1_000_000, 0.02, 2, 4096), (2**20, 0.01, 2, 4096), (999, 0.1, 3, 100), (5, 0.5, 1, 4096), (4097, 0.03, 8, 4096),
    (300, 1.0, 2, 256),
])
def test_payload_is_exactly_the_packed_size(numel, ratio, bits, chunk):
    c = SparseLoCo(ratio, bits=bits, chunk=chunk)
    payload, _ = c.compress(randn(numel), CompressInfo())
    assert [t.dtype for t in payload] == [torch.uint8, torch.float32]  # both travel through gloo and NCCL
    want = packed_size(numel, ratio, bits, chunk)
    assert payload_nbytes(payload) == want == c.wire_bytes(numel, element_size=4)
    if (numel, ratio) == (1_000_000, 0.02):  # the figure the module docstring quotes
        assert want == 36_995
    payload, _ = c.compress(randn(numel), CompressInfo(ratio=0.5))  # a per-call ratio changes both alike
    assert payload_nbytes(payload) == packed_size(numel, 0.5, bits, chunk) == c.wire_bytes(numel, ratio=0.5)


@pytest.mark.parametrize("width", [1, 3, 8, 12, 14, 20, 32])
def test_bits_pack_and_unpack_exactly(width):
    values = torch.randint(0, 2**width, (1001,), generator=torch.Generator().manual_seed(width))
    packed = pack_bits(values, width)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(1001 * width / 8)
    assert torch.equal(unpack_bits(packed, width, 1001), values)
    with pytest.raises(ValueError, match="cannot hold"):
        unpack_bits(packed, width, 1001 + 8)


@pytest.mark.parametrize("decay", [1.0, 0.9])
def test_error_feedback_sends_what_was_meant(decay):
    """``sent + residual == meant`` every step, ``meant = delta + decay * residual``; with decay 1
    the sum of what was sent follows the sum of the inputs with a bounded lag."""
    ef = build_compressor(f"sparseloco:0.02:chunk=256:decay={decay:g}")
    assert isinstance(ef, ErrorFeedback) and ef.decay == decay
    residual = torch.zeros(2000, dtype=torch.float64)
    sent_sum = torch.zeros(2000, dtype=torch.float64)
    g = randn(2000, seed=3)
    for step in range(300):
        meant = g.double() + decay * residual
        payload, ctx = ef.compress(g, CompressInfo(step=step))
        sent = ef.decompress(payload, ctx).double()
        residual = ef.residuals[0].double()
        torch.testing.assert_close(sent + residual, meant, rtol=1e-6, atol=1e-6)  # float32 rounding
        sent_sum += sent
    if decay == 1.0:
        lag = float((sent_sum - 300 * g.double()).norm() / (300 * g.double().norm()))
        assert lag < 0.1, lag
    else:  # the decayed residual forgets: it stays below what a full one would reach
        assert float(residual.norm()) < float(g.norm()) / (1 - decay)


def test_residual_decay_reaches_error_feedback_and_the_spec():
    c = build_compressor("sparseloco:0.01:bits=3:chunk=1024:decay=0.95")
    assert c.inner.residual_decay == 0.95 and c.spec() == "sparseloco:0.01:bits=3:chunk=1024:decay=0.95"
    assert build_compressor("sparseloco:0.02").spec() == "sparseloco:0.02"
    assert isinstance(build_compressor("sparseloco:0.02", error_feedback=False), SparseLoCo)
