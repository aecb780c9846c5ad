"""Training algorithms (one per file, each beside the settings dataclass it takes) and the name
registry the CLI selects them from; :mod:`distrain.assemble` makes them from a run's flags."""

from __future__ import annotations

from distrain.algorithms.adpsgd import ADPSGD
from distrain.algorithms.allreduce import AllReduce
from distrain.algorithms.base import Algorithm, StepContext
from distrain.algorithms.d2 import D2
from distrain.algorithms.diloco import DiLoCo
from distrain.algorithms.dpsgd import DPSGD
from distrain.algorithms.parameter_server import ParameterServer
from distrain.algorithms.prague import Prague

ALGORITHMS: dict[str, type[Algorithm]] = {
    AllReduce.name: AllReduce,
    DPSGD.name: DPSGD,
    D2.name: D2,
    ParameterServer.name: ParameterServer,
    ADPSGD.name: ADPSGD,
    Prague.name: Prague,
    DiLoCo.name: DiLoCo,
}


__all__ = ["ADPSGD", "ALGORITHMS", "Algorithm", "AllReduce", "D2", "DPSGD", "DiLoCo", "ParameterServer", "Prague", "StepContext"]
