"""Test-only harness checks of sharded checkpoints on real ranks: train, save, change layout,
load, resume (``msdist verify`` runs none of them; the worker imports this module through
``spec["modules"]``, ``["_checkpoint_checks"]``, with tests/ on the ranks' PYTHONPATH).

``checkpoint.layout_change`` (any world size divisible by the layouts' model sizes):

1. At the first layout (default tp2 x dp2), train a small tensor-parallel MLP model
   (two layers of ``ColumnParallelLinear -> tanh -> RowParallelLinear``, the first one's
   output features interleaved with ``partition_stride=3`` like a fused gate/up/value
   weight, a replicated norm scale, AdamW) for ``steps`` steps, save (model + optimizer
   moments), then train ``steps`` more: the uninterrupted losses.
2. For each other layout (default tp4, then tp1 x dp4): re-create the parallel groups,
   build the model from a DIFFERENT seed, ``load`` the checkpoint, save it again and
   check (rank 0, offline merge) that every tensor, moments included, equals the first
   save bit for bit; then train the same ``steps`` batches: the losses must equal the
   uninterrupted run's within ``atol``.
3. At each ``pipelines`` layout (tp2 x pp2: stage s builds only layer s, as ``layers.0``
   named globally ``layers.<s>``), load and re-save: the state equals the first save
   bit for bit (each stage's optimizer has its own step counter: saved as copies).

The loss of a step is the mean over the global batch (each dp rank's mean, averaged),
so it is the same number at every layout. Restores the layout in force afterwards.
"""

from __future__ import annotations

import os
import shutil

import numpy as np

from mindscience.distributed.harness.checks.groups import current_layout_args, layout_label, reinit, restore
from mindscience.distributed.harness.registry import CheckContext, check

SEQ, BATCH, HIDDEN, FFN = 4, 4, 8, 24


def _global_weights(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(2):
        out[f"layers.{i}.fc1.weight"] = (rng.standard_normal((FFN, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
        out[f"layers.{i}.fc1.bias"] = (0.1 * rng.standard_normal(FFN)).astype(np.float32)
        out[f"layers.{i}.fc2.weight"] = (rng.standard_normal((HIDDEN, FFN)) / np.sqrt(FFN)).astype(np.float32)
        out[f"layers.{i}.fc2.bias"] = (0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
        out[f"layers.{i}.scale"] = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
    return out


def _build(seed: int, stage_layers=None):
    """The model at the current layout, its parameters sliced from the seed's globals.

    ``stage_layers`` (pipeline): build only this stage's layers ``(first, count)``, named
    ``layers.0..`` locally and ``layers.<first>..`` globally (set_global_layer_names)."""
    import mindspore as ms
    from mindspore import nn, ops

    from mindscience.distributed import manager
    from mindscience.distributed.checkpoint.plan import piece_for
    from mindscience.distributed.modules import ColumnParallelLinear, RowParallelLinear
    from mindscience.distributed.sharding import get_sharding, mark_sharding

    class Layer(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc1 = ColumnParallelLinear(HIDDEN, FFN, gather_output=False, compute_dtype=None)
            self.fc2 = RowParallelLinear(FFN, HIDDEN, input_is_parallel=True, compute_dtype=None)
            # Interleaved features: fc1's rows and fc2's matching columns in 3 blocks per rank.
            mark_sharding(self.fc1.weight, "tp", 0, partition_stride=3)
            mark_sharding(self.fc1.bias, "tp", 0, partition_stride=3)
            mark_sharding(self.fc2.weight, "tp", 1, partition_stride=3)
            self.scale = ms.Parameter(ms.Tensor(np.ones(HIDDEN, np.float32)), name="scale")

        def construct(self, x):
            return x + self.fc2(ops.tanh(self.fc1(x))) * self.scale

    class Model(nn.Cell):
        def __init__(self, count):
            super().__init__()
            self.layers = nn.CellList([Layer() for _ in range(count)])

        def construct(self, x, y):
            for layer in self.layers:
                x = layer(x)
            return ((x - y) ** 2).mean()

    from mindscience.distributed import checkpoint

    first, count = stage_layers or (0, 2)
    model = Model(count)
    checkpoint.set_global_layer_names(model, first)
    layout, rank = manager.get_layout(), _rank()
    weights = _global_weights(seed)
    for name, param, _ in checkpoint.named_parameters(model):
        full = weights[name]
        piece = piece_for(name, full.shape, get_sharding(param), layout, rank)
        if piece["dim"] is not None:
            idx = [slice(None)] * full.ndim
            parts = []
            for g0, g1, _ in piece["ranges"]:
                idx[piece["dim"]] = slice(g0, g1)
                parts.append(full[tuple(idx)])
            full = np.concatenate(parts, axis=piece["dim"])
        param.set_data(ms.Tensor(full))
    optimizer = nn.AdamWeightDecay(model.trainable_params(), learning_rate=0.02, weight_decay=0.01)
    state = checkpoint.set_global_layer_names(nn.CellList([model, optimizer]), first)
    return model, optimizer, state


def _rank() -> int:
    from mindspore.communication import get_rank

    return get_rank()


def _batches(steps: int, offset: int):
    rng = np.random.default_rng(1234)
    data = [(rng.standard_normal((SEQ, BATCH, HIDDEN)).astype(np.float32),
             rng.standard_normal((SEQ, BATCH, HIDDEN)).astype(np.float32)) for _ in range(offset + steps)]
    return data[offset:]


def group_mean(loss, group) -> float:
    """The global batch's loss from this rank's mean loss: the mean over ``group``."""
    from mindscience.distributed.collectives import all_reduce

    if group.size == 1:
        return float(loss.asnumpy())
    return float(all_reduce(loss.reshape(1), group).asnumpy()[0]) / group.size


def train_steps(loss_fn, optimizer, batches, local, group) -> list:
    """One step per global batch ``(x, y)``: ``loss_fn(*local(x, y))`` (this rank's share),
    its gradients finalized (sequence-parallel sums over tp, the mean over dp-cp), the
    optimizer; returns each step's global loss, :func:`group_mean` over ``group``."""
    import mindspore as ms

    from mindscience.distributed.finalize import GradientFinalizer

    grad_fn = ms.value_and_grad(loss_fn, None, optimizer.parameters)
    finalizer = GradientFinalizer(optimizer.parameters)
    losses = []
    for x, y in batches:
        loss, grads = grad_fn(*(ms.Tensor(a) for a in local(x, y)))
        optimizer(finalizer(grads))
        losses.append(group_mean(loss, group))
    return losses


def _train(model, optimizer, batches) -> list:
    """Global loss per step (the dp mean of the local mean losses)."""
    from mindscience.distributed import manager

    dp = manager.get_data_parallel_group()
    lo = manager.get_data_parallel_rank() * (BATCH // dp.size)
    return train_steps(model, optimizer, batches,
                       lambda x, y: (x[:, lo:lo + BATCH // dp.size], y[:, lo:lo + BATCH // dp.size]), dp)


def _merged(directory: str, out: str) -> dict:
    from mindscience.distributed.checkpoint import offline
    from mindscience.distributed.checkpoint.files import read_header, tensor_view

    offline.merge(directory, out)
    header, start, _ = read_header(out)
    return {k: np.array(tensor_view(out, header, start, k)) for k in header if k != "__metadata__"}


@check("checkpoint.layout_change")
def layout_change(ctx: CheckContext, first=None, others=None, steps: int = 3,
                  atol: float = 1e-6, pipelines=()) -> list:
    """Save at ``first`` (a dict of tp/cp/pp), load at each of ``others``, compare losses;
    at each of ``pipelines`` (e.g. ``{"tp": 2, "pp": 2}``: stage s holds layer s) load and
    compare the re-saved state only (no pipeline training here)."""
    from mindscience.distributed import checkpoint, manager

    first = first or {"tp": 2}
    others = others or [{"tp": 4}, {"tp": 1}]
    saved_args = current_layout_args(manager) if manager.is_initialized() else None
    root = os.path.join(ctx.out_dir or ".", "checkpoint_layout_change")
    ckpt, again = os.path.join(root, "ckpt"), os.path.join(root, "again")

    records = []
    try:
        lay = reinit(manager, first)
        model, opt, state = _build(seed=0)
        _train(model, opt, _batches(steps, 0))
        checkpoint.save(state, ckpt, step=steps, extra={"layout": layout_label(lay)})
        want = _train(model, opt, _batches(steps, steps))
        reference = _merged(ckpt, os.path.join(root, f"ref_{ctx.rank}.safetensors"))
        records.append({"check": "checkpoint.layout_change", "group": layout_label(lay),
                        "passed": True, "max_error": 0.0, "losses": want, "role": "uninterrupted"})
        for spec in others:
            lay = reinit(manager, spec)
            model, opt, state = _build(seed=99)
            info = checkpoint.load(state, ckpt)
            checkpoint.save(state, again, step=info["step"])
            got_state = _merged(again, os.path.join(root, f"again_{ctx.rank}.safetensors"))
            os.remove(os.path.join(root, f"again_{ctx.rank}.safetensors"))
            differ = sorted(set(got_state) ^ set(reference)) + sorted(
                k for k in set(got_state) & set(reference)
                if not np.array_equal(got_state[k], reference[k]))
            state_ok = not differ
            moments = sorted(k for k in reference if "adam_m" in k or "adam_v" in k)
            got = _train(model, opt, _batches(steps, steps))
            err = float(np.max(np.abs(np.array(got) - np.array(want))))
            records.append({
                "check": "checkpoint.layout_change", "group": layout_label(lay),
                "passed": bool(state_ok and err <= atol and info["step"] == steps and moments),
                "max_error": err, "losses": got, "state_bit_exact": bool(state_ok),
                "state_differs": differ[:5],
                "moments": len(moments), "saved_step": info["step"], "role": "resumed"})
            _barrier()  # every rank has read `again` before the next save replaces it
        for spec in pipelines:
            lay = reinit(manager, spec)
            per = 2 // lay.pp
            model, opt, state = _build(seed=99, stage_layers=(manager.get_pipeline_parallel_rank() * per, per))
            info = checkpoint.load(state, ckpt)
            checkpoint.save(state, again, step=info["step"])
            got_state = _merged(again, os.path.join(root, f"again_{ctx.rank}.safetensors"))
            os.remove(os.path.join(root, f"again_{ctx.rank}.safetensors"))
            differ = sorted(set(got_state) ^ set(reference)) + sorted(
                k for k in set(got_state) & set(reference)
                if not np.array_equal(got_state[k], reference[k]))
            records.append({"check": "checkpoint.layout_change", "group": layout_label(lay),
                            "passed": not differ, "max_error": 0.0, "state_bit_exact": not differ,
                            "state_differs": differ[:5], "loaded": len(info["loaded"]),
                            "role": "pipeline_stage"})
            _barrier()
    finally:
        restore(manager, saved_args)
    if ctx.rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return records


def _barrier() -> None:
    """Every rank of the world got here (nothing to wait for without parallel groups)."""
    from mindscience.distributed.checkpoint.cell import _barrier as world_barrier, _world

    world_barrier(_world()[0])
