"""Typed, validated run configuration; every leaf field is one command-line flag.

A ``TrainConfig`` is made of small sections (data, model, optim, run, cluster, algo). Each leaf
field ``foo_bar`` is the flag ``--foo-bar``; field names are unique across sections so the
mapping stays one-to-one. Validation raises :class:`~distrain.errors.ConfigError` naming the
flag and what is allowed.

Example::

    from distrain.config import TrainConfig
    cfg = TrainConfig.from_dict({"workers": 2, "epochs": 3, "model": "mlp"})
    cfg.validate()
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distrain.errors import ConfigError, flag

#: The value a setting marked ``auto`` accepts besides its type: distrain chooses it during the run.
AUTO = "auto"


def _opt(default: Any, help: str, choices: tuple[str, ...] | Callable[[], tuple[str, ...]] | None = None,
         *, auto: bool = False) -> Any:
    """A setting: its default, its help line, and its allowed values (the one place they are written).

    ``choices`` is a tuple, or a function returning the names of a registry (imported when asked,
    so that this module imports no algorithm). ``auto``: the setting also takes :data:`AUTO`.
    """
    return field(default=default, metadata={"help": help, "choices": choices, "auto": auto})


def takes_auto(name: str) -> bool:
    """Whether the setting ``name`` accepts :data:`AUTO` besides its type."""
    return bool(_FIELD_OF[name].metadata.get("auto"))


def choices_of(f: dataclasses.Field) -> tuple[str, ...] | None:
    """The allowed values of a setting, or None when any value of its type may be given."""
    choices = f.metadata.get("choices")
    return tuple(choices()) if callable(choices) else choices


def check_choices(section: Any) -> None:
    """Raise ConfigError for the first setting of ``section`` that is not one of its choices."""
    for f in dataclasses.fields(section):
        choices = choices_of(f)
        value = getattr(section, f.name)
        if choices is not None and value is not None:
            check_choice(f.name, value, choices)


def _datasets() -> tuple[str, ...]:
    from distrain.data import DATASETS

    return tuple(DATASETS)


def _task_choices() -> tuple[str, ...]:
    from distrain.tasks import TASKS

    return ("auto", *TASKS)


def _gpt_sizes() -> tuple[str, ...]:
    from distrain.models.gpt import GPT_SIZES

    return tuple(GPT_SIZES)


def _algorithms() -> tuple[str, ...]:
    from distrain.algorithms import ALGORITHMS

    return tuple(sorted(ALGORITHMS))


def _topologies() -> tuple[str, ...]:
    from distrain.topology import TOPOLOGIES

    return tuple(TOPOLOGIES)


def _mixings() -> tuple[str, ...]:
    from distrain.topology import MIXINGS

    return tuple(MIXINGS)


def _presets() -> tuple[str, ...]:
    from distrain.emulation.network import PRESETS

    return tuple(PRESETS)


def _emulation_modes() -> tuple[str, ...]:
    from distrain.emulation.network import MODES

    return MODES


def check_positive(name: str, value: float, *, integer: bool = False, allow_zero: bool = False) -> None:
    """Raise ConfigError unless ``value`` is a finite number > 0 (or >= 0 with allow_zero)."""
    kind = "an integer" if integer else "a finite number"
    bound = ">= 0" if allow_zero else "> 0"
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= 0 if allow_zero else value > 0)
    if integer:
        ok = ok and float(value).is_integer()
    if not ok:
        raise ConfigError(flag(name), f"must be {kind} {bound}, got {value!r}")


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise ConfigError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ConfigError(flag(name), f"unknown value {value!r}; choose one of: {', '.join(choices)}")


def check_run_name(name: str) -> None:
    """A run name is one path component: it names a directory under ``runs/``, never one elsewhere."""
    bad = not name or name in (".", "..") or "\0" in name or any(sep in name for sep in ("/", "\\", os.sep))
    if bad:
        raise ConfigError("--name", f"must be one path component (no '/', '\\' or '..'), got {name!r}")


def check_run_dir(run_dir: str | Path) -> None:
    """Raise ConfigError unless ``run_dir`` is, or can be created as, a directory this process can write."""
    path = Path(run_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError("--run-dir", f"{str(run_dir)!r} exists and is not a directory")
    existing = path
    while not existing.exists():  # the nearest ancestor that exists must be a directory we can write
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError("--run-dir", f"cannot create {str(run_dir)!r}: {str(existing)!r} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError("--run-dir", f"{str(existing)!r} is not writable by this user")


@dataclass
class DataConfig:
    """Which data set, how it is split among workers, and the per-worker batch size."""

    dataset: str = _opt("mnist1d", "data set", _datasets)
    data_path: str | None = _opt(None, "file or directory for npz / idx / shards data sets")
    num_samples: int = _opt(20000, "samples to generate for mnist1d / synthetic (train + test)")
    partition: str = _opt("iid", "how training data is split among workers", ("iid", "dirichlet"))
    dirichlet_alpha: float = _opt(0.5, "Dirichlet concentration for --partition dirichlet (small = skewed)")
    batch_size: int = _opt(64, "samples per worker per step")
    task: str = _opt("auto", "what the targets are: classification (class indices; cross-entropy, accuracy), "
                     "regression (values; mean squared error, on your own data set), lm (next tokens; loss in "
                     "nats per token, bits per byte), or auto (lm for --dataset text, else classification)",
                     _task_choices)
    context: int = _opt(128, "text: tokens per window, the language model's context")
    tokenizer: str = _opt("bytes", "text: bytes (256 byte tokens) or bpe:N (a byte-level BPE of N tokens trained on the "
                          "training text, cached; needs pip install 'distrain[lm]')")

    def validate(self) -> None:
        check_choices(self)
        if self.dataset == "text" and self.task_name() != "lm":  # its windows of tokens have no labels
            raise ConfigError("--task", f"--dataset text trains a language model (--task lm, or auto); {self.task} "
                                        "needs a labelled data set")
        if self.task_name() != "classification" and self.partition != "iid":
            raise ConfigError("--partition", f"{self.partition} splits by class; {self.task_name()} targets have none: "
                                             "use iid")
        check_positive("context", self.context, integer=True)
        self.check_tokenizer()
        if self.dataset in ("npz", "idx", "shards") and not self.data_path:
            raise ConfigError("--data-path", f"is required for --dataset {self.dataset}")
        check_positive("num_samples", self.num_samples, integer=True)
        check_positive("dirichlet_alpha", self.dirichlet_alpha)
        check_positive("batch_size", self.batch_size, integer=True)

    def check_tokenizer(self) -> None:
        """A valid ``--tokenizer`` for this data set, and the package a BPE needs, installed."""
        from distrain.data.tokenizer import parse_tokenizer, require_tokenizers

        spec = parse_tokenizer(self.tokenizer)
        if spec.kind != "bytes" and self.dataset != "text":
            raise ConfigError("--tokenizer", f"{spec} tokenizes --dataset text, not {self.dataset}")
        if spec.kind != "bytes":
            require_tokenizers(spec)

    def task_name(self) -> str:
        """The task, with ``auto`` resolved: ``lm`` for text, else ``classification``."""
        if self.task != "auto":
            return self.task
        return "lm" if self.dataset == "text" else "classification"


@dataclass
class ModelConfig:
    """Which model to train."""

    model: str = _opt("cnn1d", "mlp, cnn1d, cnn2d, gpt (a language model, for --dataset text), or a user factory "
                      "'package.module:function'")
    model_width: int | None = _opt(None, "hidden units (mlp) or channels (cnn); model default if unset")
    model_depth: int | None = _opt(None, "hidden layers (mlp) or conv layers (cnn); model default if unset")
    model_size: str = _opt("nano", "gpt: nano (~0.2M parameters), micro (~1M), small (~6M), medium (~25M), base "
                           "(~85M); --model-width / --model-depth override", _gpt_sizes)

    def validate(self) -> None:
        from distrain.models import MODELS

        if ":" not in self.model:
            check_choice("model", self.model, tuple(MODELS) + ("package.module:factory",))
        check_choices(self)
        for name in ("model_width", "model_depth"):
            if getattr(self, name) is not None:
                check_positive(name, getattr(self, name), integer=True)


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule (linear scaling rule with warm-up)."""

    optimizer: str = _opt("sgd", "sgd (with momentum), adam, or lars", ("sgd", "adam", "lars"))
    lr: float = _opt(0.1, "learning rate for --reference-batch samples per step")
    momentum: float = _opt(0.9, "momentum (sgd, lars); beta1 for adam")
    weight_decay: float = _opt(0.0, "L2 weight decay")
    lr_scaling: bool = _opt(True, "linear scaling rule: lr x global batch / --reference-batch "
                             "(diloco: x one worker's batch, the samples of an inner step)")
    reference_batch: int = _opt(64, "samples per optimizer step at which --lr applies unscaled")
    warmup_epochs: float = _opt(1.0, "epochs of linear warm-up from --lr to the scaled lr (0 = none)")
    lr_decay: str = _opt("cosine", "decay after warm-up", ("cosine", "step", "none"))

    def validate(self) -> None:
        check_choices(self)
        check_positive("lr", self.lr)
        check_positive("momentum", self.momentum, allow_zero=True)
        if self.momentum >= 1:
            raise ConfigError("--momentum", f"must be in [0, 1), got {self.momentum!r}")
        check_positive("weight_decay", self.weight_decay, allow_zero=True)
        check_positive("reference_batch", self.reference_batch, integer=True)
        check_positive("warmup_epochs", self.warmup_epochs, allow_zero=True)


@dataclass
class RunConfig:
    """How long to train, where results go, evaluation, checkpoints."""

    epochs: float = _opt(15, "passes over the training data (global samples / total training samples)")
    seed: int = _opt(0, "random seed; worker r seeds its data order with seed + r")
    run_dir: str | None = _opt(None, "run directory (default: runs/<name>)")
    name: str | None = _opt(None, "run name (default: <algorithm>-<dataset>-<time>)")
    eval_every: float = _opt(1.0, "evaluate the test accuracy every this many epochs")
    eval_samples: int = _opt(0, "evaluations during the run use this many test samples, evenly spread over the test set "
                             "(the same ones each time; time_to_target_s is judged on them); the final evaluation "
                             "uses them all (0 = all samples every time)")
    target_accuracy: float = _opt(0.95, "test accuracy whose first crossing gives time_to_target_s")
    target_loss: float | None = _opt(None, "test loss whose first crossing (at or below) gives time_to_target_s "
                                     "instead of --target-accuracy (regression: the mean squared error)")
    stop_at_target: bool = _opt(False, "end the run at the first evaluation that reaches the target (--target-loss, "
                                "else --target-accuracy) instead of after --epochs; synchronous algorithms and the "
                                "DDP baselines")
    checkpoint_every: int = _opt(0, "save a checkpoint every this many steps (0 = only at the end)")
    resume: str = _opt("none", "'auto' (newest valid checkpoint in --run-dir), 'none', or a checkpoint step directory")
    overwrite: bool = _opt(False, "start afresh in a --run-dir that holds an earlier run: its config, metrics, summary, "
                           "checkpoints and report are removed first")
    progress: bool = _opt(True, "show a progress bar")
    threads: int = _opt(1, "torch intra-op threads per worker process")
    on_nonfinite: str = _opt("stop", "a NaN or infinite loss or gradient (found before anything is sent): stop the run "
                             "naming the worker and step, or skip = drop that worker's gradient for the step", ("stop", "skip"))

    def validate(self) -> None:
        check_positive("epochs", self.epochs)
        check_positive("eval_every", self.eval_every)
        check_positive("eval_samples", self.eval_samples, integer=True, allow_zero=True)
        if not (0 < self.target_accuracy <= 1):
            raise ConfigError("--target-accuracy", f"must be in (0, 1], got {self.target_accuracy!r}")
        if self.target_loss is not None:
            check_positive("target_loss", self.target_loss)
        check_positive("checkpoint_every", self.checkpoint_every, integer=True, allow_zero=True)
        check_positive("threads", self.threads, integer=True)
        check_choices(self)
        if self.seed < 0:
            raise ConfigError("--seed", f"must be an integer >= 0, got {self.seed!r}")
        if self.name is not None:
            check_run_name(self.name)
        if self.run_dir is not None and not str(self.run_dir).strip():  # (it meant the default, runs/<name>)
            raise ConfigError("--run-dir", f"must name a directory (leave it out for runs/<name>), got {self.run_dir!r}")
        if self.overwrite and self.resume != "none":
            raise ConfigError("--overwrite", f"replaces an earlier run, so it cannot be combined with --resume {self.resume}")


@dataclass
class ClusterConfig:
    """How many workers, where they meet, and how long any wait may last."""

    workers: int = _opt(4, "worker processes (local launch); under torchrun WORLD_SIZE decides")
    backend: str = _opt("auto", "torch.distributed backend: gloo, nccl, or auto", ("auto", "gloo", "nccl"))
    device: str = _opt("cpu", "cpu or cuda", ("cpu", "cuda"))
    master_addr: str = _opt("127.0.0.1", "address of rank 0 (local runs bind loopback)")
    master_port: int = _opt(0, "port of rank 0 (0 = pick a free one)")
    timeout: float = _opt(120.0, "seconds any collective or peer may take before the run fails")
    min_workers: int = _opt(1, "elastic runs: the survivors of a lost worker go on while at least this many workers "
                            "remain; --min-workers equal to --workers stops the run on any loss")
    max_restarts: int = _opt(0, "elastic runs (allreduce, diloco, dpsgd, d2, ps, adpsgd, prague; local launch): start a worker that died "
                             "again, up to this many times in all; it joins the others at a step's end with their state")

    def validate(self) -> None:
        check_positive("workers", self.workers, integer=True)
        check_positive("min_workers", self.min_workers, integer=True)
        check_positive("max_restarts", self.max_restarts, integer=True, allow_zero=True)
        if self.min_workers > self.workers:
            raise ConfigError("--min-workers", f"must be at most --workers ({self.workers}), got {self.min_workers}")
        check_choices(self)
        if not (0 <= self.master_port <= 65535):
            raise ConfigError("--master-port", f"must be in 0..65535, got {self.master_port!r}")
        check_positive("timeout", self.timeout)


@dataclass
class AlgoConfig:
    """Which training algorithm and its knobs."""

    algorithm: str = _opt("allreduce", "training algorithm", _algorithms)
    bucket_mb: float = _opt(25.0, "gradient bucket size in MB for allreduce (communication overlaps backward)")
    first_bucket_mb: float = _opt(0.0, "allreduce: size in MB of the first bucket (the last layers, whose gradients "
                                  "come first), so that its all-reduce starts early in backward; 0 = --bucket-mb "
                                  "(DDP's rule when bucket_cap_mb is given; DDP's default uses 1)")
    ring: str = _opt("auto", "all-reduce implementation: auto = the backend's collective, and on the CPU recursive "
                     "doubling over point-to-point for buckets of at most 256 kB (log2(n) rounds instead of 2(n-1)); "
                     "gloo = the backend's collective only; own = our ring over point-to-point",
                     ("auto", "gloo", "own"))
    workers_per_node: int = _opt(0, "hierarchical aggregation (allreduce, ps): ranks per node (reduce inside a node, "
                                 "all-reduce among node leaders or push to the servers, broadcast inside the node; "
                                 "links inside a node are not emulated); 0 = flat")
    topology: str = _opt("ring", "decentralized algorithms (dpsgd, d2, adpsgd): who exchanges models with whom",
                         _topologies)
    mixing: str = _opt("lazy", "gossip weights: uniform over neighbours and self (regular graphs only), "
                       "Metropolis-Hastings (any graph), or lazy = (I + Metropolis) / 2 (no negative eigenvalues, "
                       "which cost accuracy with momentum)", _mixings)
    gossip_order: str = _opt("cta", "dpsgd: cta = x <- W x - lr g (Lian et al. 2017; the exchange overlaps forward and "
                             "backward), atc = x <- W (x - lr g) (exchange after the update)", ("cta", "atc"))

    def validate(self) -> None:
        check_choices(self)
        check_positive("bucket_mb", self.bucket_mb)
        check_positive("first_bucket_mb", self.first_bucket_mb, allow_zero=True)
        check_positive("workers_per_node", self.workers_per_node, integer=True, allow_zero=True)


@dataclass
class ServerConfig:
    """Parameter-server layout for --algorithm ps."""

    servers: int = _opt(1, "server processes besides the workers (--algorithm ps); each owns one shard")
    ps_mode: str = _opt("sync", "sync: each step waits for all workers; async: servers apply pushes as they arrive", ("sync", "async"))
    max_staleness: int = _opt(0, "async: how many pushes a worker may run ahead of the slowest (0 = lockstep)")

    def validate(self) -> None:
        check_positive("servers", self.servers, integer=True)
        check_choices(self)
        check_positive("max_staleness", self.max_staleness, integer=True, allow_zero=True)


@dataclass
class NetworkConfig:
    """The network the workers see: real, or emulated (in-process link model or shaped namespaces).

    A preset (``--network``) sets several fields at once; explicit flags override it field by
    field. See ``distrain.emulation`` for the model and the bandwidth-trace file format.
    """

    network: str = _opt("none", "emulated network preset ('none' = the real network)", _presets)
    bandwidth: str | None = _opt(None, "every worker's link bandwidth, e.g. 100mbit, 1gbit, 500kbit; None: the preset's, or unlimited")
    latency: str | None = _opt(None, "one-way latency of every message, e.g. 5ms, 100us; None: the preset's, or 0")
    jitter: str | None = _opt(None, "latency varies uniformly by +- this much per message, e.g. 1ms")
    slow_worker: str | None = _opt(None, "compute slowdown RANK:FACTOR, comma-separated, e.g. 2:4x or last:4x")
    slow_link: str | None = _opt(None, "a worker's own link bandwidth RANK:BANDWIDTH, comma-separated, e.g. 3:10mbit")
    bandwidth_trace: str | None = _opt(None, "CSV (time_s,worker,bandwidth) or JSON file: bandwidth per worker over time")
    emulation: str = _opt("model", "how the network is emulated: in-process link model, or shaped network namespaces (Linux, root)",
                          _emulation_modes)

    def validate(self) -> None:
        from distrain.emulation import NetworkSettings

        check_choices(self)
        NetworkSettings.from_config(self)  # raises ConfigError naming the flag (or the trace file's line)


#: The density warm-up a sparsifier gets unless told otherwise: one dense epoch, then the kept
#: ratio falls from 1 to its target over two (Deep Gradient Compression warms up the same way).
#: Without it, ``group_topk:0.01`` on the default job ended 0.05 to 1.5 points below dense over
#: seeds 0-4; see ``benchmarks/bench_sparse_accuracy.py``.
SPARSIFIER_WARMUP = (1.0, 2.0)

#: ... and with that default warm-up, a kept ratio of at least 5% until epoch 6 (or 40% of a
#: shorter run's epochs), then a fall to the target over the decay's epochs, with momentum
#: correction's masking off. With 1% from epoch 3 the default job sat on a plateau that it left
#: epochs after dense training, and ended 0.2 to 1.3 points below dense over seeds 0-4: at 1%
#: most coordinates wait, but at the ratios on the way down to it (25% to 2%) the useful ones are
#: sent at nearly every step, and masking then zeroes their momentum at every step (SGD without
#: it). The hold, without masking, kept it within 0.6 points of dense on seeds 0-9 for about
#: 1.2 times the bytes of the plain schedule (about a fifth of dense's); see
#: ``benchmarks/bench_sparse_accuracy.py``.
SPARSIFIER_HOLD = (0.05, 6.0, 0.4)


@dataclass
class CompressConfig:
    """Gradient compression: what is sent instead of dense tensors (see ``distrain.compress``).

    With a density warm-up the run is dense for ``density_warmup_epochs``, then the kept ratio
    falls exponentially from 1 to the spec's ratio over ``density_decay_epochs``.
    """

    compress: str = _opt("none", "compressor spec: none, fp16, bf16, topk:RATIO, randomk:RATIO, "
                         "group_topk:RATIO[:group=N], qsgd:8bit|4bit, int8|int4[:block=N], "
                         "sparseloco:RATIO[:bits=B][:chunk=N][:decay=D] (RATIO = kept fraction in (0, 1])")
    error_feedback: str = _opt("on", "keep what a lossy compressor dropped and add it to the next step", ("on", "off"))
    sparse_collective: str = _opt("allgather", "how sparse payloads (topk, group_topk) are summed: all-gather of "
                                  "every worker's payload (n - 1 latency-bound rounds when all workers keep the same "
                                  "count), or the sparse ring reduce-scatter + all-gather (2(n - 1) rounds; fewer bytes "
                                  "when workers are many and their indices overlap)", ("ring", "allgather"))
    momentum_correction: str = _opt("on", "with a sparsifier and SGD, apply momentum on each worker before compressing "
                                    "(Deep Gradient Compression)", ("on", "off"))
    density_warmup_epochs: float | None = _opt(None, "epochs of dense all-reduce before compression starts "
                                               f"(unset: {SPARSIFIER_WARMUP[0]:g} with a sparsifier, else 0)")
    density_decay_epochs: float | None = _opt(None, "epochs after the warm-up over which the kept ratio falls "
                                              "exponentially from 1 to RATIO "
                                              f"(unset: {SPARSIFIER_WARMUP[1]:g} with a sparsifier, else 0; with "
                                              f"both unset, a sparsifier also keeps at least "
                                              f"{SPARSIFIER_HOLD[0]:g} until epoch {SPARSIFIER_HOLD[1]:g} (or {SPARSIFIER_HOLD[2]:g} of a shorter run's epochs), then falls "
                                              "to RATIO over as many epochs, without momentum masking)")

    def validate(self) -> None:
        from distrain.compress import validate_spec

        validate_spec(self.compress)
        check_choices(self)
        for name in ("density_warmup_epochs", "density_decay_epochs"):
            if getattr(self, name) is not None:
                check_positive(name, getattr(self, name), allow_zero=True)

    def _sparsifier(self) -> bool:
        """Whether ``compress`` keeps a ratio of the gradient (topk, group_topk, randomk, adaptive,
        sparseloco): what the default warm-up and hold apply to."""
        from distrain.compress import build_compressor

        return self.compress.strip() != "none" and build_compressor(self.compress).ratio is not None

    def density_schedule(self) -> tuple[float, float]:
        """(warm-up, decay) epochs: as set, else :data:`SPARSIFIER_WARMUP` for a sparsifier, else no warm-up."""
        auto = SPARSIFIER_WARMUP if self._sparsifier() else (0.0, 0.0)
        warmup, decay = self.density_warmup_epochs, self.density_decay_epochs
        return (auto[0] if warmup is None else float(warmup), auto[1] if decay is None else float(decay))

    def density_hold(self, epochs: float) -> tuple[float, float]:
        """(hold ratio, until epoch) in a run of ``epochs``: :data:`SPARSIFIER_HOLD` for a
        sparsifier on the default density warm-up (neither of its flags set), else none (0, 0)."""
        default = self.density_warmup_epochs is None and self.density_decay_epochs is None
        if not (default and self._sparsifier()):
            return 0.0, 0.0
        ratio, until, share = SPARSIFIER_HOLD
        return ratio, min(until, share * epochs)


@dataclass
class GossipConfig:
    """Asynchronous gossip (--algorithm adpsgd, prague): how long each worker trains, groups,
    timeouts, and the snapshots the consensus is evaluated from (see ``algorithms/gossip.py``)."""

    budget: str = _opt("global", "when an asynchronous worker stops: global = all workers together make --epochs passes "
                       "(faster workers take more steps), local = --epochs passes over its own shard, time = "
                       "--time-budget seconds", ("global", "local", "time"))
    time_budget: float = _opt(60.0, "seconds each worker trains with --budget time")
    group_size: int = _opt(0, "prague: workers per partial all-reduce group (0 = 3, but at most workers // 2 so that "
                           "two groups fit)")
    max_lag: int = _opt(2, "steps a worker may take since its last averaging before it waits for the next one (0 = no "
                        "bound); keeps models close when computing outruns the network")
    peer_timeout: float = _opt(120.0, "seconds a gossip exchange or a wait for a group may take before the run fails "
                                      "(elastic runs: before the peer is dropped, after twice this while its heartbeat "
                                      "goes on; a peer whose heartbeat stopped is dropped a few seconds after it)")
    snapshot_every: float = _opt(1.0, "seconds between copies of every worker's model; their averages (the consensus "
                                 "over time) are evaluated after training")

    def validate(self) -> None:
        check_choices(self)
        check_positive("time_budget", self.time_budget)
        check_positive("group_size", self.group_size, integer=True, allow_zero=True)
        if self.group_size == 1:
            raise ConfigError("--group-size", "must be 0 (automatic) or an integer >= 2, got 1")
        check_positive("max_lag", self.max_lag, integer=True, allow_zero=True)
        check_positive("peer_timeout", self.peer_timeout)
        check_positive("snapshot_every", self.snapshot_every)


@dataclass
class OuterConfig:
    """Local steps with an outer optimizer (--algorithm diloco): how often workers sync and how
    the averaged pseudo-gradient moves the shared parameters (see ``algorithms/diloco.py``)."""

    sync_every: int | str = _opt(64, "diloco: inner steps each worker takes with its own optimizer between syncs (H), "
                                 "or auto: H follows the measured step and sync times so that syncing costs about "
                                 "--comm-overhead of the compute, between --sync-every-min and --sync-every-max",
                                 auto=True)
    comm_overhead: float = _opt(0.1, "diloco with --sync-every auto: the share of compute time that syncing may cost")
    sync_every_min: int = _opt(4, "diloco with --sync-every auto: the smallest H (and the first period's)")
    sync_every_max: int = _opt(512, "diloco with --sync-every auto: the largest H")
    outer_optimizer: str = _opt("nesterov", "diloco: the optimizer of the shared parameters, stepping on the averaged "
                                "pseudo-gradient (start - local): nesterov, or sgd (with --outer-lr 1 and "
                                "--outer-momentum 0: model averaging, i.e. local SGD)", ("nesterov", "sgd"))
    outer_lr: float = _opt(0.7, "diloco: the outer optimizer's learning rate")
    outer_momentum: float = _opt(0.9, "diloco: the outer optimizer's momentum")
    fragments: int = _opt(1, "diloco: sync the model in this many fragments of consecutive tensors, each at its own "
                          "step of the period (streaming DiLoCo: peak bandwidth falls by about this factor)")
    overlap_steps: int = _opt(0, "diloco: inner steps a fragment's exchange overlaps before its outer step is applied "
                              "and merged (0: applied at once)")
    merge_weight: float = _opt(1.0, "diloco with --overlap-steps: weight of the synced fragment when merged into the "
                               "worker's own, which moved meanwhile (1: it takes the synced one; the streaming "
                               "paper's 0.5 keeps the replicas apart)")

    def validate(self) -> None:
        check_choices(self)
        if self.sync_every != AUTO:
            check_positive("sync_every", self.sync_every, integer=True)
        check_positive("comm_overhead", self.comm_overhead)
        check_positive("sync_every_min", self.sync_every_min, integer=True)
        check_positive("sync_every_max", self.sync_every_max, integer=True)
        if self.sync_every_max < self.sync_every_min:
            raise ConfigError("--sync-every-max", f"must be at least --sync-every-min ({self.sync_every_min}), got "
                                                  f"{self.sync_every_max}")
        if self.sync_every == AUTO and self.fragments != 1:
            raise ConfigError("--sync-every", "auto changes the period as the run goes, which streaming fragments "
                                              f"(each syncing at its own step of a fixed period) cannot follow; use "
                                              f"--fragments 1 with it, or a number, got --fragments {self.fragments}")
        check_positive("fragments", self.fragments, integer=True)
        check_positive("overlap_steps", self.overlap_steps, integer=True, allow_zero=True)
        check_positive("merge_weight", self.merge_weight)
        if self.merge_weight > 1:
            raise ConfigError("--merge-weight", f"must be in (0, 1], got {self.merge_weight!r}")
        check_positive("outer_lr", self.outer_lr)
        check_positive("outer_momentum", self.outer_momentum, allow_zero=True)
        if self.outer_momentum >= 1:
            raise ConfigError("--outer-momentum", f"must be in [0, 1), got {self.outer_momentum!r}")


#: Defaults that depend on the task, for the settings a user did not give (flag, file, keyword).
#: A language model: Adam on small batches (more steps for the same tokens learn faster here),
#: a short job (4 workers on 2 CPU cores: about 3 minutes on the standard library's text once
#: it is cached, ending below the bigram model's bits per byte), evaluated at its end only
#: (each evaluation reads the whole validation text).
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "lm": {"optimizer": "adam", "lr": 0.012, "batch_size": 8, "epochs": 0.4, "warmup_epochs": 0.01,
           "eval_every": 0.4},
}


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "optim": OptimConfig,
    "run": RunConfig,
    "cluster": ClusterConfig,
    "algo": AlgoConfig,
    "ps": ServerConfig,
    "network": NetworkConfig,
    "compress": CompressConfig,
    "gossip": GossipConfig,
    "outer": OuterConfig,
}


@dataclass(init=False)
class TrainConfig:
    """The whole run configuration: one section per component.

    Built from sections or from single settings by field name, checked like a config file::

        TrainConfig(workers=2, epochs=3, model="mlp")
        TrainConfig(optim=OptimConfig(lr=0.05), workers=2)
    """

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    ps: ServerConfig = field(default_factory=ServerConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    compress: CompressConfig = field(default_factory=CompressConfig)
    gossip: GossipConfig = field(default_factory=GossipConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)

    def __init__(self, **values: Any) -> None:
        #: the settings given (by name, from a flag, file or keyword), which task defaults leave alone;
        #: a section given whole counts as every one of its settings given
        self.given: set[str] = set()
        for section, klass in SECTIONS.items():
            setattr(self, section, klass())
        for key, value in values.items():
            if key in SECTIONS and isinstance(value, SECTIONS[key]):
                setattr(self, key, value)
                self.given.update(f.name for f in dataclasses.fields(value))
            else:
                self.set(key, value)

    def apply_task_defaults(self) -> TrainConfig:
        """Set the task's own defaults (:data:`TASK_DEFAULTS`) of every setting not given."""
        for name, value in TASK_DEFAULTS.get(self.data.task_name(), {}).items():
            section = getattr(self, section_of(name))
            # a value set straight on the section (not through ``set``) differs from the default
            if name not in self.given and getattr(section, name) == getattr(type(section)(), name):
                setattr(section, name, value)
        return self

    def validate(self) -> TrainConfig:
        """Apply the task's defaults to the settings not given, then check every section; raise
        ConfigError naming the first bad flag."""
        from distrain.algorithms import ALGORITHMS
        from distrain.assemble import check_algorithm

        self.data.validate()  # the task comes from the data settings
        self.apply_task_defaults()
        for section in SECTIONS:
            getattr(self, section).validate()
        task = self.data.task_name()
        if self.model.model == "gpt" and task != "lm":
            raise ConfigError("--model", f"gpt is a language model: train it with --dataset text (the task here is {task})")
        if task == "lm" and self.model.model in ("mlp", "cnn1d", "cnn2d"):
            raise ConfigError("--model", f"{self.model.model} is not a language model: use --model gpt with --dataset text")
        check_algorithm(self)
        if self.run.stop_at_target and (not ALGORITHMS[self.algo.algorithm].synchronous or self.algo.algorithm == "ps"):
            stoppable = sorted(n for n, a in ALGORITHMS.items() if a.synchronous and n != "ps")
            raise ConfigError("--stop-at-target", f"needs an algorithm whose workers all evaluate at the same steps "
                                                  f"({', '.join(stoppable)}), got {self.algo.algorithm}")
        return self

    # Flat access keeps call sites short: cfg.get("lr") == cfg.optim.lr.
    def get(self, name: str) -> Any:
        return getattr(getattr(self, section_of(name)), name)

    def set(self, name: str, value: Any) -> None:
        """Set one setting by field name (it counts as given); a value of the wrong type is refused
        in one line."""
        setattr(getattr(self, section_of(name)), name, coerce(name, value))
        self.given.add(name)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """Build from a flat ``{field: value}`` or sectioned ``{section: {field: value}}`` dict.

        A run's own ``config.json`` loads too: the facts it records beside the settings
        (:data:`RUN_RECORD_KEYS`) are skipped.
        """
        cfg = cls()
        for key, value in values.items():
            if key in SECTIONS and isinstance(value, dict):
                for name, inner in value.items():
                    if section_of(name, missing_ok=True) != key:
                        raise ConfigError(key, f"unknown setting {name!r} in section [{key}]")
                    cfg.set(name, inner)
            elif key not in RUN_RECORD_KEYS:
                cfg.set(key, value)
        return cfg

    @classmethod
    def from_file(cls, path: str | Path) -> TrainConfig:
        """Load a JSON, TOML or YAML config file (flat or sectioned)."""
        return cls.from_dict(read_config_file(path))


#: What a run's config.json records beside its settings (derived sizes, facts about the run).
RUN_RECORD_KEYS = frozenset({
    "world_size", "steps_per_epoch", "total_steps", "global_batch", "peak_lr", "shards", "resumed_from_step",
    "algorithm_info", "network_bits_per_s", "model_parameters", "commit", "distrain_version", "user_model",
    "user_data", "segments", "epoch_workers", "changed_on_resume",
})


def leaf_fields() -> list[tuple[str, dataclasses.Field, type]]:
    """(section, field, python type) for every leaf setting, in declaration order."""
    out = []
    for section, klass in SECTIONS.items():
        hints = typing.get_type_hints(klass)
        for f in dataclasses.fields(klass):
            out.append((section, f, hints[f.name]))
    return out


_SECTION_OF = {f.name: section for section, f, _ in leaf_fields()}
_TYPE_OF = {f.name: t for _, f, t in leaf_fields()}
_FIELD_OF = {f.name: f for _, f, _ in leaf_fields()}


def section_of(name: str, *, missing_ok: bool = False) -> str:
    if name not in _SECTION_OF:
        if missing_ok:
            return ""
        close = difflib.get_close_matches(name, _SECTION_OF, n=3)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise ConfigError(name, f"unknown setting; {hint}the settings are the flags of 'distrain train --help' "
                                f"with '_' for '-'")
    return _SECTION_OF[name]


def base_type(annotation: Any) -> type:
    """``int | None`` -> ``int``."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def coerce(name: str, value: Any) -> Any:
    """Check a setting's value against the field's type, as given in a file or from Python.

    Types must match: a boolean is never a number nor a number a boolean, and a number is never
    read from a string. An integer is accepted for a float setting, and a float with an integral
    value (JSON's ``2.0``) for an integer one. Anything else is one ConfigError line.
    """
    section_of(name)
    if value == AUTO and takes_auto(name):
        return AUTO
    annotation = _TYPE_OF[name]
    kind = base_type(annotation)
    if value is None:
        if type(None) in typing.get_args(annotation):
            return None
        raise ConfigError(flag(name), f"expected {_KIND_NAMES[kind]}, got null")
    if kind is bool and isinstance(value, bool):
        return value
    if kind is int and not isinstance(value, bool):
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is str and isinstance(value, str):
        return value
    raise ConfigError(flag(name), f"expected {_KIND_NAMES[kind]}, got {value!r}")


def copy_of(config: Any, call: str) -> TrainConfig:
    """A copy of the :class:`TrainConfig` a caller gave ``wrap()`` or ``fit()`` (defaults for
    None), never the caller's own; ConfigError naming ``config`` for anything else (``call``: how
    the caller gives settings by name instead, for the message)."""
    if config is None:
        return TrainConfig()
    if not isinstance(config, TrainConfig):
        raise ConfigError("config", f"must be a distrain.TrainConfig, got {type(config).__name__} (settings by name "
                          f"go in as keyword arguments: {call})")
    return TrainConfig.from_dict(config.to_dict())


def _parse_error(exc: Exception) -> str:
    """A parser's error in one line, with where in the file (YAML's own message spreads what and
    where over several lines; JSON's and TOML's first line has both)."""
    mark, problem = getattr(exc, "problem_mark", None), getattr(exc, "problem", None)
    if mark is not None and problem:
        context, begun = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        since = f"; {context} from line {begun.line + 1}" if context and begun is not None else ""
        return f"{problem} (line {mark.line + 1}, column {mark.column + 1}{since})"
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def read_config_file(path: str | Path, flag: str = "--config") -> dict[str, Any]:
    """Parse ``--config FILE`` (or the file of another ``flag``, e.g. ``--scenario``) by
    extension: .json, .toml, .yaml/.yml. Every problem is a ConfigError naming ``flag``."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(flag, f"{str(path)!r} is a directory; name a .json, .toml or .yaml file")
    if not path.is_file():
        raise ConfigError(flag, f"file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(flag, f"{str(path)!r} is not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(flag, f"cannot read {str(path)!r}: {exc.strerror or exc}") from None
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        elif path.suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                import tomli as tomllib  # type: ignore[no-redef]
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            from distrain.extras import require

            data = require("yaml", feature=f"{flag} {path.name}", setting=flag).safe_load(text)
        else:
            raise ConfigError(flag, f"unsupported file type {path.suffix!r}; use .json, .toml or .yaml")
    except ConfigError:
        raise
    except ModuleNotFoundError as exc:
        raise ConfigError(flag, f"reading {path.suffix} files needs the '{exc.name}' package: pip install {exc.name}") from None
    except Exception as exc:  # parse errors differ per format
        raise ConfigError(flag, f"cannot parse {str(path)!r}: {_parse_error(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(flag, f"{str(path)!r} must hold a table of settings")
    return data
