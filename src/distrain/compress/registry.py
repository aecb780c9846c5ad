"""Compressor names and the ``--compress`` spec syntax: ``NAME[:ARG][:KEY=VALUE...]``.

Examples: ``none``, ``fp16``, ``bf16``, ``topk:0.01``, ``randomk:0.01``,
``group_topk:0.01:group=1024``, ``qsgd:8bit``, ``qsgd:4bit``, ``int8``, ``int4:block=32``,
``adaptive:base=0.01:min=0.001:max=0.1`` (group top-k with a ratio per worker and step, see
:mod:`distrain.compress.adaptive`), ``sparseloco:0.02``, ``sparseloco:0.01:bits=2:chunk=4096:decay=0.95``
(chunked top-k with the kept values in ``bits`` bits, 1 to 8, default 2; ``chunk`` elements per
chunk, 2 to 2^24, default 4096; error feedback's residual decay in (0, 1], default 1; see
:mod:`distrain.compress.sparseloco`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from distrain.compress.adaptive import AdaptiveGroupTopK, AdaptivePolicy, parse_adaptive
from distrain.compress.base import Compressor
from distrain.compress.error_feedback import ErrorFeedback
from distrain.compress.fp16 import FP16Compressor
from distrain.compress.group_topk import DEFAULT_GROUP, GroupTopK
from distrain.compress.none import NoneCompressor
from distrain.compress.qsgd import QSGD
from distrain.compress.quantize import DEFAULT_BLOCK, BlockQuantizer
from distrain.compress.randomk import RandomK
from distrain.compress.sparseloco import DEFAULT_CHUNK, MAX_CHUNK, SparseLoCo
from distrain.compress.topk import TopK
from distrain.errors import ConfigError

FLAG = "--compress"


@dataclass(frozen=True)
class Spec:
    """A parsed ``--compress`` value."""

    name: str
    args: tuple[str, ...]
    options: dict[str, str]


@dataclass(frozen=True)
class Entry:
    usage: str
    build: Callable[[Spec, int], Compressor]


def _ratio(spec: Spec) -> float:
    if len(spec.args) != 1:
        raise ValueError("needs one ratio")
    try:
        ratio = float(spec.args[0])
    except ValueError:
        raise ValueError(f"ratio must be a number in (0, 1], got {spec.args[0]!r}") from None
    if math.isnan(ratio) or not (0.0 < ratio <= 1.0):
        raise ValueError(f"ratio must be in (0, 1], got {spec.args[0]!r}")
    return ratio


def _no_options(spec: Spec, allowed: tuple[str, ...] = ()) -> None:
    extra = sorted(set(spec.options) - set(allowed))
    if extra:
        raise ValueError(f"unknown option {extra[0]!r}")


def _plain(factory: Callable[[], Compressor]) -> Callable[[Spec, int], Compressor]:
    def build(spec: Spec, seed: int) -> Compressor:
        if spec.args:
            raise ValueError(f"takes no argument, got {spec.args[0]!r}")
        _no_options(spec)
        return factory()
    return build


def _topk(spec: Spec, seed: int) -> Compressor:
    _no_options(spec)
    return TopK(_ratio(spec))


def _randomk(spec: Spec, seed: int) -> Compressor:
    _no_options(spec)
    return RandomK(_ratio(spec), seed=seed)


def _group_topk(spec: Spec, seed: int) -> Compressor:
    _no_options(spec, ("group",))
    text = spec.options.get("group", str(DEFAULT_GROUP))
    try:
        group = int(text)
    except ValueError:
        raise ValueError(f"group must be an integer >= 1, got {text!r}") from None
    if group < 1:
        raise ValueError(f"group must be an integer >= 1, got {text!r}")
    return GroupTopK(_ratio(spec), group=group)


def _adaptive(spec: Spec, seed: int) -> Compressor:
    return AdaptiveGroupTopK(parse_adaptive(spec.args, spec.options))


def _qsgd(spec: Spec, seed: int) -> Compressor:
    _no_options(spec)
    if len(spec.args) > 1:
        raise ValueError("takes one argument, 8bit or 4bit")
    bits = spec.args[0] if spec.args else "8bit"
    if bits not in ("8bit", "4bit"):
        raise ValueError(f"bits must be 8bit or 4bit, got {bits!r}")
    return QSGD(int(bits[0]), seed=seed)


def _blocks(bits: int) -> Callable[[Spec, int], Compressor]:
    def build(spec: Spec, seed: int) -> Compressor:
        _no_options(spec, ("block",))
        if spec.args:
            raise ValueError("takes no argument but block=N")
        text = spec.options.get("block", str(DEFAULT_BLOCK))
        try:
            block = int(text)
        except ValueError:
            raise ValueError(f"block must be an even integer >= 2, got {text!r}") from None
        return BlockQuantizer(bits, block)

    return build


def _integer(spec: Spec, key: str, default: int, allowed: str) -> int:
    text = spec.options.get(key, str(default))
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{key} must be {allowed}, got {text!r}") from None


def _sparseloco(spec: Spec, seed: int) -> Compressor:
    _no_options(spec, ("bits", "chunk", "decay"))
    ratio = _ratio(spec)
    bits = _integer(spec, "bits", 2, "an integer from 1 to 8")
    chunk = _integer(spec, "chunk", DEFAULT_CHUNK, f"an integer from 2 to {MAX_CHUNK}")
    text = spec.options.get("decay", "1")
    try:
        decay = float(text)
    except ValueError:
        raise ValueError(f"decay must be a number in (0, 1], got {text!r}") from None
    return SparseLoCo(ratio, bits=bits, chunk=chunk, decay=decay)


COMPRESSORS: dict[str, Entry] = {
    "none": Entry("none", _plain(NoneCompressor)),
    "fp16": Entry("fp16", _plain(lambda: FP16Compressor(torch.float16))),
    "bf16": Entry("bf16", _plain(lambda: FP16Compressor(torch.bfloat16))),
    "topk": Entry("topk:RATIO", _topk),
    "randomk": Entry("randomk:RATIO", _randomk),
    "group_topk": Entry("group_topk:RATIO[:group=N]", _group_topk),
    "qsgd": Entry("qsgd:8bit|4bit", _qsgd),
    "int8": Entry("int8[:block=N]", _blocks(8)),
    "int4": Entry("int4[:block=N]", _blocks(4)),
    "sparseloco": Entry("sparseloco:RATIO[:bits=B][:chunk=N][:decay=D]", _sparseloco),
    "adaptive": Entry("adaptive:base=R:min=R:max=R[:alpha=A:beta=B:dead=D:spare=S:recent=N:window=N:history=N:group=N]", _adaptive),
}
"""Registered names -> how to build them; RATIO is the kept fraction in (0, 1]."""


def usage() -> str:
    return ", ".join(entry.usage for entry in COMPRESSORS.values())


def parse_spec(text: str) -> Spec:
    """Split ``NAME[:ARG][:KEY=VALUE...]``; raises ConfigError for an unknown name."""
    parts = [p.strip() for p in str(text).strip().split(":")]
    name = parts[0]
    if name not in COMPRESSORS:
        raise ConfigError(FLAG, f"unknown compressor {name!r}; choose one of: {usage()}")
    args, options = [], {}
    for part in parts[1:]:
        if "=" in part:
            key, _, value = part.partition("=")
            options[key.strip()] = value.strip()
        else:
            args.append(part)
    return Spec(name, tuple(args), options)


def build_compressor(text: str, *, error_feedback: bool = True, seed: int = 0,
                     residual_device: str | None = None) -> Compressor:
    """Build the compressor a ``--compress`` spec names, wrapped in error feedback when lossy.

    Args:
        text: the spec, e.g. ``"group_topk:0.01:group=1024"``.
        error_feedback: wrap lossy compressors in :class:`ErrorFeedback`. Random-k then sends
            its raw values rather than the unbiased, rescaled ones (see :class:`RandomK`).
        seed: shared by all workers (random-k draws the same indices everywhere from it).
        residual_device: where error feedback keeps its residuals ("cpu" for DiLoCo's
            pseudo-gradients, sent every H steps); None: on each tensor's device (a gradient
            compressed every step would otherwise cross to the CPU and back each time).

    Raises:
        ConfigError: naming ``--compress`` and what is allowed.

    Example::

        >>> build_compressor("group_topk:0.01:group=512")
        ErrorFeedback(GroupTopK(group_topk:0.01:group=512))
    """
    spec = parse_spec(text)
    entry = COMPRESSORS[spec.name]
    try:
        compressor = entry.build(spec, seed)
    except ValueError as exc:
        raise ConfigError(FLAG, f"{spec.name}: {exc}; expected {entry.usage}") from None
    if not (error_feedback and compressor.lossy):
        return compressor
    if isinstance(compressor, RandomK):
        compressor.unbiased = False
    return ErrorFeedback(compressor, residual_device=residual_device)


def validate_spec(text: str) -> None:
    """Raise ConfigError unless ``text`` is a valid ``--compress`` spec."""
    build_compressor(text, error_feedback=False)


def policy_from_spec(text: str) -> AdaptivePolicy | None:
    """A fresh adaptive-ratio policy for an ``adaptive:...`` ``--compress`` spec; None for any
    other spec."""
    if str(text).split(":", 1)[0].strip() != AdaptiveGroupTopK.name:
        return None
    spec = parse_spec(text)
    return AdaptivePolicy(parse_adaptive(spec.args, spec.options))
