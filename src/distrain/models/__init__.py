"""Models to train: built-in MLP and small CNNs, and loading a user's ``package.module:factory``."""

from distrain.models.build import MODELS, build_model
from distrain.models.zoo import MLP, CNN1d, CNN2d, count_parameters, mlp_width_for_params

__all__ = [
    "MODELS",
    "CNN1d",
    "CNN2d",
    "MLP",
    "build_model",
    "count_parameters",
    "mlp_width_for_params",
]
