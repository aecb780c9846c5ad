"""Turn a ``--model`` value into a module: a built-in name or a user's ``package.module:factory``."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from torch import nn

from distrain.errors import ConfigError, DistrainError
from distrain.models.gpt import GPT
from distrain.models.zoo import MLP, CNN1d, CNN2d

__all__ = ["MODELS", "ModelFactoryError", "build_model"]

_BUILTINS: dict[str, Callable[..., nn.Module]] = {"cnn1d": CNN1d, "cnn2d": CNN2d, "gpt": GPT, "mlp": MLP}

MODELS: tuple[str, ...] = tuple(sorted(_BUILTINS))
"""Names of the built-in models."""


class ModelFactoryError(DistrainError, RuntimeError):
    """A user's model factory raised; the message names it, the cause is the factory's exception."""


def build_model(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    width: int | None = None,
    depth: int | None = None,
    size: str | None = None,
) -> nn.Module:
    """Build a freshly initialised model; the weights depend only on the torch seed.

    ``name`` is one of :data:`MODELS` or ``"package.module:factory"``. The module is found as
    ``python -m`` finds one: in the current directory first, then on ``sys.path``. A factory is
    called with whichever of ``input_shape``, ``num_classes``, ``width`` and ``depth`` its
    signature names (``width`` and ``depth`` only when given), or with no arguments, and must
    return an ``nn.Module``. If it raises, :class:`ModelFactoryError` names it.

    Args:
        name: a built-in name or ``"package.module:factory"``.
        input_shape: shape of one sample, without the batch dimension, e.g. ``(40,)``.
        num_classes: number of outputs.
        width: hidden units (mlp) or channels (CNNs); ``None`` keeps the model's default.
        depth: hidden layers (mlp) or convolutions (CNNs); ``None`` keeps the model's default.
        size: ``gpt``'s size preset (:data:`~distrain.models.gpt.GPT_SIZES`); other models
            ignore it. ``input_shape`` is then ``(context,)`` and ``num_classes`` the vocabulary.

    Example::

        >>> torch.manual_seed(0)
        >>> model = build_model("cnn1d", (40,), 10)
        >>> big = build_model("mlp", (40,), 10, width=974)  # 999,334 parameters
        >>> mine = build_model("my_pkg.nets:make_net", (1, 28, 28), 10)
    """
    sizes = {k: v for k, v in (("width", width), ("depth", depth)) if v is not None}
    if name == "gpt" and size is not None:
        return GPT(tuple(input_shape), num_classes, size=size, **sizes)
    if name in _BUILTINS:
        return _BUILTINS[name](tuple(input_shape), num_classes, **sizes)
    if ":" in name:
        return _build_user_model(name, tuple(input_shape), num_classes, sizes)
    raise ConfigError(
        "--model",
        f"unknown model {name!r}; choose one of: {', '.join(MODELS)}, or package.module:factory",
    )


def _build_user_model(
    spec: str, input_shape: tuple[int, ...], num_classes: int, sizes: dict[str, int]
) -> nn.Module:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError("--model", f"{spec!r} must look like package.module:factory")
    try:
        module = _import_from_cwd(module_name)
    except ImportError as exc:
        raise ConfigError("--model", f"cannot import module {module_name!r} ({exc})") from exc
    factory = getattr(module, attr, None)
    if factory is None:
        raise ConfigError("--model", f"module {module_name!r} has no attribute {attr!r}")
    if not callable(factory):
        raise ConfigError("--model", f"{spec!r} is a {type(factory).__name__}, not a callable")

    accepted = _keyword_names(factory)
    for key in sizes:
        if key not in accepted:
            raise ConfigError(f"--model-{key}", f"{spec!r} takes no {key!r} argument")
    offered: dict[str, Any] = {"input_shape": input_shape, "num_classes": num_classes, **sizes}
    try:
        model = factory(**{k: v for k, v in offered.items() if k in accepted})
    except Exception as exc:
        raise ModelFactoryError(f"--model {spec}: the factory raised {_one_line(exc)}") from exc
    if not isinstance(model, nn.Module):
        raise ConfigError(
            "--model", f"{spec!r} returned a {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def _import_from_cwd(module_name: str) -> ModuleType:
    """Import ``module_name`` with the current directory first on ``sys.path``, as ``python -m``
    has it: the ``distrain`` command (a console script) starts with its own directory there."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    return importlib.import_module(module_name)


def _keyword_names(factory: Callable[..., Any]) -> set[str]:
    """Names from ``input_shape, num_classes, width, depth`` that ``factory`` accepts by keyword."""
    wanted = {"input_shape", "num_classes", "width", "depth"}
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # some builtins have no introspectable signature
        return set()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return wanted
    keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name for p in params if p.kind in keyword_kinds and p.name in wanted}


def _one_line(exc: BaseException) -> str:
    """``Type: message`` on one line, as the last line of its traceback reads."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())
