"""How worker processes come to exist: local spawn on loopback, or torchrun's environment."""

from distrain.launch.local import launch_local, run_in_process
from distrain.launch.torchrun import run_torchrun_worker
from distrain.runtime.process import in_torchrun

__all__ = ["in_torchrun", "launch_local", "run_in_process", "run_torchrun_worker"]
