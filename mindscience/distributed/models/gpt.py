"""``GPTModel``: this rank's share of a GPT-style decoder at the layout ``initialize_parallel`` set.

    cfg = TransformerConfig.from_model_spec("tiny-llama")
    model = GPTModel(cfg)                        # dense without initialize_parallel
    loss, grads = model.forward_backward(input_ids, labels, num_microbatches=4)

What each rank holds, e.g. 8 layers at tp2 x cp2 x pp2 (v = 1, 8 ranks):

=================  ====================================================================
part               this rank's share
=================  ====================================================================
embedding          pipeline rank 0: vocabulary rows ``V/tp`` (VocabParallelEmbedding,
                   reduce-scattered over the sequence), the learned positions (whole)
layers 0-3 / 4-7   pipeline rank 0 / 1 (:func:`..pipeline.split.stage_layers`; unequal
                   stages with first/last_stage_layers); per layer whole query groups
                   and MLP columns over tp, this cp rank's tokens
final norm, head   pipeline rank 1: the output layer's ``V/tp`` rows (tied: a copy of
                   the embedding marked ``shared_embedding``, summed over the embedding
                   group by the gradient finalizer), vocab-parallel cross-entropy
=================  ====================================================================

Names are global (``layers.5.mlp.fc1.weight`` on whichever stage holds layer 5), so a
checkpoint moves between layouts, and every global tensor is drawn from a generator
keyed by (seed, name) (:mod:`.weights`): the same ``mindspore.set_seed`` gives the
dense model's weights at every layout.

Sequence: every rank gets its dp rank's full sequences ``(rows, S)``; the model keeps
its cp rank's tokens (contiguous ``S/cp`` rows, or for the load-balanced causal ring
chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``), transposed to ``(S/cp, rows)``.
"""

from __future__ import annotations

import numbers

import numpy as np

import mindspore as ms
from mindspore import nn, ops

from .. import collectives as C
from .. import mappings
from .. import random as msrandom
from ..costmodel.errors import ModelError
from ..group import ParallelGroup
from ..modules import VocabParallelEmbedding, vocab_parallel_cross_entropy
from ..sharding import mark_sharding
from .config import TransformerConfig
from .layers import Dropout, Init, MoEBlock, Norm, TransformerLayer

__all__ = ["GPTModel", "sequence_rows"]

_DTYPES = {"fp32": ms.float32, "bf16": ms.bfloat16, "fp16": ms.float16}
MODES = ("jit", "pynative")
SCHEDULES = ("1f1b", "gpipe", "interleaved")


def sequence_rows(seq_length: int, cp: int, rank: int, zigzag: bool) -> np.ndarray:
    """Global positions of cp rank ``rank``'s tokens, in the order it holds them.

    ``sequence_rows(8, 2, 0, False) == [0, 1, 2, 3]``; zigzag (the load-balanced causal
    ring): ``sequence_rows(8, 2, 0, True) == [0, 1, 6, 7]`` and rank 1 gets ``[2, 3, 4, 5]``.
    """
    if cp == 1:
        return np.arange(seq_length, dtype=np.int32)
    if not zigzag:
        n = seq_length // cp
        return np.arange(rank * n, (rank + 1) * n, dtype=np.int32)
    c = seq_length // (2 * cp)
    return np.concatenate([np.arange(rank * c, (rank + 1) * c),
                           np.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]).astype(np.int32)


class _Positions(nn.Cell):
    """The learned position table ``(S, H)`` (whole on every rank) looked up at this
    rank's rows; partial gradients under sequence parallelism (marked)."""

    def __init__(self, init: Init, rows: np.ndarray):
        super().__init__()
        cfg = init.config
        self.weight = init.parameter("embedding.position_embeddings.weight",
                                     (cfg.seq_length, cfg.hidden_size), "normal", "weight")
        mark_sharding(self.weight, axis=None, sequence_parallel=init.sequence_parallel)
        self.rows = ms.Tensor(rows.astype(np.int32))

    def construct(self):
        return ops.expand_dims(ops.gather(self.weight, self.rows, 0), 1)


class _Embedding(nn.Cell):
    """Word embedding over the vocabulary (tp) plus learned positions; dropout."""

    def __init__(self, init: Init, rows: np.ndarray):
        super().__init__()
        cfg = init.config
        full = init.full("embedding.word_embeddings.weight", (cfg.vocab_size, cfg.hidden_size),
                         "normal")
        self.word_embeddings = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, init_method=init.tensor(full),
            sequence_parallel=init.sequence_parallel, param_init_dtype=init.dtype, group=init.tp)
        self.learned = cfg.position_embedding == "learned"
        if self.learned:
            mine = rows
            if init.sequence_parallel:
                n = len(rows) // init.tp.size
                mine = rows[init.tp.rank * n:(init.tp.rank + 1) * n]
            self.position_embeddings = _Positions(init, mine)
        # Sequence parallel: the embedding output is this tp rank's rows (the tp stream).
        self.dropout = Dropout(cfg.dropout, init.sequence_parallel)

    def construct(self, ids):
        x = self.word_embeddings(ids)
        if self.learned:
            x = x + self.position_embeddings().astype(x.dtype)
        return self.dropout(x)


class _OutputLayer(nn.Cell):
    """The untied head, or on the last pipeline stage the copy of a tied embedding."""

    def __init__(self, init: Init, tied: bool):
        super().__init__()
        cfg = init.config
        name = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
        full = init.full(name, (cfg.vocab_size, cfg.hidden_size), "normal")
        per = cfg.vocab_size // init.tp.size
        self.weight = ms.Parameter(init.tensor(full[init.tp.rank * per:(init.tp.rank + 1) * per]),
                                   name="weight")
        mark_sharding(self.weight, axis="tp", partition_dim=0)
        if tied:
            self.weight.shared_embedding = True


class _Stack(nn.Cell):
    """Layers as children named by their GLOBAL index (``layers.5`` on every layout)."""

    def __init__(self, layers: dict):
        super().__init__()
        for index, layer in layers.items():
            self.insert_child_to_cell(str(index), layer)


class _Chain(nn.Cell):
    """``rest(layer(x))``: the layers of a chunk as nested calls, built by :func:`_chain`.

    Not a loop: under ms.jit, MindSpore 2.10 fails to differentiate a ``for`` over two or
    more of these layers (an nn.CellList or a tuple of attribute names alike), and a
    ``construct`` that branches on an attribute (``if self.has_rest``); its backward
    takes ``zeros_like`` of a tuple that holds the layers' ParallelGroups. Straight
    nested calls compile.
    """

    def __init__(self, layer, rest):
        super().__init__(auto_prefix=False)
        self.layer, self.rest = layer, rest

    def construct(self, x):
        return self.rest(self.layer(x))


class _Identity(nn.Cell):
    def construct(self, x):
        return x


def _chain(layers: list) -> nn.Cell:
    """The chunk's layers applied in order (the last one alone, an identity if none)."""
    if not layers:
        return _Identity()
    if len(layers) == 1:
        return layers[0]
    return _Chain(layers[0], _chain(layers[1:]))


class _Head(nn.Cell):
    """Final norm, then this tp rank's vocabulary columns of the logits ``(S_cp, b, V/tp)``
    (sequence-parallel rows all-gathered over tp first). ``table`` owns the weight: the
    output layer, or at pp == 1 with tied embeddings the word embedding itself."""

    def __init__(self, final_norm, table, tp, sequence_parallel: bool):
        super().__init__(auto_prefix=False)
        self.final_norm, self.table = final_norm, table
        # It reads table.weight without calling table: whoever waits on the weights
        # before a cell runs (DistributedOptimizer.attach_param_gather) must wait here.
        self.reads_parameters_of = (table,)
        self.tp = tp
        self.gather = tp.size > 1 and sequence_parallel
        self.copy = tp.size > 1 and not sequence_parallel

    def construct(self, x):
        x = self.final_norm(x)
        if self.gather:
            x = mappings.gather_from_sequence(x, self.tp)
        if self.copy:
            x = mappings.copy_to_all(x, self.tp)
        w = self.table.weight
        s, b, h = x.shape
        y = ops.matmul(x.reshape(s * b, h), ops.cast(w, x.dtype).T)
        return y.reshape(s, b, -1)


def _chunk(model, layers: list, first: bool, last: bool) -> nn.Cell:
    """One model stage: [embedding] -> its layers -> [final norm -> vocab-parallel logits].

    Input: ids ``(S_cp, b)`` on the first model stage, else the hidden states; output:
    the hidden states, or on the last model stage this tp rank's logits ``(S_cp, b, V/tp)``.
    """
    parts = list(layers)
    if first:
        parts.insert(0, model.embedding)
    if last:
        table = (model.output_layer if model.output_layer is not None
                 else model.embedding.word_embeddings)
        parts.append(_Head(model.final_norm, table, model.tp, model.init.sequence_parallel))
    chunk = _chain(parts)
    if len(parts) == 1:  # a single part is returned as is: give the chunk its own cell
        chunk = _Chain(parts[0], _Identity())
    return chunk


class _Loss(nn.Cell):
    """Mean cross-entropy over this rank's tokens, from vocabulary-parallel logits."""

    def __init__(self, tp):
        super().__init__()
        self.tp = tp

    def construct(self, logits, labels):
        return vocab_parallel_cross_entropy(logits, labels, group=self.tp).mean()


def _groups(parallel: bool) -> dict:
    from .. import manager

    if parallel and manager.is_initialized():
        return {"tp": manager.get_tensor_parallel_group(),
                "cp": manager.get_context_parallel_group(),
                "pp": manager.get_pipeline_parallel_group(),
                "experts": {"ep": manager.get_expert_model_parallel_group(),
                            "etp": manager.get_expert_tensor_parallel_group(),
                            "dp-cp": manager.get_data_context_parallel_group(),
                            "etp-ep": manager.get_group("etp-ep")}}
    groups = {k: ParallelGroup.trivial(k) for k in ("tp", "cp", "pp")}
    groups["experts"] = None
    return groups


class GPTModel(nn.Cell):
    """This rank's part of the GPT-style model ``config`` describes, at the current layout.

    Args:
        config: A :class:`TransformerConfig`.
        seed: Seed of the global weights; default ``mindspore.get_seed()`` (0 when unset).
            Every rank must use the same.
        parallel: False builds the dense model in this process even after
            ``initialize_parallel`` (every group of size 1), e.g. as a reference.

    Attributes:
        tp, cp, pp: The groups in use. ``layer_indices``: global indices of the layers
        here; ``chunks``: this rank's model stages (``virtual_pipeline_stages`` of them
        at pp > 1), chunk c being model stage ``c * pp + pp_rank``.

    Raises:
        ModelConstraintError: the layout cannot run the model (tp not dividing the
            query groups, vocabulary or ffn; cp not dividing the sequence; layers that
            cannot be cut); before any collective, on every rank.
        TypeError: ``config`` is not a TransformerConfig.
    """

    def __init__(self, config: TransformerConfig, *, seed=None, parallel: bool = True):
        super().__init__()
        if not isinstance(config, TransformerConfig):
            raise TypeError(f"GPTModel: config is {type(config).__name__}, expected a "
                            "TransformerConfig (TransformerConfig.from_model_spec(name) or "
                            "TransformerConfig(num_layers=..., ...)).")
        groups = _groups(parallel)
        self.tp, self.cp, self.pp = groups["tp"], groups["cp"], groups["pp"]
        tp, cp, pp = self.tp.size, self.cp.size, self.pp.size
        # The dense reference is one stage whatever the config says about cutting the
        # pipeline (the same config then serves both sides of a comparison).
        cut = config if parallel else config.replace(
            virtual_pipeline_stages=1, first_stage_layers=None, last_stage_layers=None,
            account_for_embedding_in_pipeline_split=False,
            account_for_loss_in_pipeline_split=False)
        stage_layers = cut.check_layout(tp, cp, pp)
        if seed is None:
            seed = ms.get_seed()
        seed = 0 if seed is None else seed
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise ModelError(f"GPTModel: seed={seed!r} is invalid: expected an integer >= 0.")
        self.config, self.seed = config, int(seed)
        self.zigzag = config.context_parallel_method == "ring" and cp > 1
        self.seq_rows = sequence_rows(config.seq_length, cp, self.cp.rank, self.zigzag)
        init = Init(config, seed, _DTYPES[config.precision], self.tp, self.cp,
                    config.sequence_parallel, experts=groups["experts"])
        object.__setattr__(self, "init", init)
        v = cut.virtual_pipeline_stages if pp > 1 else 1
        self.virtual_stages = v
        offsets = np.cumsum([0] + list(stage_layers))
        stages = pp * v
        chunk_layers = []
        for c in range(v):
            k = c * pp + self.pp.rank
            chunk_layers.append((k, list(range(offsets[k], offsets[k + 1]))))
        self.layer_indices = [i for _, idx in chunk_layers for i in idx]
        holds_first = chunk_layers[0][0] == 0
        holds_last = chunk_layers[-1][0] == stages - 1
        layers = {}
        for i in self.layer_indices:
            layer = TransformerLayer(init, i, self.seq_rows, self.zigzag)
            if config.recompute == "full":
                # Not layer.recompute(): its PyNative re-run would draw new dropout masks.
                msrandom.recompute(layer)
            layers[i] = layer
        embedding = _Embedding(init, self.seq_rows) if holds_first else None
        final_norm = Norm(init, "final_norm") if holds_last else None
        tied_copy = config.tie_embeddings and pp > 1
        output_layer = (_OutputLayer(init, tied_copy) if holds_last
                        and (tied_copy or not config.tie_embeddings) else None)
        if tied_copy and embedding is not None:
            embedding.word_embeddings.weight.shared_embedding = True
        # Build the chunks first, register the parts on the model last: the model's
        # registration names every parameter by its global path (layers.<i>...).
        object.__setattr__(self, "embedding", embedding)
        object.__setattr__(self, "final_norm", final_norm)
        object.__setattr__(self, "output_layer", output_layer)
        chunks = [_chunk(self, [layers[i] for i in idx], k == 0, k == stages - 1)
                  for k, idx in chunk_layers]
        for name in ("embedding", "final_norm", "output_layer"):
            object.__delattr__(self, name)
        if embedding is not None:
            self.embedding = embedding
        self.layers = _Stack(layers)
        if final_norm is not None:
            self.final_norm = final_norm
        if output_layer is not None:
            self.output_layer = output_layer
        object.__setattr__(self, "chunks", chunks)
        object.__setattr__(self, "loss_fn", _Loss(self.tp))
        # The MoE layers here, by global index (their statistics: moe_metrics).
        object.__setattr__(self, "moe_blocks", {i: layers[i].mlp for i in self.layer_indices
                                                if isinstance(layers[i].mlp, MoEBlock)})
        if config.dropout > 0:
            self._seed_streams()
            self.set_train(True)  # dropout is on while training (set_train(False) turns it off)

    def _seed_streams(self):
        """Give the tracker its model-parallel stream, unless ``random.model_parallel_seed``
        did: seeded from the model's seed by the same rule (per tp rank and stage), so that
        the sequence-parallel dropouts of this model draw different masks per tp rank."""
        tracker = msrandom.get_rng_tracker()
        if not self.init.sequence_parallel or msrandom.MODEL_PARALLEL_RNG in tracker.get_states():
            return
        seeds = msrandom.seeds_for(self.seed, tp_rank=self.tp.rank, pp_rank=self.pp.rank)
        tracker.add(msrandom.MODEL_PARALLEL_RNG, seeds[msrandom.MODEL_PARALLEL_RNG])

    # ------------------------------------------------------------------ data
    def shard_batch(self, ids):
        """This rank's tokens of ``ids`` ``(rows, S)``: ``(S_cp, rows)`` int32 numpy, its cp
        rows (zigzag for the load-balanced ring) with the sequence first."""
        return np.ascontiguousarray(np.asarray(ids)[:, self.seq_rows].T).astype(np.int32)

    def construct(self, local_ids, local_labels):
        """pp == 1: the mean loss over this rank's tokens (ids/labels from :meth:`shard_batch`)."""
        return self.loss_fn(self.chunks[0](local_ids), local_labels)

    # ------------------------------------------------------------------ training
    def forward_backward(self, input_ids, labels, num_microbatches: int = 1, schedule=None,
                         mode: str = "jit", optimizer=None):
        """One step's forward and backward over ``num_microbatches`` micro-batches.

        Args:
            input_ids, labels: This dp rank's full sequences ``(m * b, S)`` (int32, a
                Tensor or numpy array), the same on every rank of its tp x cp x pp slice.
            num_microbatches: ``m``; the rows are cut into ``m`` micro-batches of ``b``.
            schedule: pp > 1: ``"1f1b"`` (default), ``"gpipe"``, or ``"interleaved"``
                (the default and the only choice when virtual_pipeline_stages > 1).
            mode: ``"jit"`` (compiled forward and backward) or ``"pynative"``.
            optimizer: The ``DistributedOptimizer`` the gradients go to next. With its
                ``overlap_grad_reduce=True`` each bucket's dp-cp reduction is launched
                during the backward (PyNative: from gradient hooks during the last
                micro-batch's; pp > 1: after each chunk's last backward) and the
                optimizer call waits on it; see ``optimizer.grad_reduce_overlap(mode,
                pp)``. With its ``overlap_param_gather=True`` (stages 1-2, PyNative) the
                model is attached (``optimizer.attach_param_gather``): the optimizer's
                weight gathers are waited on by this forward, layer by layer; in
                ``mode="jit"`` they are finished first. The returned gradients are the
                same either way.

        Returns:
            ``(loss, grads)``: the mean loss over the tokens of ``input_ids`` (a float32
            scalar, the same on every rank of the slice) and the gradients of
            :meth:`trainable_params` (of this rank's mean loss over its tokens, summed
            over micro-batches / m), NOT yet reduced over dp-cp, tp (sequence-parallel
            parameters) or the embedding group: hand them to ``GradientFinalizer`` or
            ``DistributedOptimizer``.

        Raises:
            ModelError: bad shapes, dtypes, ``num_microbatches`` or schedule; before any
                collective.
        """
        m, sched = self._check_step(input_ids, labels, num_microbatches, schedule, mode)
        ids = self.shard_batch(_numpy(input_ids))
        tgt = self.shard_batch(_numpy(labels))
        xs = [ms.Tensor(a) for a in np.split(ids, m, axis=1)]
        ts = [ms.Tensor(a) for a in np.split(tgt, m, axis=1)]
        params = self.trainable_params()
        self._last_microbatches = m
        if optimizer is not None and getattr(optimizer, "overlap_param_gather", False):
            # The last step's weights: gathered by this forward's pre-hooks (PyNative) or
            # now (a compiled forward runs no hooks).
            if optimizer.param_gather_overlap(mode)[0]:
                optimizer.attach_param_gather(self)
            else:
                optimizer.finish_param_gather()
        overlap = None
        if optimizer is not None and getattr(optimizer, "overlap_grad_reduce", False) \
                and optimizer.grad_reduce_overlap(mode, self.pp.size)[0]:
            overlap = optimizer
            overlap.start_step()
        if any(getattr(p, "fsdp", None) is not None for p in params):
            from ..fsdp import gather_in_calls

            # Under fully_shard the chunks run the model's parameters without calling
            # the model; the head reads the output layer's (or the tied embedding's)
            # weight without calling its owner: eagerly, only a call of a sharded cell
            # makes such a read gather, so each chunk counts as one.
            for chunk in self.chunks:
                gather_in_calls(chunk)
        if self.pp.size == 1:
            self._reset_moe(m)
            loss, grads = self._accumulate(xs, ts, mode, overlap)
        else:
            from ..pipeline import forward_backward
            from ..pipeline.recompute import model_request

            if mode == "jit":
                self._compile_stages(xs[0], ts[0])
            self._reset_moe(m)  # after the compile runs: they count into the buffers too
            stage = self.chunks if sched == "interleaved" else self.chunks[0]
            # The stages keep their forwards until their backwards; the cells marked by
            # config.recompute recompute inside them (pipeline.recompute.model_request).
            done = None
            if overlap is not None:
                def done(c, chunk_params, chunk_grads):
                    overlap.grads_ready({q.name: g for q, g in zip(chunk_params, chunk_grads)})
            loss, grads = forward_backward(stage, xs, ts, self.loss_fn, schedule=sched, mode=mode,
                                           group=self.pp,
                                           recompute=model_request(self.config.recompute),
                                           on_chunk_done=done)
            order = {id(p): i for i, p in enumerate(
                q for chunk in self.chunks for q in chunk.trainable_params())}
            grads = tuple(grads[order[id(p)]] for p in params)
        if self.cp.size > 1:
            loss = C.all_reduce(loss, self.cp) / self.cp.size
        return loss, grads

    # ------------------------------------------------------------------ MoE
    def _reset_moe(self, m: int) -> None:
        """Zero the MoE layers' step buffers; their aux loss gets the micro-batch weight 1/m."""
        for block in self.moe_blocks.values():
            for buf in block.buffers():
                buf.set_data(ops.zeros(buf.shape, buf.dtype))
            if float(block.aux_scale.asnumpy()) != 1.0 / m:
                block.aux_scale.set_data(ms.Tensor(np.float32(1.0 / m)))

    def moe_metrics(self) -> dict:
        """This rank's MoE statistics of the last :meth:`forward_backward` (numpy, no collective).

        Returns:
            ``{"layers": [global index], "aux_loss": (n,) the aux loss of each MoE layer
            here (mean over micro-batches, as it enters the objective), "tokens": (n, E)
            tokens of this rank's input routed to each expert, summed over the
            micro-batches, "dropped": (n,) (token, expert) assignments dropped by
            capacity}``; empty lists for a dense model. Tokens are this rank's: summed
            over the ranks that hold other tokens (dp, cp, and tp under sequence
            parallelism) they count the step's (``training.loop.Trainer`` does it).
        """
        layers = sorted(self.moe_blocks)
        m = getattr(self, "_last_microbatches", 1)
        aux, tokens, dropped = [], [], []
        for i in layers:
            block = self.moe_blocks[i]
            calls = max(float(block.calls.asnumpy()), 1.0)
            counts = block.tokens.asnumpy().astype(np.float64) * m / calls
            aux.append(float(block.aux_sum.asnumpy()) / calls)
            tokens.append(counts[:-1])
            dropped.append(counts[-1])
        e = self.config.num_moe_experts or 0
        return {"layers": layers, "aux_loss": np.array(aux, np.float64),
                "tokens": np.array(tokens, np.float64).reshape(len(layers), e),
                "dropped": np.array(dropped, np.float64)}

    def update_expert_bias(self, tokens: dict) -> None:
        """Aux-loss-free balancing: move each MoE layer's expert bias with ``tokens``
        ({global layer index: tokens per expert of the step, summed over the
        data-parallel ranks}); a no-op for layers without ``moe_router_enable_expert_bias``."""
        for i, block in self.moe_blocks.items():
            if i in tokens:
                block.moe.update_expert_bias(ms.Tensor(np.asarray(tokens[i], np.float32)))

    def _compile_stages(self, x0, t0):
        """Compile every chunk's forward, backward (and loss) before the pipeline runs.

        Under jit a stage compiles at its first call; in the pipeline its neighbour then
        waits in a transfer for as long as that takes (tens of seconds for a few layers
        on a loaded CPU), and MindSpore's CPU collectives give up on a wait that long
        (measured: "RingAllGather CollectiveWait failed" after ~55 s). Running each
        chunk once on zeros compiles it here, where only this stage's own tp/cp peers,
        which do the same, take part. Once per input shape (the compiled functions are
        cached on the chunks).
        """
        from ..pipeline.recompute import model_request, runtime_recompute
        from ..pipeline.runtime import _context_parallel
        from ..pipeline.runtime import _model_parallel as _pipeline_model_parallel
        from ..pipeline.stage_fns import stage_fns

        key = (tuple(x0.shape), tuple(t0.shape))
        if key in self.__dict__.setdefault("_compiled_for", set()):
            return
        stages = self.pp.size * self.virtual_stages
        keep = runtime_recompute(
            "interleaved" if self.virtual_stages > 1 else "1f1b", "jit",
            model_request(self.config.recompute), self.pp.size, self.virtual_stages,
            _pipeline_model_parallel(self.chunks),
            context_parallel=_context_parallel())[0] != "full"
        s_cp, b = int(x0.shape[0]), int(x0.shape[1])
        rows = s_cp // self.tp.size if self.init.sequence_parallel else s_cp
        hidden = ops.zeros((rows, b, self.config.hidden_size), self.init.dtype)
        for c, chunk in enumerate(self.chunks):
            k = c * self.pp.size + self.pp.rank
            first, last = k == 0, k == stages - 1
            fns = stage_fns(chunk, self.loss_fn, "jit", first, last)
            x = x0 if first else hidden
            if last:
                fns.loss(x, t0, ms.Tensor(0.0, ms.float32), fns.zeros(), ops.zeros((), ms.float32))
            else:
                # What the pipeline will run: the kept forward and its backward, or the
                # forward and the recomputing backward.
                if keep:
                    y, pending = fns.keep(x)
                    fns.backward_kept(pending, ops.zeros(y.shape, y.dtype), fns.zeros())
                else:
                    y = fns.forward(x)
                    fns.backward(x, ops.zeros(y.shape, y.dtype), fns.zeros())
        self._compiled_for.add(key)

    def _accumulate(self, xs, ts, mode, optimizer=None):
        from ..pipeline.stage_fns import stage_fns

        chunk = self.chunks[0]
        fns = stage_fns(chunk, self.loss_fn, mode, True, True)
        acc, loss = fns.zeros(), ops.zeros((), ms.float32)
        scale = ms.Tensor(1.0 / len(xs), ms.float32)
        for k, (x, t) in enumerate(zip(xs, ts)):
            if optimizer is not None and k == len(xs) - 1:
                # The last micro-batch's backward launches the reduction (gradient hooks
                # add this backward's gradients to the sum so far, as fns.loss does).
                earlier = {q.name: a for q, a in zip(fns.params, acc)}
                with optimizer.overlap_backward(earlier):
                    _, acc, loss = fns.loss(x, t, scale, acc, loss)
            else:
                _, acc, loss = fns.loss(x, t, scale, acc, loss)
        return loss, tuple(acc)

    def _check_step(self, input_ids, labels, m, schedule, mode):
        name = "GPTModel.forward_backward"
        if mode not in MODES:
            raise ModelError(f"{name}: mode={mode!r} is invalid: expected one of {', '.join(MODES)}.")
        if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 1:
            raise ModelError(f"{name}: num_microbatches={m!r} is invalid: expected an integer >= 1.")
        s = self.config.seq_length
        shapes = []
        for what, a in (("input_ids", input_ids), ("labels", labels)):
            arr = _numpy(a)
            if arr.ndim != 2 or arr.shape[1] != s or arr.shape[0] % m or arr.shape[0] == 0:
                raise ModelError(
                    f"{name}: {what} has shape {tuple(arr.shape)}: expected (rows, seq_length="
                    f"{s}) with rows a positive multiple of num_microbatches={m} (each "
                    "micro-batch takes rows/m sequences). Pass this dp rank's full sequences.")
            if not np.issubdtype(arr.dtype, np.integer):
                raise ModelError(f"{name}: {what} has dtype {arr.dtype}: expected integer token ids "
                                 "(int32).")
            if arr.size and (arr.min() < 0 or arr.max() >= self.config.vocab_size):
                raise ModelError(f"{name}: {what} holds ids outside [0, {self.config.vocab_size}) "
                                 f"(min {arr.min()}, max {arr.max()}); map them into the vocabulary.")
            shapes.append(arr.shape)
        if shapes[0] != shapes[1]:
            raise ModelError(f"{name}: input_ids {shapes[0]} and labels {shapes[1]} differ in shape.")
        v = self.virtual_stages
        if schedule is None:
            schedule = "interleaved" if v > 1 else "1f1b"
        if schedule not in SCHEDULES:
            raise ModelError(f"{name}: schedule={schedule!r} is invalid: expected one of "
                             f"{', '.join(SCHEDULES)}.")
        if self.pp.size > 1 and (schedule == "interleaved") != (v > 1):
            raise ModelError(
                f"{name}: schedule={schedule!r} with virtual_pipeline_stages={v}: the interleaved "
                "schedule runs exactly when each rank holds several chunks. Use schedule=None.")
        if self.pp.size > 1 and schedule == "interleaved" and m % self.pp.size:
            raise ModelError(f"{name}: num_microbatches={m} is not a multiple of pp="
                             f"{self.pp.size}, which the interleaved schedule needs.")
        return int(m), schedule


def _numpy(a) -> np.ndarray:
    return a.asnumpy() if hasattr(a, "asnumpy") else np.asarray(a)
