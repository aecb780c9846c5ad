"""Optional packages: which ``pip install 'distrain[EXTRA]'`` brings each one, and the error
that says so when a feature needs one that is missing.

Training a model of your own needs none of them; the built-in data sets, plots and YAML
config files do.

Example::

    from distrain.extras import require
    mnist1d_data = require("mnist1d.data", feature="--dataset mnist1d", setting="--dataset")
"""

from __future__ import annotations

import importlib
from types import ModuleType

from distrain.errors import ConfigError

#: Top-level module -> (the package name pip installs, the distrain extra that installs it).
PACKAGES: dict[str, tuple[str, str]] = {
    "mnist1d": ("mnist1d", "data"),
    "sklearn": ("scikit-learn", "data"),
    "matplotlib": ("matplotlib", "plots"),
    "yaml": ("PyYAML", "yaml"),
    "tokenizers": ("tokenizers", "lm"),
    "torchft": ("torchft", "peers"),
}


class MissingExtraError(ConfigError, ImportError):
    """A feature needs an optional package that is not installed; the message names the extra.

    It is a :class:`ConfigError` (the command line reports it in one line with exit status 2)
    and an :class:`ImportError` (``except ImportError`` in a user's code catches it).

    Args:
        setting: the flag or field that asked for the feature, e.g. ``--dataset``.
        feature: what needs the package, e.g. ``--dataset mnist1d``.
        module: the top-level module that could not be imported, a key of :data:`PACKAGES`.
    """

    def __init__(self, setting: str, feature: str, module: str) -> None:
        package, extra = PACKAGES[module]
        message = f"needs the {package!r} package: pip install 'distrain[{extra}]'"
        super().__init__(setting, message)
        self.name = module
        self.extra = extra
        # The feature reads better than the setting alone: "--dataset mnist1d needs ...".
        self.args = (f"{feature} {message}",)
        self.msg = self.args[0]

    def __str__(self) -> str:
        return str(self.args[0])


def require(module: str, *, feature: str, setting: str) -> ModuleType:
    """Import ``module`` (e.g. ``"mnist1d.data"``), or raise :class:`MissingExtraError`.

    Args:
        module: the module to import; its top-level package must be a key of :data:`PACKAGES`.
        feature: what needs it, as the user asked for it, e.g. ``--dataset digits``.
        setting: the flag or field behind the feature, e.g. ``--dataset``.
    """
    try:
        return importlib.import_module(module)
    except ImportError:
        # Also when the package is there but one of its own dependencies is not: installing
        # the extra brings both.
        raise MissingExtraError(setting, feature, module.split(".")[0]) from None
