"""The device and backend a run asks for, checked before any process starts (no GPU is needed
here: the check reads how many GPUs torch sees)."""

from __future__ import annotations

import pytest
import torch

from distrain.comm.group import NCCL, backend_for, check_device
from distrain.config import TrainConfig
from distrain.errors import ConfigError


def config(**settings) -> TrainConfig:
    return TrainConfig.from_dict({"workers": 2, **settings})


def test_a_cuda_run_sends_its_tensors_over_nccl_and_distrains_control_messages_over_gloo():
    assert backend_for(config(device="cuda")) == NCCL == "cpu:gloo,cuda:nccl"
    assert backend_for(config(device="cuda", backend="nccl")) == NCCL
    assert backend_for(config(device="cuda", backend="gloo")) == "gloo"
    assert backend_for(config()) == "gloo"


@pytest.mark.parametrize(("gpus", "settings", "processes"), [
    (1, {"workers": 2}, 2), (2, {"workers": 2}, None), (4, {"workers": 3}, None),
    (2, {"workers": 2, "algorithm": "ps", "servers": 1}, 3),  # a parameter server is a process too
])
def test_nccl_needs_a_gpu_for_each_process_on_the_machine(monkeypatch, gpus, settings, processes):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    cfg = config(device="cuda", **settings)
    if processes is None:
        check_device(cfg)
    else:
        with pytest.raises(ConfigError, match=rf"^--backend: nccl needs a GPU for each process: {processes} "
                                              rf"processes on this machine, {gpus} GPU\(s\); use --backend gloo"):
            check_device(cfg)
    check_device(config(device="cuda", backend="gloo", workers=8))  # gloo lets processes share a GPU
    check_device(config(device="cuda", workers=8), processes=gpus)  # torchrun: this node's processes only


def test_nccl_without_cuda_and_cuda_without_a_gpu_are_refused(monkeypatch):
    with pytest.raises(ConfigError, match=r"^--backend: nccl moves CUDA tensors only; use --device cuda"):
        check_device(config(backend="nccl"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"^--device: cuda was asked for but this machine has no CUDA device"):
        check_device(config(device="cuda"))
