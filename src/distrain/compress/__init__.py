"""Gradient compression: compressors, error feedback, density warm-up and the compressed all-reduce.

A :class:`Compressor` turns a tensor into a payload (tensors only: what goes on the wire) and a
local context, and back. :class:`ErrorFeedback` wraps any compressor with residual memory.
:class:`MomentumCorrection` moves the optimizer's momentum in front of a sparsifier (DGC).
:func:`build_compressor` builds one from a ``--compress`` spec; :func:`allreduce_compressed`
sums a tensor over workers with the collective the compressor calls for;
:class:`GradientCompression` is what ``--compress`` does to a model's gradients each step.

For a parameter server, a worker compresses each shard with its own key
(``CompressInfo(step=s, key=shard)``, error feedback per shard) into one self-describing message
(:class:`ShardPush`); the server decodes it (:class:`PushDecoder`) after checking its header.
"""

from distrain.compress.base import (
    CompressInfo,
    Compressor,
    Payload,
    SparseCompressor,
    TensorMeta,
    desparsify,
    payload_nbytes,
)
from distrain.compress.collective import allreduce_compressed
from distrain.compress.error_feedback import ErrorFeedback
from distrain.compress.fp16 import FP16Compressor
from distrain.compress.gradients import GradientCompression
from distrain.compress.group_topk import GroupTopK, group_topk_indices
from distrain.compress.momentum_correction import MomentumCorrection
from distrain.compress.none import NoneCompressor
from distrain.compress.pushes import PushDecoder, ShardPush
from distrain.compress.qsgd import QSGD
from distrain.compress.randomk import RandomK
from distrain.compress.registry import COMPRESSORS, build_compressor, parse_spec, validate_spec
from distrain.compress.settings import CompressionSettings
from distrain.compress.sparseloco import SparseLoCo
from distrain.compress.topk import TopK
from distrain.compress.warmup import DensityWarmup

__all__ = [
    "COMPRESSORS", "QSGD", "CompressInfo", "CompressionSettings", "Compressor", "DensityWarmup", "ErrorFeedback",
    "FP16Compressor", "GradientCompression", "GroupTopK", "MomentumCorrection", "NoneCompressor",
    "Payload", "PushDecoder", "RandomK", "ShardPush", "SparseCompressor", "SparseLoCo", "TensorMeta", "TopK", "allreduce_compressed",
    "build_compressor", "desparsify", "group_topk_indices", "parse_spec", "payload_nbytes",
    "validate_spec",
]
