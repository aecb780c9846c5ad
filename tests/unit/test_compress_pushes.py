"""Compressed parameter-server pushes: what the server decodes is what the worker's compressor sent."""

from __future__ import annotations

import pytest
import torch

from distrain.comm.sparse_ring import DENSE, SPARSE, Message, ProtocolError
from distrain.compress import CompressInfo, MomentumCorrection, build_compressor
from distrain.compress.group_topk import GroupTopK
from distrain.compress.pushes import PACKED, PushDecoder, ShardPush
from distrain.config import TrainConfig
from distrain.errors import ConfigError

SPECS = ["fp16", "bf16", "qsgd:8bit", "qsgd:4bit", "topk:0.1", "group_topk:0.05:group=64", "randomk:0.1",
         "sparseloco:0.05:chunk=128"]


def shard(numel: int = 1001, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def through_wire(push: ShardPush, decoder: PushDecoder, grad: torch.Tensor, info: CompressInfo, **kw) -> torch.Tensor:
    message = push.encode(grad, info, **kw)
    assert decoder.body_nbytes(message.header) == message.body.numel()  # what the server allocates
    return decoder.decode(Message(message.header.clone(), message.body.clone()))


@pytest.mark.parametrize("spec", SPECS)
def test_server_decodes_exactly_what_the_worker_compressed(spec):
    grad, info = shard(), CompressInfo(step=3, key=1, worker=2)
    worker = build_compressor(spec, seed=7)  # with error feedback, as the workers run
    reference = build_compressor(spec, seed=7)
    push, decoder = ShardPush(worker), PushDecoder(build_compressor(spec, error_feedback=False, seed=7), grad.numel())
    got = through_wire(push, decoder, grad, info)
    payload, ctx = reference.compress(grad, info)
    want = reference.decompress(payload, ctx).reshape(-1)
    assert got.dtype == torch.float32 and got.shape == grad.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # error feedback was kept for the shard's key: the next push carries what this one dropped
    assert torch.equal(worker.residuals[1], reference.residuals[1])


def test_every_worker_and_step_may_push_a_different_ratio():
    numel, spec = 4096, "group_topk:0.01:group=256"
    decoder = PushDecoder(build_compressor(spec, error_feedback=False), numel)
    for ratio in (0.01, 0.03, 0.25, 1.0):
        grad = shard(numel, seed=int(ratio * 100))
        message = ShardPush(build_compressor(spec)).encode(grad, CompressInfo(ratio=ratio))
        kept = GroupTopK(ratio, group=256).kept_count(numel)
        got = decoder.decode(message)
        assert int((got != 0).sum()) == kept
        expected_encoding = DENSE if ratio == 1.0 else SPARSE  # a full push travels dense
        assert int(message.header[0]) == expected_encoding


def test_dense_warmup_push_sends_the_velocity_with_momentum_correction():
    grad = shard(500)
    mc = MomentumCorrection(GroupTopK(0.1, group=50), momentum=0.9)
    push, decoder = ShardPush(mc), PushDecoder(GroupTopK(0.1, group=50), 500)
    first = through_wire(push, decoder, grad, CompressInfo(key=0), dense=True)
    second = through_wire(push, decoder, grad, CompressInfo(key=0), dense=True)
    torch.testing.assert_close(first, grad)
    torch.testing.assert_close(second, grad * 1.9)
    plain = through_wire(ShardPush(build_compressor("fp16")), PushDecoder(build_compressor("fp16"), 500), grad,
                         CompressInfo(), dense=True)
    assert torch.equal(plain, grad)  # dense pushes are float32 whatever the compressor


@pytest.mark.parametrize("spec,header", [
    ("group_topk:0.01", [SPARSE, 1002, 4]),        # more nonzeros than the shard has
    ("group_topk:0.01", [SPARSE, 5, 8]),           # float64 values
    ("group_topk:0.01", [DENSE, 1000, 4]),         # dense of the wrong length
    ("group_topk:0.01", [PACKED, 2002, 1]),        # sparse compressor, packed push
    ("fp16", [PACKED, 2004, 1]),                   # packed size does not match the layout
    ("fp16", [SPARSE, 10, 4]),                     # fp16 payloads are not sparse
    ("qsgd:8bit", [7, 1, 1]),                      # unknown encoding
])
def test_malformed_push_headers_are_rejected_before_allocating(spec, header):
    decoder = PushDecoder(build_compressor(spec, error_feedback=False), 1001)
    with pytest.raises(ProtocolError):
        decoder.body_nbytes(torch.tensor(header, dtype=torch.int64))


@pytest.mark.parametrize("algorithm", ["dpsgd", "d2", "adpsgd", "prague"])
def test_algorithms_that_do_not_compress_refuse_compress(algorithm):
    cfg = TrainConfig.from_dict({"algorithm": algorithm, "compress": "topk:0.1", "workers": 4})
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    assert info.value.setting == "--compress"
    TrainConfig.from_dict({"algorithm": algorithm, "compress": "none", "workers": 4}).validate()
    TrainConfig.from_dict({"algorithm": "ps", "compress": "topk:0.1", "workers": 4}).validate()
