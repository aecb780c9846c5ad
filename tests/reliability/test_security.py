"""What distrain puts on the wire and loads from disk cannot run code: tensors and fixed-format
headers only, sizes checked before allocating, torch.load(weights_only=True); local runs bind
loopback; the README says torch.distributed has no authentication."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from distrain.config import TrainConfig

SRC = Path(__file__).resolve().parents[2] / "src" / "distrain"
README = Path(__file__).resolve().parents[2] / "README.md"


def sources() -> list[tuple[Path, str]]:
    return [(p, p.read_text()) for p in sorted(SRC.rglob("*.py"))]


@pytest.mark.parametrize("pattern", [
    r"\b(send|recv|broadcast|all_gather|gather|scatter)_object(_list)?\b",  # torch.distributed pickles these
    r"\bpickle\.loads?\(", r"\bmarshal\.loads?\(", r"\bdill\b", r"\bcloudpickle\b",
    r"allow_pickle\s*=\s*True",
])
def test_no_pickled_objects_anywhere_in_distrain(pattern):
    hits = [f"{p.relative_to(SRC)}:{i}" for p, text in sources()
            for i, line in enumerate(text.splitlines(), 1) if re.search(pattern, line)]
    assert hits == []


def test_every_torch_load_is_weights_only():
    calls = [(p, m) for p, text in sources() for m in re.finditer(r"torch\.load\(([^()]|\([^()]*\))*\)", text)]
    assert calls, "expected at least the checkpoint loader"
    for path, match in calls:
        assert "weights_only=True" in match.group(0), f"{path.relative_to(SRC)}: {match.group(0)}"


def test_local_runs_bind_loopback_by_default():
    assert TrainConfig().cluster.master_addr == "127.0.0.1"


def test_sparse_headers_are_checked_before_allocating():
    from distrain.comm.sparse_ring import DENSE, SPARSE, ProtocolError, check_header

    with pytest.raises(ProtocolError):
        check_header(torch.tensor([SPARSE, 10**12, 4]), 1000, torch.float32)  # more nonzeros than the chunk
    with pytest.raises(ProtocolError):
        check_header(torch.tensor([DENSE, 1001, 4]), 1000, torch.float32)
    with pytest.raises(ProtocolError):
        check_header(torch.tensor([7, 1, 4]), 1000, torch.float32)  # unknown encoding
    with pytest.raises(ProtocolError):
        check_header(torch.tensor([DENSE, 1000, 8]), 1000, torch.float32)  # element size


def test_a_server_checks_its_start_header_before_allocating():
    from distrain.algorithms.parameter_server import MAX_SHARD_BYTES, check_start_header
    from distrain.errors import WorkerFailure

    gib = 2**30
    assert check_start_header([1000, 50, 10], pushers=4, memory=gib) == (1000, 50, 10)
    limit = MAX_SHARD_BYTES // 4
    assert check_start_header([limit, 1, 1], pushers=1, memory=None)[0] == limit  # no memory figure: the limit alone
    for values, words in [([limit + 1, 1, 1], "a server accepts 1 to"), ([0, 1, 1], "a server accepts 1 to"),
                          ([-5, 1, 1], "a server accepts 1 to"), ([2**62, 1, 1], "a server accepts 1 to"),
                          ([10, 0, 1], "run length"), ([10, 1, -1], "run length"), ([10, 1], "expected 3")]:
        with pytest.raises(WorkerFailure, match=words):
            check_start_header(values, pushers=4, memory=64 * gib)
    with pytest.raises(WorkerFailure, match="use more --servers"):  # 7 copies of 1 GiB do not fit in 4 GiB
        check_start_header([gib // 4, 1, 1], pushers=4, memory=4 * gib)


def test_readme_has_a_security_section():
    text = README.read_text()
    section = text[text.index("## Security"):]
    section = section[: section.find("\n## ", 1)]
    assert "no authentication" in section and "encryption" in section and "trusted" in section


def test_the_launchers_store_listens_on_loopback_only():
    """torch's TCPStore listens on every interface unless handed a socket: the launcher's is bound
    to the run's address (127.0.0.1)."""
    import socket

    from distrain.comm.group import store_of

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    store = store_of("127.0.0.1", port, 5.0, host=True)
    try:
        rows = [line.split() for name in ("tcp", "tcp6") if Path(f"/proc/net/{name}").exists()
                for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]]
        listening = [row[1] for row in rows if row[3] == "0A" and int(row[1].split(":")[1], 16) == port]
        assert listening == [f"0100007F:{port:04X}"], listening  # 127.0.0.1, and nowhere else ([::] included)
        store.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        del store
