"""The training loop: GPTModel with DistributedOptimizer (AdamW) at the layout in force.

One :class:`Trainer` per rank, after ``manager.initialize_parallel`` (without it, one
process with every group of size 1); ``msdist train`` drives it through the harness checks
of :mod:`mindscience.distributed.harness.checks.train`, the tests and ``msdist verify
--model`` the same way::

    trainer = Trainer(model_spec, training_spec, TrainOptions(steps=4, micro_batch_size=2,
                                                              global_batch_size=8))
    trainer.resume("ckpt/step_2")            # optional: any layout's and ZeRO stage's checkpoint
    for step in trainer.remaining_steps():   # counts on from the resumed step
        row = trainer.train_step(step)       # {"step", "loss", "time_s"}
        trainer.maybe_save(step)
    trainer.memory_bytes()                   # {"stage", "weights", "gradients", "optimizer"}

Each step reads this data-parallel rank's share of the global batch of that step
(:mod:`.data`: it depends only on the seed, or the file, and the step), runs
``model.forward_backward`` over ``G / (b * dp)`` micro-batches (the pipeline schedule
when pp > 1) and ``opt(grads)``; the loss it reports is the global batch's, the same
number on every rank and at every layout.

Checkpoints are ``checkpoint.save`` / ``checkpoint.load`` of ``nn.CellList([model,
optimizer])``: the weights, the optimizer's moments (and bf16 models' fp32 main weights)
saved whole in each parameter's tp-local shape whatever the ZeRO stage, and its step
counter (:mod:`mindscience.distributed.checkpoint.zero`); ``extra`` keeps the data
position and the model. So a run at stage 3 resumes at stage 0-2, at any layout.
"""

from __future__ import annotations

import time
from dataclasses import asdict, replace

import numpy as np

from . import data as data_mod
from .options import TrainOptions, checkpoint_steps, microbatches, step_dir


def model_config(model_spec, training_spec):
    """The models package's TransformerConfig of the cost model's model and training specs."""
    from mindscience.distributed.costmodel.spec import Workload
    from mindscience.distributed.models import TransformerConfig

    return TransformerConfig.from_model_spec(Workload(model=model_spec, training=training_spec))


def training_spec(base, opts: TrainOptions):
    """The model file's TrainingSpec ``base`` with the run's options over it."""
    return replace(base, micro_batch_size=opts.micro_batch_size, global_batch_size=opts.global_batch_size,
                   precision=opts.precision, recompute=opts.recompute, zero_stage=opts.zero_stage,
                   distributed_optimizer=opts.zero_stage >= 1,
                   # compiled MoE dispatch runs static expert slots (moe.MoELayer): price what runs
                   moe_static_slots=base.moe_static_slots or opts.mode != "pynative")


def _global_rank() -> int:
    from mindspore.communication import get_rank

    return int(get_rank())


def _world_sum(values: np.ndarray) -> np.ndarray:
    """``values`` summed over every rank (float64 kept as float32 on the wire: counts up to
    2**24 exactly); itself without ranks."""
    from mindscience.distributed import manager

    if not manager.is_initialized() or manager.get_layout().world_size == 1:
        return values
    import mindspore as ms
    from mindspore import mint

    tensor = ms.Tensor(values.astype(np.float32))
    mint.distributed.all_reduce(tensor)
    return tensor.asnumpy().astype(np.float64)


class Trainer:
    """Train the reference transformer at the current layout.

    Args:
        model_spec: The cost model's ``ModelSpec`` (``model:`` section of a model file).
        training: Its ``TrainingSpec`` (``training:`` section: cp method, stage cut...);
            the options' batch, precision, recompute and zero stage replace its own.
        opts: The run's :class:`~.options.TrainOptions`.
        token_file: A checked :class:`~.data.TokenFile` for ``opts.data`` (None: synthetic,
            or opened here when ``opts.data`` is set).
        replicate_batch: Every rank trains the WHOLE global batch instead of its dp share:
            with dp = world and no model parallelism this is the dense model (the mean of
            identical gradients is the gradient), ``msdist verify --model``'s reference.
    """

    def __init__(self, model_spec, training, opts: TrainOptions, token_file=None, replicate_batch: bool = False):
        import mindspore as ms
        from mindspore import nn

        from mindscience.distributed import manager
        from mindscience.distributed.group import ParallelGroup
        from mindscience.distributed.models import GPTModel
        from mindscience.distributed.optimizer import DistributedOptimizer

        self.spec, self.opts = model_spec, opts
        # Without initialize_parallel (one process, e.g. a test) every group has size 1,
        # as for GPTModel and DistributedOptimizer.
        parallel = manager.is_initialized()
        self.dp_group = manager.get_data_parallel_group() if parallel else ParallelGroup.trivial("dp")
        self.pp_group = manager.get_pipeline_parallel_group() if parallel else ParallelGroup.trivial("pp")
        self.replicate = replicate_batch
        self.dp = 1 if replicate_batch else self.dp_group.size
        self.dp_rank = 0 if replicate_batch else self.dp_group.rank
        self.num_microbatches = microbatches(opts, self.dp)
        if token_file is None and opts.data:
            token_file = data_mod.open_token_file(opts.data, model_spec.vocab_size, model_spec.seq_length)
        self.token_file = token_file
        ms.set_seed(opts.seed)
        np.random.seed(opts.seed)
        self.training = training_spec(training, opts)
        self.config = model_config(model_spec, self.training)
        self.model = GPTModel(self.config, seed=opts.seed)
        if opts.zero_stage == 3:
            from mindscience.distributed.fsdp import fully_shard

            # Stage 3 steps the dim-0 shards fully_shard makes (contract C3), over the
            # optimizer's group: each transformer layer one unit (FSDP2), the root the rest.
            group = (manager.get_data_context_parallel_group() if parallel
                     else ParallelGroup.trivial("dp-cp"))
            flags = {"reshard_after_forward": bool(getattr(self.training, "reshard_after_forward", True)),
                     "prefetch": bool(getattr(self.training, "fsdp_prefetch", True))}
            for layer in self.model.layers.cells():
                fully_shard(layer, group, **flags)
            fully_shard(self.model, group, **flags)
        self.params = self.model.trainable_params()
        # The training spec's overlap options (issue 37): the same results bit for bit,
        # the dp-cp reduction launched during the backward where the mode allows
        # (optimizer.overlap_rules); read with defaults so an older spec works.
        self.optimizer = DistributedOptimizer(
            self.params, optimizer="adamw", lr=opts.lr, zero_stage=opts.zero_stage,
            overlap_grad_reduce=bool(getattr(self.training, "overlap_grad_reduce", False)),
            overlap_param_gather=bool(getattr(self.training, "overlap_param_gather", False)))
        self.first_step = 0  # steps already trained (the resumed step counter)
        self.first_sequence = 0  # data position of step 0 in the token file
        self.saved: list = []
        self.save_stalls: list = []  # seconds each save held the step (the host copy when async)
        self.pending = None  # the checkpoint being written in the background (--async-save)
        self.host_buffers: dict = {}  # its host copy, reused by the next one
        self.stop_signal = None  # the signal that asked this rank to stop (install_stop_handler)
        self.stopped_at = None  # the step after which the ranks agreed to stop
        from . import faults

        self.faults, self.attempt = faults.env_faults()
        self.rank = _global_rank() if parallel else 0
        # What checkpoints hold: the model and the optimizer (its moments, main weights
        # and step counter at any ZeRO stage, see checkpoint.zero).
        self.checkpoint_cell = nn.CellList([self.model, self.optimizer])

    # ----------------------------------------------------------------- data
    def batch(self, step: int) -> tuple:
        """``(input_ids, labels)`` of this rank for the 0-based ``step``: ``(G/dp, s)`` int32 each."""
        rows = data_mod.batch_rows(step, self.opts.global_batch_size, self.dp_rank, self.dp,
                                   self.spec.seq_length, self.spec.vocab_size, seed=self.opts.seed,
                                   token_file=self.token_file, first_sequence=self.first_sequence)
        return data_mod.inputs_and_labels(rows)

    def data_position(self, steps_done: int) -> int:
        """The first sequence not yet read after ``steps_done`` steps (kept in checkpoints)."""
        return self.first_sequence + steps_done * self.opts.global_batch_size

    # ----------------------------------------------------------------- steps
    def remaining_steps(self) -> range:
        """0-based steps this run trains: ``first_step .. first_step + steps - 1``."""
        return range(self.first_step, self.first_step + self.opts.steps)

    def train_step(self, step: int) -> dict:
        """One optimizer step on the global batch of ``step`` (0-based); its row has the
        1-based step counter, the global loss and the seconds."""
        inputs, labels = self.batch(step)
        started = time.perf_counter()
        loss, grads = self.model.forward_backward(inputs, labels, num_microbatches=self.num_microbatches,
                                                  mode=self.opts.mode, optimizer=self.optimizer)
        self.optimizer(grads)
        value = self.global_loss(loss)
        moe = self.moe_step()
        seconds = time.perf_counter() - started
        return {"step": step + 1, "loss": value, "time_s": seconds, **(moe or {})}

    def moe_step(self) -> dict | None:
        """A MoE model's step statistics, the same on every rank (None for a dense model):
        ``aux_loss`` (the aux losses of every MoE layer, mean over micro-batches, as they
        entered the objective; ``loss`` is the language-model loss alone),
        ``max_load`` (the largest over the MoE layers of max/mean tokens per expert,
        summed over the data-parallel ranks: 1.0 is a perfect balance) and
        ``dropped_tokens`` ((token, expert) assignments dropped by capacity, all layers).
        Then the expert bias moves (``moe_router_enable_expert_bias``) with each layer's
        tokens per expert. One world all-reduce of ``layers x (E + 2)`` floats.
        """
        cfg = self.config
        if not getattr(cfg, "num_moe_experts", None):
            return None
        moe_layers = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
        if not moe_layers:
            return None
        e = cfg.num_moe_experts
        where = {i: j for j, i in enumerate(moe_layers)}
        got = self.model.moe_metrics()
        model = self.model
        # Each stage's ranks: tp x cp x dp of them. The aux loss is the same on all of them
        # (averaged); tokens are per tp group (the layer sums them over tp), distinct over
        # cp and dp (summed), the same on every dp rank when each trains the whole batch.
        ranks = model.tp.size * model.cp.size * self.dp_group.size
        per_dp = self.dp_group.size if self.replicate else 1
        vec = np.zeros((len(moe_layers), e + 2), np.float64)
        for k, i in enumerate(got["layers"]):
            vec[where[i], 0] = got["aux_loss"][k] / ranks
            vec[where[i], 1:e + 1] = got["tokens"][k] / (model.tp.size * per_dp)
            vec[where[i], e + 1] = got["dropped"][k] / (model.tp.size * per_dp)
        vec = _world_sum(vec)
        tokens = vec[:, 1:e + 1]
        mean = tokens.mean(axis=1)
        loads = np.where(mean > 0, tokens.max(axis=1) / np.maximum(mean, 1e-30), 0.0)
        if cfg.moe_router_enable_expert_bias:
            model.update_expert_bias({i: tokens[where[i]] for i in model.moe_blocks})
        return {"aux_loss": float(vec[:, 0].sum()), "max_load": float(loads.max()),
                "dropped_tokens": int(round(float(vec[:, e + 1].sum())))}

    def global_loss(self, loss) -> float:
        """The global batch's loss on every rank: the last pipeline stage's, averaged over dp.

        ``forward_backward`` returns this dp rank's mean loss over its tokens (already
        averaged over cp); the last stage's value, summed over the pp group (the others
        add 0), reaches every stage, and the dp mean makes it the global batch's (equal
        shares, so the mean of the means).
        """
        import mindspore as ms

        from mindscience.distributed.collectives import all_reduce

        last = self.pp_group.rank == self.pp_group.size - 1
        value = np.array([float(loss.asnumpy()) if (last and loss is not None) else 0.0], np.float32)
        tensor = ms.Tensor(value)
        if self.pp_group.size > 1:
            tensor = all_reduce(tensor, self.pp_group)
        if not self.replicate and self.dp_group.size > 1:
            tensor = all_reduce(tensor, self.dp_group) / self.dp_group.size
        return float(tensor.asnumpy()[0])

    # ----------------------------------------------------------------- checkpoints
    def save(self, directory: str, steps_done: int) -> str:
        """Checkpoint after ``steps_done`` steps: weights, optimizer state (its step counter
        included), and in ``extra`` the data position and what the run was.

        With ``async_save`` the step stalls only for the host copy: the previous save (at
        most one in flight) is waited for and agreed on first, then the files are written
        in the background (``checkpoint.save_async``). ``keep_last`` then removes older
        complete checkpoints on rank 0, once the new one is in place."""
        from mindscience.distributed import checkpoint

        from . import faults

        extra = {"data_position": self.data_position(steps_done), "seed": self.opts.seed,
                 "data": self.opts.data, "global_batch_size": self.opts.global_batch_size,
                 "zero_stage": self.opts.zero_stage, "model": self.spec.name,
                 "model_spec": asdict(self.spec)}
        fault = faults.fault_at(self.faults, rank=self.rank, step=steps_done, attempt=self.attempt,
                                kinds=faults.SAVE_KINDS)

        def before_write():
            if fault is not None:
                faults.fire(fault)

        def after_finish():
            if self.opts.keep_last and self.rank == 0:
                faults.keep_last(self.opts.save, self.opts.keep_last, protect=[steps_done])

        started = time.perf_counter()
        if self.opts.async_save:
            self.wait_for_save()
            self.pending = checkpoint.save_async(self.checkpoint_cell, directory, step=steps_done, extra=extra,
                                                 before_write=before_write, after_finish=after_finish,
                                                 host_buffers=self.host_buffers)
        else:
            before_write()
            checkpoint.save(self.checkpoint_cell, directory, step=steps_done, extra=extra)
            after_finish()
        self.save_stalls.append(time.perf_counter() - started)
        self.saved.append(directory)
        return directory

    def wait_for_save(self) -> None:
        """Wait for the checkpoint being written in the background (every rank calls it)
        and agree on it: a failure on any rank raises on every rank."""
        from mindscience.distributed import checkpoint

        pending, self.pending = self.pending, None
        if pending is not None:
            checkpoint.agree_written(pending)

    def maybe_save(self, step: int) -> str | None:
        """Save after 0-based ``step`` when ``--save-every`` or the end of the run says so."""
        done = step + 1
        if not self.opts.save or done not in checkpoint_steps(self.opts.steps, self.first_step,
                                                               self.opts.save_every):
            return None
        return self.save(step_dir(self.opts.save, done), done)

    # ----------------------------------------------------------------- stop on a signal
    def install_stop_handler(self) -> None:
        """SIGTERM / SIGINT ask this rank to stop after its step (:meth:`stop_agreed`);
        a second one exits at once."""
        import os
        import signal

        def handler(signum, frame):
            if self.stop_signal is not None:
                os._exit(128 + signum)
            self.stop_signal = signum

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)

    def stop_agreed(self) -> bool:
        """Whether any rank was asked to stop: a world all-reduce of the flag, every step
        (so all ranks stop after the same step, whichever rank got the signal)."""
        from mindscience.distributed import manager

        flag = np.array([1.0 if self.stop_signal is not None else 0.0], np.float32)
        if manager.is_initialized() and manager.get_layout().world_size > 1:
            import mindspore as ms
            from mindspore import mint

            tensor = ms.Tensor(flag)
            mint.distributed.all_reduce(tensor)
            flag = tensor.asnumpy()
        return bool(flag[0] > 0)

    def resume(self, directory: str) -> dict:
        """Load a checkpoint (saved at any layout and ZeRO stage) and continue from its step
        and data position."""
        from mindscience.distributed import checkpoint

        # Not strict: a tied output layer is a second copy only at pp > 1, so a checkpoint
        # of another pipeline size has one parameter (and its state) more or less; the
        # copy is set from the embedding below. The parent checked the model (train's
        # check_resume) before any rank started.
        info = checkpoint.load(self.checkpoint_cell, directory, strict=False)
        self._sync_tied_copy()
        self.first_step = int(info["step"] or 0)
        position = (info.get("extra") or {}).get("data_position", self.first_step * self.opts.global_batch_size)
        # Step k reads sequences first_sequence + k*G ..: the saved position is step first_step's.
        self.first_sequence = int(position) - self.first_step * self.opts.global_batch_size
        return info

    def optimizer_tensors(self, param) -> list:
        """``param`` and what the optimizer holds for it: its fp32 main weight (if any) and
        its moments, in the optimizer's order (the same on every rank)."""
        return self.optimizer.tensors_of(param)  # an expert weight's: in the expert optimizer

    def _sync_tied_copy(self) -> None:
        """At pp > 1 with tied embeddings, the last stage's output layer (its weight, main
        weight and moments) := the first stage's word embedding's, over the embedding group
        (a sum with zeros).

        A checkpoint of pp = 1 has no such copy (load leaves it as built, with zero
        moments), and the copy's rows, shards and moment shards have the same shapes as
        the embedding's on the other end of the group (same tp, cp and dp coordinates).
        """
        import mindspore as ms

        from mindscience.distributed import manager
        from mindscience.distributed.collectives import all_reduce

        model = self.model
        if not self.config.tie_embeddings or model.pp.size == 1:
            return
        emb = getattr(model, "embedding", None)
        out = getattr(model, "output_layer", None)
        if (emb is None) == (out is None):  # a middle stage
            return
        group = manager.get_embedding_group()
        mine = emb.word_embeddings.weight if emb is not None else out.weight
        for t in self.optimizer_tensors(mine):
            value = t.astype(ms.float32).asnumpy() if emb is not None else np.zeros(t.shape, np.float32)
            summed = all_reduce(ms.Tensor(value), group)
            if out is not None:
                t.set_data(summed.astype(t.dtype))

    def memory_bytes(self) -> dict:
        """This rank's bytes of weights, gradients and optimizer state (contract C2) and its stage."""
        mem = dict(self.optimizer.memory_bytes())
        return {"stage": self.pp_group.rank, **{k: int(mem[k]) for k in ("weights", "gradients", "optimizer")}}
