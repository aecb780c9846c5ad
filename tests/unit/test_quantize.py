"""int8 / int4 block quantization: error bounds, payload sizes, error feedback's bookkeeping."""

from __future__ import annotations

import math

import pytest
import torch

from distrain.compress.base import CompressInfo, payload_nbytes
from distrain.compress.quantize import BlockQuantizer
from distrain.compress.registry import build_compressor
from distrain.errors import ConfigError


@pytest.mark.parametrize("spec, bits, block", [("int8", 8, 64), ("int4", 4, 64), ("int4:block=32", 4, 32),
                                                ("int8:block=16", 8, 16)])
@pytest.mark.parametrize("numel", [1, 63, 64, 1000])
def test_round_trip_error_is_at_most_half_a_step_of_its_block(spec, bits, block, numel):
    g = torch.Generator().manual_seed(numel)
    x = torch.randn(numel, generator=g) * torch.logspace(-3, 1, numel)  # blocks of very different scales
    q = build_compressor(spec, error_feedback=False)
    payload, meta = q.compress(x, CompressInfo())
    y = q.decompress(payload, meta)
    levels = 2 ** (bits - 1) - 1
    padded = torch.zeros(math.ceil(numel / block) * block)
    padded[:numel] = x
    step = (padded.view(-1, block).abs().amax(1) / levels).repeat_interleave(block)[:numel]
    assert bool(((y - x).abs() <= step / 2 + 1e-7).all())
    assert payload_nbytes(payload) == q.wire_bytes(numel)
    expected_codes = math.ceil(numel / block) * block // (8 // bits)
    assert payload_nbytes(payload) == expected_codes + 4 * math.ceil(numel / block)


def test_zeros_and_shapes_survive():
    q = BlockQuantizer(4)
    x = torch.zeros(3, 5)
    payload, meta = q.compress(x, CompressInfo())
    assert torch.equal(q.decompress(payload, meta), x)
    y = torch.randn(2, 3, 7)
    payload, meta = q.compress(y, CompressInfo())
    assert q.decompress(payload, meta).shape == y.shape


def test_error_feedback_sends_what_was_meant_over_time():
    # what was sent so far plus what is left in memory is exactly what was meant so far
    ef = build_compressor("int4:block=8")
    g = torch.Generator().manual_seed(0)
    meant, sent = torch.zeros(40), torch.zeros(40)
    for step in range(6):
        x = torch.randn(40, generator=g)
        meant += x
        payload, ctx = ef.compress(x, CompressInfo(step=step))
        sent += ef.decompress(payload, ctx)
    memory = next(iter(ef.state_dict().values()))
    torch.testing.assert_close(sent + memory.reshape(-1), meant, rtol=0, atol=1e-5)


@pytest.mark.parametrize("spec", ["int8:block=3", "int8:block=0", "int4:8", "int8:grp=4", "int4:block=x"])
def test_bad_specs_are_refused_naming_the_setting(spec):
    with pytest.raises(ConfigError, match="--compress"):
        build_compressor(spec)
