"""Training algorithms (one per file) and the name registry the CLI selects them from."""

from __future__ import annotations

from distrain.algorithms.allreduce import AllReduce
from distrain.algorithms.base import Algorithm, StepContext
from distrain.errors import ConfigError

ALGORITHMS: dict[str, type[Algorithm]] = {
    AllReduce.name: AllReduce,
}


def build_algorithm(name: str, config: object) -> Algorithm:
    """Instantiate an algorithm by name; the error lists the valid names."""
    try:
        klass = ALGORITHMS[name]
    except KeyError:
        raise ConfigError("--algorithm", f"unknown algorithm {name!r}; choose one of: {', '.join(sorted(ALGORITHMS))}") from None
    return klass(config)


__all__ = ["ALGORITHMS", "Algorithm", "AllReduce", "StepContext", "build_algorithm"]
