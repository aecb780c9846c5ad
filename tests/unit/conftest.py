"""Fixtures of the unit tests."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from distrain.launch.common import free_port


@pytest.fixture()
def store(monkeypatch):  # noqa: ANN001, ANN201
    """A launcher's store: a real TCPStore on 127.0.0.1, named in MASTER_ADDR / MASTER_PORT."""
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    yield master
