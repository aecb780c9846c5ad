"""Checkpoint files and per-run checkpoint sets: round trip, damage detection, resume, pruning."""

from __future__ import annotations

import io
import logging
import multiprocessing as mp
import os
import random
import signal
import struct
import sys
import time
from hashlib import sha256
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from distrain.errors import CheckpointError, ConfigError
from distrain.runtime.checkpoint import (
    CHECKSUM_KEY,
    OLD_MAGIC,
    CheckpointStore,
    OldCheckpointFormat,
    check_compatible,
    content_digest,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)

LOGGER = "distrain.runtime.checkpoint"


def _training_state(seed: int = 0) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    model(torch.randn(4, 6)).sum().backward()
    optimizer.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "algorithm": {"residual": [torch.randn(3), torch.zeros(2, dtype=torch.bfloat16)]},
        "step": 120,
        "epoch": 2.5,
        "model_name": "mlp",
        "algorithm_name": "allreduce",
        "world_size": 4,
        "config_digest": "0f3a9c",
        "rng": torch.get_rng_state(),
        "dtype": torch.float16,
        "shape": torch.Size([2, 3]),
        "note": None,
    }


def _assert_same(actual: Any, expected: Any, where: str = "state") -> None:
    """Exact, type-preserving equality of nested containers of tensors and scalars."""
    assert type(actual) is type(expected), f"{where}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype, where
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=where)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), where
        for key in expected:
            _assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)) and not isinstance(expected, torch.Size):
        assert len(actual) == len(expected), where
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_same(a, e, f"{where}[{index}]")
    else:
        assert actual == expected, where


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _damage_tensor(path: Path) -> None:
    """Flip one byte in the middle of the first non-empty tensor's data inside the file."""
    state = torch.load(path, weights_only=True)
    stack: list[Any] = [state]
    while stack:
        item = stack.pop(0)
        if isinstance(item, torch.Tensor) and item.numel():
            raw = item.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            offset = path.read_bytes().find(raw)
            assert offset >= 0
            _flip_byte(path, offset + len(raw) // 2)
            return
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    raise AssertionError(f"{path} holds no tensor data")


# --- single files ----------------------------------------------------------------------------


def test_round_trip_keeps_tensors_and_scalars(tmp_path: Path) -> None:
    state = _training_state()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, state)
    loaded = load_checkpoint(path)
    _assert_same(loaded, state)
    assert loaded["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)


def test_file_is_a_plain_torch_save_file_with_its_digest(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    state = _training_state()
    save_checkpoint(path, state)
    plain = torch.load(path, weights_only=True)
    digest = plain.pop(CHECKSUM_KEY)
    _assert_same(plain, state)
    assert digest == content_digest(state)
    assert len(digest) == 64
    with pytest.raises(CheckpointError, match="content_sha256"):
        save_checkpoint(path, {CHECKSUM_KEY: "mine", "step": 1})


def test_content_digest_sees_every_value_and_type() -> None:
    base = {"w": torch.arange(6.0).reshape(2, 3), "step": 3, "names": ["a", "b"], "tags": {"x", "y"}}
    assert content_digest(base) == content_digest(dict(base, tags={"y", "x"}))  # sets: any order
    assert content_digest(base) == content_digest(dict(base, w=torch.arange(6.0).reshape(2, 3).t().contiguous().t()))  # strides
    variants = [
        dict(base, w=torch.arange(6.0).reshape(3, 2)),  # shape
        dict(base, w=torch.arange(6.0).reshape(2, 3).double()),  # dtype
        dict(base, w=torch.arange(6.0).reshape(2, 3) + 1e-6),  # values
        dict(base, step=3.0),  # 3 and 3.0
        dict(base, step=True),
        dict(base, names=("a", "b")),  # list and tuple
        dict(base, names=["ab"]),
        {"step": 3, **base},  # key order
    ]
    digests = {content_digest(v) for v in variants}
    assert len(digests) == len(variants) and content_digest(base) not in digests


def test_save_leaves_no_temporary_files(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "ckpt.pt"
    for step in range(3):
        save_checkpoint(path, {"w": torch.full((100,), float(step)), "step": step})
    assert sorted(p.name for p in path.parent.iterdir()) == ["ckpt.pt"]
    assert load_checkpoint(path)["step"] == 2


def test_failed_write_keeps_previous_file_and_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"step": 1})

    def failing_fsync(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(CheckpointError, match="No space left on device") as info:
        save_checkpoint(path, {"step": 2})
    assert str(path) in str(info.value)
    monkeypatch.undo()
    assert load_checkpoint(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_truncated_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"w": torch.zeros(1000), "step": 1})
    size = path.stat().st_size
    for keep in (size - 1, size // 2, 100, 3):
        with open(path, "r+b") as file:
            file.truncate(keep)
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(path)
        assert str(info.value).startswith(f"checkpoint {path} is damaged"), keep
        assert "\n" not in str(info.value)


def test_flipped_tensor_byte_is_a_checksum_mismatch(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"w": torch.randn(500), "step": 7})
    _damage_tensor(path)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)
    assert str(info.value) == f"checkpoint {path} has a checksum mismatch (corrupted)"
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        verify_checkpoint(path)


def test_any_flipped_byte_is_refused_or_harmless(tmp_path: Path) -> None:
    """Damage anywhere either fails loading or the checksum, or left the contents as saved
    (zip padding, fields torch does not read): a damaged state is never returned."""
    path = tmp_path / "ckpt.pt"
    state = {"w": torch.randn(64), "b": torch.arange(5), "step": 7, "name": "mlp"}
    save_checkpoint(path, state)
    data = path.read_bytes()
    outcomes = {"refused": 0, "checksum": 0, "harmless": 0}
    for offset in range(0, len(data), 7):
        damaged = bytearray(data)
        damaged[offset] ^= 0xFF
        path.write_bytes(bytes(damaged))
        try:
            loaded = load_checkpoint(path)
        except CheckpointError as exc:
            assert "\n" not in str(exc)
            outcomes["checksum" if "checksum mismatch" in str(exc) else "refused"] += 1
            continue
        _assert_same(loaded, state)
        outcomes["harmless"] += 1
    assert outcomes["checksum"] >= 20 and outcomes["refused"] >= 20, outcomes


def test_plain_torch_save_and_text_files_are_not_checkpoints(tmp_path: Path) -> None:
    plain = tmp_path / "plain.pt"
    torch.save({"w": torch.zeros(3)}, plain)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(plain)
    assert str(info.value) == (
        f"checkpoint {plain} is not a distrain checkpoint (it has no 'content_sha256' entry)"
    )
    text = tmp_path / "notes.txt"
    text.write_text("hello, this is not a checkpoint at all\n")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(text)
    assert str(info.value).startswith(f"checkpoint {text} is damaged or not a checkpoint: ")
    assert "\n" not in str(info.value)
    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match=f"checkpoint {empty} is empty"):
        load_checkpoint(empty)


def _old_format_file(path: Path, state: dict[str, Any]) -> None:
    """A checkpoint as the first format wrote it: magic, length, SHA-256, then torch.save."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack(">8sQ32s", OLD_MAGIC, len(payload), sha256(payload).digest()) + payload)


def test_old_format_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    _old_format_file(path, {"w": torch.zeros(3), "step": 5})
    with pytest.raises(OldCheckpointFormat) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert message.startswith(f"checkpoint {path} is in distrain's old format")
    assert "--resume none" in message and "\n" not in message
    # --resume auto must not skip such a set and silently start the run afresh.
    stores = _stores(tmp_path / "run", world_size=2)
    for rank in range(2):
        _old_format_file(stores[rank].rank_file(40), {"step": 40, "rank": rank})
    with pytest.raises(OldCheckpointFormat):
        stores[0].resolve("auto")
    with pytest.raises(CheckpointError, match="cannot resume from step 40: .* old format"):
        stores[0].resolve("40")


def test_missing_file_and_directory(tmp_path: Path) -> None:
    missing = tmp_path / "runs" / "x" / "ckpt.pt"
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(missing)
    assert str(info.value) == f"checkpoint {missing} does not exist"
    with pytest.raises(CheckpointError, match="is a directory"):
        load_checkpoint(tmp_path)


class _Opaque:
    """An arbitrary Python class: weights-only loading must never rebuild it."""


_UNPICKLE_CALLS: list[str] = []


def _record_unpickle(tag: str) -> str:
    _UNPICKLE_CALLS.append(tag)
    return tag


class _RunsCodeOnLoad:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_record_unpickle, ("code ran",))


@pytest.mark.parametrize(
    ("value", "type_name"),
    [(_Opaque(), "_Opaque"), (np.float64(1.5), "numpy.float64"), (np.zeros(3), "numpy.ndarray")],
)
def test_save_refuses_objects_weights_only_loading_cannot_rebuild(
    tmp_path: Path, value: Any, type_name: str
) -> None:
    path = tmp_path / "ckpt.pt"
    state = {"model": {"w": torch.zeros(2)}, "extra": {"items": [1, value]}}
    with pytest.raises(CheckpointError, match=type_name) as info:
        save_checkpoint(path, state)
    assert "state['extra']['items'][1]" in str(info.value)
    assert "\n" not in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_load_refuses_pickled_code(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"step": 1, "evil": _RunsCodeOnLoad(), CHECKSUM_KEY: "0" * 64}, path)
    _UNPICKLE_CALLS.clear()
    with pytest.raises(CheckpointError, match="weights-only loading refuses") as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)
    assert "_record_unpickle" in str(info.value)
    assert "\n" not in str(info.value)
    assert _UNPICKLE_CALLS == []


# --- compatibility ---------------------------------------------------------------------------


def test_check_compatible_accepts_matching_run() -> None:
    state = {"model_name": "mlp", "algorithm_name": "allreduce", "world_size": 4}
    check_compatible(state, model="mlp", algorithm="allreduce", world_size=4)
    check_compatible(state, model="mlp", algorithm="allreduce")


def test_check_compatible_names_both_sides() -> None:
    state = {"model_name": "mlp", "algorithm_name": "allreduce", "world_size": 4}
    with pytest.raises(CheckpointError) as info:
        check_compatible(state, model="cnn1d", algorithm="allreduce")
    assert str(info.value) == (
        "checkpoint was written by model 'mlp' / algorithm 'allreduce'; "
        "this run uses model 'cnn1d' / algorithm 'allreduce'"
    )
    with pytest.raises(CheckpointError) as info:
        check_compatible(state, model="mlp", algorithm="allreduce", world_size=8)
    assert str(info.value) == (
        "checkpoint was written by model 'mlp' / algorithm 'allreduce' / world size 4; "
        "this run uses model 'mlp' / algorithm 'allreduce' / world size 8"
    )
    with pytest.raises(CheckpointError, match="'algorithm_name'"):
        check_compatible({"model_name": "mlp"}, model="mlp", algorithm="dpsgd")


# --- checkpoint sets -------------------------------------------------------------------------


def _stores(run_dir: Path, world_size: int, keep: int = 3) -> list[CheckpointStore]:
    return [CheckpointStore(run_dir, rank, world_size, keep=keep) for rank in range(world_size)]


def _save_set(stores: list[CheckpointStore], step: int, ranks: list[int] | None = None) -> None:
    # Rank 0 last, so that its pruning sees the set complete, as in a run where it is slowest.
    order = ranks if ranks is not None else list(range(1, len(stores))) + [0]
    for rank in order:
        stores[rank].save(step, {"step": step, "rank": rank, "w": torch.full((8,), float(step))})


def test_store_layout_and_complete_versus_incomplete_sets(tmp_path: Path) -> None:
    stores = _stores(tmp_path, world_size=3)
    assert stores[0].latest_complete() is None
    path = stores[2].save(10, {"step": 10, "rank": 2, "w": torch.full((8,), 10.0)})
    assert path == tmp_path / "checkpoints" / "step-00000010" / "rank-0002.pt"
    _save_set(stores, 10, ranks=[0])
    assert stores[1].latest_complete() is None
    _save_set(stores, 10, ranks=[1])
    assert stores[1].latest_complete() == 10
    _save_set(stores, 20, ranks=[0, 2])
    assert stores[0].steps() == [10, 20]
    assert stores[0].latest_complete() == 10
    loaded = stores[1].load(10)
    assert (sorted(loaded), loaded["step"], loaded["rank"]) == (["rank", "step", "w"], 10, 1)
    torch.testing.assert_close(stores[2].load(10)["w"], torch.full((8,), 10.0))


def test_resolve_auto_falls_back_past_damaged_newest_sets(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stores = _stores(tmp_path, world_size=2, keep=10)
    for step in (100, 200, 300, 400):
        _save_set(stores, step)
    _save_set(stores, 500, ranks=[0])  # incomplete: rank 1 has not written yet
    corrupted = stores[0].rank_file(400, rank=1)
    _damage_tensor(corrupted)
    truncated = stores[0].rank_file(300, rank=0)
    with open(truncated, "r+b") as file:
        file.truncate(truncated.stat().st_size // 2)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert stores[1].resolve("auto") == 200
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    missing = stores[0].rank_file(500, rank=1)
    assert any(str(missing) in m and "does not exist" in m for m in warnings), warnings
    assert any(str(corrupted) in m and "checksum mismatch" in m for m in warnings), warnings
    assert any(str(truncated) in m and "damaged" in m for m in warnings), warnings
    assert stores[1].load(200)["rank"] == 1


def test_resolve_none_explicit_step_and_directory(tmp_path: Path) -> None:
    stores = _stores(tmp_path, world_size=2)
    for step in (5, 6):
        _save_set(stores, step)
    store = stores[1]
    assert store.resolve("none") is None
    assert store.resolve("") is None
    assert store.resolve("5") == 5
    assert store.resolve(str(store.step_dir(6))) == 6
    assert store.resolve(str(store.rank_file(5, rank=0))) == 5
    assert store.resolve("auto") == 6

    bad = store.rank_file(6, rank=0)
    _damage_tensor(bad)
    with pytest.raises(CheckpointError) as info:
        store.resolve(str(store.step_dir(6)))
    assert str(info.value) == (
        f"cannot resume from step 6: checkpoint {bad} has a checksum mismatch (corrupted)"
    )
    with pytest.raises(CheckpointError, match=r"rank-0000\.pt does not exist"):
        store.resolve("7")
    with pytest.raises(CheckpointError, match="does not exist"):
        store.resolve(str(tmp_path / "checkpoints" / "step-00000009"))
    with pytest.raises(CheckpointError, match="is not a checkpoint step directory"):
        store.resolve(str(tmp_path))
    other = _stores(tmp_path / "other-run", world_size=2)
    _save_set(other, 5)
    with pytest.raises(CheckpointError, match="is not one of this run's"):
        store.resolve(str(other[0].step_dir(5)))


def test_pruning_keeps_newest_complete_sets(tmp_path: Path) -> None:
    stores = _stores(tmp_path, world_size=2, keep=2)
    for step in range(1, 6):
        _save_set(stores, step)
    assert stores[0].steps() == [4, 5]
    # Rank 0 runs ahead: step 6 is incomplete, so 4 and 5 stay the kept pair.
    _save_set(stores, 6, ranks=[0])
    assert stores[0].steps() == [4, 5, 6]
    _save_set(stores, 6, ranks=[1])
    assert stores[0].steps() == [4, 5, 6]  # only rank 0 prunes
    assert stores[1].prune() == []
    assert stores[0].prune() == [4]
    assert stores[0].steps() == [5, 6]
    assert all(stores[0].rank_file(6, r).exists() for r in range(2))


def test_pruning_never_removes_the_only_complete_set(tmp_path: Path) -> None:
    stores = _stores(tmp_path, world_size=2, keep=1)
    _save_set(stores, 1)
    _save_set(stores, 2, ranks=[0])
    _save_set(stores, 3, ranks=[0])
    assert stores[0].steps() == [1, 2, 3]
    assert stores[0].latest_complete() == 1

    _save_set(stores, 2, ranks=[1])
    assert stores[0].prune() == [1]
    damaged = stores[0].rank_file(2, rank=1)
    _damage_tensor(damaged)
    _save_set(stores, 3, ranks=[1])  # complete 3 exists only for a moment: damage it too
    damaged3 = stores[0].rank_file(3, rank=0)
    _damage_tensor(damaged3)
    assert stores[0].prune() == []
    assert stores[0].steps() == [2, 3]
    assert stores[0].latest_complete() is None


def test_a_set_written_by_the_members_of_an_elastic_run(tmp_path: Path) -> None:
    """After rank 0 was lost, ranks 1-3 write sets that name them: such a set is complete without
    rank 0's file, rank 1 prunes, and rank 0 resumes from rank 1's file."""
    stores = _stores(tmp_path, world_size=4, keep=1)
    _save_set(stores, 8)
    for step in (16, 24):
        for rank in (3, 2, 1):
            stores[rank].save(step, {"step": step, "rank": rank, "members": [1, 2, 3]})
    assert stores[0].latest_complete() == 24 and stores[0].members(24) == [1, 2, 3] and stores[0].members(8) == [0, 1, 2, 3]
    assert stores[0].steps() == [24]  # rank 1, the first member, pruned 8 and 16
    assert [stores[r].source(24) for r in range(4)] == [1, 1, 2, 3]
    assert stores[0].load(24, stores[0].source(24))["rank"] == 1

    for rank in (2, 1):  # rank 3 lost too, before writing step 32
        stores[rank].save(32, {"step": 32, "rank": rank, "members": [1, 2, 3]})
    with pytest.raises(CheckpointError, match="rank-0003.pt"):
        stores[0].resolve("32")
    assert stores[0].latest_complete() == 24
    # A process that had not yet heard of rank 2's loss names it too: the fewest members win.
    stores[3].save(40, {"step": 40, "rank": 3, "members": [1, 3]})
    stores[1].save(40, {"step": 40, "rank": 1, "members": [3, 2, 1]})
    assert stores[0].resolve("40") == 40 and stores[0].members(40) == [1, 3]
    stores[3].save(48, {"step": 48, "rank": 3, "members": [1, 3]})
    stores[1].save(48, {"step": 48, "rank": 1, "members": [1, 2]})
    with pytest.raises(CheckpointError, match="names members"):
        stores[0].resolve("48")


def test_store_rejects_bad_settings(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="keep"):
        CheckpointStore(tmp_path, 0, 2, keep=0)
    with pytest.raises(ConfigError, match="rank"):
        CheckpointStore(tmp_path, 2, 2)
    with pytest.raises(ConfigError, match="world_size"):
        CheckpointStore(tmp_path, 0, 0)
    with pytest.raises(ConfigError, match="step"):
        CheckpointStore(tmp_path, 0, 1).save(-1, {})


# --- crash safety ----------------------------------------------------------------------------

_KILL_ELEMENTS = 256 * 1024  # two float32 tensors of 1 MiB each per version


def _kill_version(step: int) -> dict[str, Any]:
    """What the child writes at ``step``: two alternating versions whose bytes all differ."""
    version = step % 2
    base = torch.arange(_KILL_ELEMENTS, dtype=torch.float32)
    return {
        "step": step,
        "version": f"v{version}",
        "a": base * (version + 2),
        "b": (base + 0.5) * -(version + 1),
    }


def _save_until_killed(path: str, ready: Any) -> None:
    """Child process: save alternating versions forever, saying so after the first one lands."""
    deadline = time.monotonic() + 60  # never outlive a parent that died without killing it
    versions = [_kill_version(0), _kill_version(1)]
    step = 0
    while time.monotonic() < deadline:
        save_checkpoint(path, dict(versions[step % 2], step=step))
        if step == 0:
            ready.send_bytes(b"saved")
            ready.close()
        step += 1


@pytest.mark.skipif(
    sys.platform == "win32" or "forkserver" not in mp.get_all_start_methods(),
    reason="needs SIGKILL and the forkserver start method",
)
def test_sigkill_during_saves_always_leaves_a_complete_checkpoint(tmp_path: Path) -> None:
    # Forkserver children fork from a server that has already imported torch and this module,
    # so each of the 20 trials starts in milliseconds instead of re-importing torch.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "distrain.runtime.checkpoint", __name__])
    rng = random.Random(20240611)
    expected = {0: _kill_version(0), 1: _kill_version(1)}
    killed_mid_write = 0
    for trial in range(20):  # about 60% of the kills land mid-write
        path = tmp_path / f"trial-{trial:02d}" / "ckpt.pt"
        receiver, sender = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_save_until_killed, args=(str(path), sender), daemon=True)
        child.start()
        sender.close()
        try:
            assert receiver.poll(timeout=30), f"trial {trial}: child never finished a first save"
            assert receiver.recv_bytes() == b"saved"
            time.sleep(rng.uniform(0.0, 0.04))
            os.kill(child.pid, signal.SIGKILL)
        finally:
            if child.is_alive():
                child.kill()
            child.join(timeout=10)
            receiver.close()
        assert child.exitcode == -signal.SIGKILL, f"trial {trial}: exit code {child.exitcode}"
        killed_mid_write += any(p.name.endswith(".tmp") for p in path.parent.iterdir())

        state = load_checkpoint(path)
        reference = dict(expected[state["step"] % 2], step=state["step"])
        _assert_same(state, reference)
    # The kills must land during writes, or the test proves nothing about atomicity.
    assert killed_mid_write >= 5, killed_mid_write


def test_a_set_is_read_with_the_number_of_processes_that_wrote_it(tmp_path: Path) -> None:
    """A run resumed with another number of workers: a set of 4 files naming set_size 4 is complete
    for a store of 2 or of 6 (and one of 3 files of it is not); a newer set written over an
    unfinished one by fewer workers counts with theirs."""
    for rank in (3, 2, 1, 0):
        CheckpointStore(tmp_path, rank, 4).save(8, {"step": 8, "rank": rank, "set_size": 4})
    for world in (2, 6):
        store = CheckpointStore(tmp_path, world - 1, world)
        assert store.latest_complete() == 8 and store.members(8) == [0, 1, 2, 3]
    assert CheckpointStore(tmp_path, 5, 6).source(8) == 0 and CheckpointStore(tmp_path, 1, 2).source(8) == 1
    for rank in (2, 1, 0):  # worker 3 died before writing step 16
        CheckpointStore(tmp_path, rank, 4).save(16, {"step": 16, "rank": rank, "set_size": 4})
    assert CheckpointStore(tmp_path, 0, 2).latest_complete() == 8
    stale = CheckpointStore(tmp_path, 0, 2).rank_file(16, 2)
    os.utime(stale, (1, 1))  # written long before the 2 workers' files of the same step
    for rank in (1, 0):
        CheckpointStore(tmp_path, rank, 2, keep=10).save(16, {"step": 16, "rank": rank, "set_size": 2})
    assert CheckpointStore(tmp_path, 0, 2).latest_complete() == 16
    assert CheckpointStore(tmp_path, 0, 2).members(16) == [0, 1]


def test_an_asynchronous_run_is_finished_when_its_budget_was_used_up_and_has_not_grown(tmp_path):
    """Asynchronous workers end at different steps, so the set's step does not say whether the
    run finished: its ``budget_done`` does, against the planned steps (or --time-budget) then and
    now. Every worker decides from its own file alike, and the message names the time budget."""
    from distrain.algorithms.gossip import GOSSIP_CLOCK, GOSSIP_COUNTS
    from distrain.train.resume import (
        BUDGET_DONE_KEY,
        already_finished,
        finished_message,
        nothing_left,
    )

    final = {"step": 12, "total_steps": 15, "steps_per_epoch": 15, BUDGET_DONE_KEY: True,
             "algorithm": {GOSSIP_COUNTS: [12, 17, 22, 16], GOSSIP_CLOCK: 8.04}}
    assert nothing_left(final, 15)  # a slow worker's file (12 < 15): the run is finished all the same
    assert not nothing_left(final, 30)  # a larger --epochs goes on
    assert nothing_left(final, 15, time_budget=8.0) and not nothing_left(final, 15, time_budget=10.0)
    stopped = {**final, BUDGET_DONE_KEY: False}  # saved at a stop: never finished
    assert not nothing_left(stopped, 15) and not nothing_left({**stopped, "step": 40}, 15)
    assert nothing_left({"step": 15}, 15) and not nothing_left({"step": 14}, 15)  # synchronous: the step
    result = already_finished(tmp_path, final)
    assert result["finished_step"] == 22  # the furthest worker's
    assert "in 8.0 s, all that --time-budget 8 asks for" in finished_message(result, 1.0, time_budget=8.0)
    assert "all that --epochs 1 asks for" in finished_message(result, 1.0)
