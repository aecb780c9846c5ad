"""What travels between parameter-server workers and servers besides gradients and parameters: header clocks, the start header's checks, optimizer state as tensors.

See :mod:`distrain.algorithms.parameter_server` for how the pieces fit.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from distrain.comm.transport import Transport
from distrain.errors import WorkerFailure

HEADER = 3  # shard_numel, total_steps, steps_per_epoch
#: The clock a worker pushes when its training has ended (no gradient follows).
STOP = -1
#: The clock of a worker's header that announces a takeover of a lost server's ranges (a
#: :data:`TAKEOVER_FIELDS` message follows; see :meth:`ShardServer._take_over`).
TAKEOVER = -2
#: The takeover message: lost server, the worker that sends its parameters, the step redone,
#: the number of parameters (the whole model's). Asynchronous servers: lost server, the
#: takeover's place in the run's order of takeovers, the push redone (:data:`NO_REDO`: none),
#: the number of parameters.
TAKEOVER_FIELDS = 4
#: An asynchronous takeover message's push redone when none is: only the parameters follow.
NO_REDO = -1
#: A synchronous server's optimizer state (a checkpoint's, or its answer to :data:`STATE`) while
#: it holds a lost server's ranges: the run's shards and, part by part, the ranges it holds and
#: their optimizer state, from which every server's own shard is put together again.
TAKEOVER_STATE_KEY = "takeover"
#: The clock of a worker's header that asks the server for its optimizer state (the state
#: follows, :func:`send_state`; the worker's next header is its push as usual).
STATE = -3
#: Store keys of the workers' agreement on a lost server (see :meth:`ParameterServer._agree`).
TAKEOVER_KEY = "distrain/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/ps/takeover/{}/{}"
#: Store keys of a lost server's answer of a step, offered by a worker it answered to those it
#: did not (see :meth:`ParameterServer._agree`): its life, then the step.
ANSWER_KEY = "distrain/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/ps/takeover-answer/{}/{}"
#: Store keys of the synchronous takeovers the servers made (hierarchical, elastic): the lost
#: server's life (see :func:`~distrain.algorithms.parameter_server.elastic.server_life`); the value
#: is the takeover's place in the servers' order (1 for the first lost server). A node's worker
#: that becomes its pusher takes them in that order (:meth:`ParameterServer._follow_takeovers`).
TAKEN_OVER_KEY = "distrain/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/ps/taken-over/{}"
#: Store keys of the order of asynchronous takeovers: the n-th lost server (see
#: :meth:`ParameterServer._take_over_async`).
ASYNC_TAKEOVER_KEY = "distrain/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/ps/async-takeover/{}"
#: Store keys of what a synchronous server heard last from a node's pusher row (hierarchical,
#: elastic): its server index, then the row; the value is ``stop`` once the row's STOP arrived,
#: else the rank of the node's worker it took for the row's pusher after its leader was lost
#: (see :meth:`ParameterServer._send_stop_for_lost_leader`).
NODE_ROW_KEY = "distrain/" + os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/ps/node-row/{}/{}"
#: The largest shard a server accepts, and worker 0 sends (float32 parameters): 8 GiB.
MAX_SHARD_BYTES = 2**33
#: The largest layout of an optimizer state a worker or server accepts (JSON bytes).
MAX_STATE_META = 2**20
#: Shard-sized buffers a server keeps besides one gradient per pusher: the shard, its gradient,
#: optimizer state.
SERVER_COPIES = 3
GIB = 2**30


def send_state(transport: Transport, state: dict[str, Any], dst: int) -> None:
    """Send a nested dict of tensors and plain values (numbers, strings, booleans, None, lists)
    to ``dst``, never pickled: its layout as JSON bytes (each tensor named by position, dtype and
    shape), then every tensor. :func:`recv_state` rebuilds it."""
    tensors: list[torch.Tensor] = []

    def layout(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value.detach().reshape(-1).contiguous())
            return {"__tensor__": len(tensors) - 1, "dtype": str(value.dtype).removeprefix("torch."),
                    "shape": list(value.shape)}
        if isinstance(value, dict):
            return {"__dict__": [[layout(k), layout(v)] for k, v in value.items()]}  # keys keep their type
        if isinstance(value, (list, tuple)):
            return [layout(v) for v in value]
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise TypeError(f"cannot send a {type(value).__name__} in an optimizer state")

    meta = json.dumps(layout(state)).encode()
    handles = [transport.send(torch.tensor([len(meta)], dtype=torch.int64), dst),
               transport.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8), dst)]
    handles += [transport.send(t, dst) for t in tensors]
    for h in handles:
        h.wait()


def recv_state(transport: Transport, src: int) -> dict[str, Any]:
    """The state :func:`send_state` sent from ``src``."""
    size = torch.zeros(1, dtype=torch.int64)
    transport.recv(size, src).wait()
    if not 0 < int(size) <= MAX_STATE_META:
        raise WorkerFailure(f"malformed optimizer state from rank {src}: {int(size)} bytes of layout")
    meta = torch.zeros(int(size), dtype=torch.uint8)
    transport.recv(meta, src).wait()
    layout = json.loads(bytes(meta.tolist()).decode())

    def build(value: Any) -> Any:
        if isinstance(value, dict) and "__tensor__" in value:
            dtype = getattr(torch, str(value["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise WorkerFailure(f"malformed optimizer state from rank {src}: dtype {value['dtype']!r}")
            out = torch.zeros(int(torch.Size(value["shape"]).numel()), dtype=dtype)
            transport.recv(out, src).wait()  # in the order they were sent: depth first, as laid out
            return out.reshape(value["shape"])
        if isinstance(value, dict) and "__dict__" in value:
            return {build(k): build(v) for k, v in value["__dict__"]}
        if isinstance(value, list):
            return [build(v) for v in value]
        return value

    return build(layout)


def physical_memory() -> int | None:
    """Bytes of memory of this machine (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_start_header(values: list[int], pushers: int, memory: int | None) -> tuple[int, int, int]:
    """``(shard_numel, total_steps, steps_per_epoch)`` of a server's start header, checked before
    anything is allocated; WorkerFailure naming what is wrong otherwise.

    Example::

        numel, total, per_epoch = check_start_header(header.tolist(), pushers=4, memory=physical_memory())
    """
    if len(values) != HEADER:
        raise WorkerFailure(f"malformed start header {values}: {len(values)} values, expected {HEADER}")
    numel, total_steps, steps_per_epoch = values
    if total_steps <= 0 or steps_per_epoch <= 0:
        raise WorkerFailure(f"malformed start header {values}: run length must be positive")
    if numel <= 0 or numel * 4 > MAX_SHARD_BYTES:
        raise WorkerFailure(f"start header announces a shard of {numel} parameters; a server accepts 1 to "
                            f"{MAX_SHARD_BYTES // 4} ({MAX_SHARD_BYTES / GIB:g} GiB)")
    need = numel * 4 * (SERVER_COPIES + pushers)
    if memory is not None and need > memory:
        raise WorkerFailure(f"a shard of {numel} parameters needs {need / GIB:.1f} GiB on its server "
                            f"({SERVER_COPIES + pushers} copies), more than this machine's {memory / GIB:.1f} GiB; "
                            "use more --servers")
    return numel, total_steps, steps_per_epoch
