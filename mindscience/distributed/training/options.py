"""What a training run is asked to do, validated before any rank starts (pure Python).

:class:`TrainOptions` holds the command line's choices (``msdist train``) merged over the
model file's ``training:`` section; :func:`microbatches` is the one place the global batch
is cut into micro-batches of each data-parallel rank.

    >>> opts = TrainOptions(steps=3, micro_batch_size=2, global_batch_size=8)
    >>> microbatches(opts, dp=2)
    2
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass

RECOMPUTE = ("none", "selective", "full")
MODES = ("jit", "pynative")
ZERO_STAGES = (0, 1, 2, 3)
STEP_DIR = re.compile(r"^step_(\d+)$")


class TrainOptionError(ValueError):
    """A training option out of range; the message names the option, the value and the fix."""


def _int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TrainOptionError(f"{name} {value!r} is invalid: expected an integer >= {minimum}.")


@dataclass(frozen=True)
class TrainOptions:
    """One run's options (the ``training`` object of the report).

    Args:
        steps: Optimizer steps to run (after the resumed step, if any).
        micro_batch_size: Sequences per micro-batch (``b``).
        global_batch_size: Sequences per step (``G``); ``G / (b * dp)`` micro-batches per
            data-parallel rank.
        zero_stage: 0 replicated optimizer, 1 sharded state, 2 + sharded gradients,
            3 + sharded weights (contract C2).
        recompute: ``none``, ``selective`` or ``full``.
        mode: ``jit`` (compiled forward/backward) or ``pynative``.
        seed: Seed of the weights and of the synthetic data.
        lr: AdamW learning rate.
        precision: ``fp32``, ``bf16`` or ``fp16`` (from the model file).
        data: A ``.npy`` token file, or None for synthetic tokens.
        save: Folder for ``step_<k>`` checkpoints, or None.
        save_every: Save every this many steps (0: only at the end).
        resume: A checkpoint directory (``step_<k>`` or a ``--save`` folder), or None.
        async_save: Write checkpoints in the background after a host copy (``--async-save``).
        keep_last: Keep only the newest this many complete checkpoints (0: all).

    Raises:
        TrainOptionError: a value out of range.
    """

    steps: int = 10
    micro_batch_size: int = 1
    global_batch_size: int = 1
    zero_stage: int = 0
    recompute: str = "none"
    mode: str = "jit"
    seed: int = 0
    lr: float = 1e-3
    precision: str = "fp32"
    data: str | None = None
    save: str | None = None
    save_every: int = 0
    resume: str | None = None
    async_save: bool = False
    keep_last: int = 0

    def __post_init__(self):
        _int("--steps", self.steps, 1)
        _int("--micro-batch-size", self.micro_batch_size, 1)
        _int("--global-batch-size", self.global_batch_size, 1)
        _int("--save-every", self.save_every, 0)
        _int("--keep-last", self.keep_last, 0)
        _int("--seed", self.seed, 0)
        if self.zero_stage not in ZERO_STAGES or isinstance(self.zero_stage, bool):
            raise TrainOptionError(f"--zero-stage {self.zero_stage!r} is invalid: expected 0, 1, 2 or 3.")
        if self.recompute not in RECOMPUTE:
            raise TrainOptionError(f"--recompute {self.recompute!r} is invalid: expected one of "
                                   f"{', '.join(RECOMPUTE)}.")
        if self.mode not in MODES:
            raise TrainOptionError(f"--mode {self.mode!r} is invalid: expected jit or pynative.")
        if not isinstance(self.lr, (int, float)) or isinstance(self.lr, bool) or not (
                math.isfinite(self.lr) and self.lr > 0):
            raise TrainOptionError(f"--lr {self.lr!r} is invalid: expected a finite learning rate > 0, e.g. 1e-3.")
        if self.global_batch_size % self.micro_batch_size:
            raise TrainOptionError(
                f"--global-batch-size {self.global_batch_size} is not a multiple of --micro-batch-size "
                f"{self.micro_batch_size}: a step is whole micro-batches. Use e.g. "
                f"{self.micro_batch_size * max(1, self.global_batch_size // self.micro_batch_size)}.")
        if self.save_every and not self.save:
            raise TrainOptionError(f"--save-every {self.save_every} needs --save DIR: the folder the "
                                   "checkpoints go to.")
        for flag, value in (("--async-save", self.async_save), ("--keep-last", self.keep_last)):
            if value and not self.save:
                raise TrainOptionError(f"{flag} needs --save DIR: the folder the checkpoints go to.")

    def to_dict(self) -> dict:
        return asdict(self)


def microbatches(opts: TrainOptions, dp: int) -> int:
    """Micro-batches per step and data-parallel rank: ``G / (b * dp)``.

    Raises:
        TrainOptionError: ``G`` is not a multiple of ``b * dp``.
    """
    if opts.global_batch_size % (opts.micro_batch_size * dp):
        good = opts.micro_batch_size * dp
        raise TrainOptionError(
            f"--global-batch-size {opts.global_batch_size} does not split into micro-batches of "
            f"{opts.micro_batch_size} on dp={dp} data-parallel ranks: it must be a multiple of "
            f"micro_batch_size x dp = {good}. Use e.g. {good * max(1, opts.global_batch_size // good)}.")
    return opts.global_batch_size // (opts.micro_batch_size * dp)


def checkpoint_steps(steps: int, first_step: int, save_every: int) -> list:
    """The steps after which a run of ``steps`` steps starting at ``first_step`` saves.

    Every ``save_every`` steps of the step counter, and always the last one (with a save folder).

        >>> checkpoint_steps(5, 0, 2), checkpoint_steps(3, 4, 0)
        ([2, 4, 5], [7])
    """
    last = first_step + steps
    chosen = [k for k in range(first_step + 1, last + 1) if save_every and k % save_every == 0]
    return chosen if chosen and chosen[-1] == last else chosen + [last]


def step_dir(save: str, step: int) -> str:
    """``DIR/step_<k>``: where the checkpoint of step ``k`` goes."""
    return os.path.join(save, f"step_{step}")


def resolve_resume(path: str) -> str:
    """The checkpoint directory ``--resume`` names: itself (it holds a manifest) or, in a
    ``--save`` folder, its ``step_<k>`` with the highest ``k``.

    Raises:
        TrainOptionError: nothing there is a checkpoint.
    """
    from ..checkpoint.manifest import has_manifest

    if not os.path.isdir(path):
        raise TrainOptionError(f"--resume {path}: no such directory: pass a checkpoint directory "
                               "(DIR/step_<k>) or the folder --save wrote them to.")
    if has_manifest(path):
        return path
    steps = sorted((int(m.group(1)), name) for name in os.listdir(path)
                   if (m := STEP_DIR.match(name)) and has_manifest(os.path.join(path, name)))
    if not steps:
        raise TrainOptionError(f"--resume {path}: holds no checkpoint (no manifest.json, no step_<k>/ with "
                               "one): pass a directory msdist train --save wrote.")
    return os.path.join(path, steps[-1][1])


# Model fields a checkpoint must agree on (the shapes and names of its parameters follow them).
ARCHITECTURE_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size",
                     "seq_length", "vocab_size", "normalization", "activation", "position_embedding",
                     "tie_embeddings", "bias", "num_moe_experts", "moe_ffn_hidden_size", "moe_layer_freq",
                     "moe_shared_expert_intermediate_size", "moe_router_topk")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def checkpoint_difference(model: dict, saved_model: dict | None, params: dict) -> str | None:
    """The first way a checkpoint does not fit ``model`` (a ModelSpec mapping), or None.

    ``saved_model`` is the model mapping ``msdist train`` keeps in the checkpoint's
    ``extra`` (None for a checkpoint saved otherwise); ``params`` maps the checkpoint's
    parameter names to global shapes, checked for the layer count and the word
    embedding's ``(vocab_size, hidden_size)``.

        >>> m = {"num_layers": 4, "hidden_size": 64, "vocab_size": 256}
        >>> checkpoint_difference(m, {**m, "hidden_size": 32}, {})
        'model.hidden_size is 32 in the checkpoint, 64 here'
        >>> checkpoint_difference(m, None, {"0.layers.5.mlp.fc1.weight": [256, 64]})
        "the checkpoint holds layer 5 ('0.layers.5.mlp.fc1.weight'), the model has 4 layers"
    """
    for key in ARCHITECTURE_KEYS:
        if saved_model and key in saved_model and key in model and saved_model[key] != model[key]:
            return f"model.{key} is {saved_model[key]!r} in the checkpoint, {model[key]!r} here"
    for name in sorted(params):
        found = _LAYER.search(name)
        if found and int(found.group(1)) >= model["num_layers"]:
            return (f"the checkpoint holds layer {found.group(1)} ({name!r}), the model has "
                    f"{model['num_layers']} layers")
        if name.endswith("word_embeddings.weight"):
            want = [model["vocab_size"], model["hidden_size"]]
            if list(params[name]) != want:
                return f"parameter {name!r} has shape {list(params[name])} in the checkpoint, the model's is {want}"
    return None


# The optimizer a msdist train checkpoint holds the state of (the manifest's "optimizers"
# record, see checkpoint.zero); its stage and group size may be anything.
TRAIN_OPTIMIZER = {"class": "DistributedOptimizer", "kind": "adamw", "state": ["exp_avg", "exp_avg_sq"]}


def optimizer_difference(saved: list | None) -> str | None:
    """How the optimizers a checkpoint was saved with (its manifest's ``optimizers``) differ
    from the trainer's AdamW DistributedOptimizer, or None. Without this check a resume
    would load the weights and silently start the moments from zero.

        >>> optimizer_difference([{**TRAIN_OPTIMIZER, "zero_stage": 3, "group_size": 4}]) is None
        True
        >>> optimizer_difference([TRAIN_OPTIMIZER, {**TRAIN_OPTIMIZER, "group_size": 2}]) is None  # + experts
        True
        >>> optimizer_difference([{"class": "DistributedOptimizer", "kind": "sgd", "state": []}])
        "it holds the state of DistributedOptimizer(optimizer='sgd')"
    """
    if not saved:
        return "it holds no optimizer state (saved without an optimizer)"
    # A MoE model's DistributedOptimizer holds its experts' state in a second one (over edp).
    if len(saved) in (1, 2) and all(all(r.get(k) == v for k, v in TRAIN_OPTIMIZER.items()) for r in saved):
        return None
    names = [f"DistributedOptimizer(optimizer={r.get('kind')!r})" if r.get("class") == "DistributedOptimizer"
             else str(r.get("class")) for r in saved]
    return f"it holds the state of {' and '.join(names)}"
