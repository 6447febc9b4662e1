"""``docs.snippet``: run one Python snippet of the documentation inside a rank.

Each snippet (tests/_docs_snippets.py) names a setup below: a function that sets the
layout (or leaves the manager uninitialized for a snippet that calls
``initialize_parallel`` itself) and returns the names the snippet uses without defining
them (``x``, ``net``, ``MyModel``, ...). The snippet then runs as written, with every
rank of the 4-rank launch in one shared scratch folder (its working directory, so
``"ckpt/step_100"`` is one checkpoint for all ranks); ``AFTER[setup]`` checks a few
values the snippet's comments promise. A failure is returned as a record (the other
ranks run the same code, so they fail alike instead of waiting in a collective).
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import time
import traceback
import types

import numpy as np

from _docs_snippets import ROOT, snippets_of
from mindscience.distributed.harness.registry import CheckContext, check

WORKDIR = "docs-snippets"


def _tensor(shape, seed=0, dtype=np.float32):
    import mindspore as ms

    return ms.Tensor(np.random.default_rng(seed).standard_normal(shape).astype(dtype))


def _init(**sizes):
    from mindscience.distributed import manager

    manager.initialize_parallel(**sizes)


def _loss_net(din=8, dout=4):
    """A Cell ``net(x, y) -> loss`` (a dense layer and a mean-squared error)."""
    from mindspore import nn

    return nn.WithLossCell(nn.Dense(din, dout), nn.MSELoss())


def _mlp():
    """Column -> Row MLP: tp-sharded under tp > 1, dense otherwise (same global names)."""
    import mindspore as ms
    from mindspore import nn

    from mindscience.distributed.modules import ColumnParallelLinear, RowParallelLinear

    class MLP(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc1 = ColumnParallelLinear(8, 16, gather_output=False, compute_dtype=ms.float32)
            self.fc2 = RowParallelLinear(16, 8, input_is_parallel=True, compute_dtype=ms.float32)

        def construct(self, x):
            return self.fc2(ms.ops.relu(self.fc1(x)))

    ms.set_seed(0)
    return MLP()


def _schedule():
    from mindspore import nn

    return nn.PolynomialDecayLR(1e-3, 1e-4, 10, power=1.0)


# ----------------------------------------------------------------------------- setups
def setup_groups(ctx):
    return {"x": _tensor((8, 4))}


def setup_moe_groups(ctx):
    # The snippet initializes the expert groups itself (4 ranks: tp2, ep2, etp1).
    return {}


def setup_moe_gptmodel(ctx):
    # The snippet initializes the expert groups itself (4 ranks: dp4, ep4).
    return {}


def setup_mappings_uneven(ctx):
    from mindscience.distributed import manager, mappings

    _init(context_parallel_size=4)
    return {"cp": manager.get_context_parallel_group(), "mappings": mappings, "x": _tensor((1003, 8))}


def setup_mappings_jit(ctx):
    import mindspore as ms

    from mindscience.distributed import manager, mappings

    _init(tensor_parallel_size=2)
    return {"ms": ms, "manager": manager, "mappings": mappings, "x": _tensor((4, 3))}


def setup_layers(ctx):
    import mindspore as ms

    _init(tensor_parallel_size=2)
    return {"ms": ms, "x": _tensor((4, 1024))}


def setup_attention(ctx):
    rng = np.random.default_rng(1)
    import mindspore as ms

    ids = ms.Tensor(rng.integers(0, 32000, (4, 2)).astype(np.int32))
    # S = 4 tokens, B = 2; q/k/v and x: this cp rank's S/cp = 2 rows.
    return {"ids": ids, "target": ms.Tensor(rng.integers(0, 32000, (4, 2)).astype(np.int32)),
            "p_local": _tensor((4, 2, 8)), "q": _tensor((2, 2, 4, 8), 2), "k": _tensor((2, 2, 2, 8), 3),
            "v": _tensor((2, 2, 2, 8), 4), "x": _tensor((2, 2, 1024), 5)}


def setup_dp_net(ctx):
    _init()  # dp4
    return {"net": _loss_net()}


def setup_param_gather(ctx):
    """dp4, the loss net and two batches of (x, y)."""
    _init()
    return {"net": _loss_net(), "batches": [(_tensor((4, 8), 10 + k), _tensor((4, 4), 20 + k)) for k in range(2)]}


def setup_finalizer_net(ctx):
    return setup_dp_net(ctx)


def setup_fsdp(ctx):
    from mindspore import nn

    class MyModel(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layers = nn.CellList([nn.Dense(8, 8) for _ in range(2)])
            self.head = nn.Dense(8, 4)

        def construct(self, x, y):
            for layer in self.layers:
                x = layer(x)
            return ((self.head(x) - y) ** 2).mean()

    return {"MyModel": MyModel}


def setup_recompute(ctx):
    from mindspore import nn

    _init(tensor_parallel_size=2)

    class Model(nn.Cell):
        def __init__(self):
            super().__init__()
            self.mlp = nn.Dense(8, 8)

        def construct(self, x):
            return self.mlp(x)

    return {"model": Model()}


def _pipeline_names(m=4):
    from mindspore import nn

    from mindscience.distributed import manager

    _init(pipeline_parallel_size=2)  # pp2 x dp2
    first, last = manager.is_pipeline_first_stage(), manager.is_pipeline_last_stage()
    stage = nn.Dense(4, 4)
    inputs = [_tensor((2, 4), 10 + j) if first else None for j in range(m)]
    targets = [_tensor((2, 4), 20 + j) if last else None for j in range(m)]

    def loss_fn(out, target):
        return ((out - target) ** 2).mean()

    return {"stage": stage, "inputs": inputs, "targets": targets, "loss_fn": loss_fn}


def setup_recompute_rules(ctx):
    return {}  # the snippet imports what it asks


def setup_pipeline_recompute(ctx):
    return _pipeline_names()


def setup_pipeline_runtime(ctx):
    from mindspore import nn

    from mindscience.distributed.finalize import GradientFinalizer

    names = _pipeline_names()
    names.update(GradientFinalizer=GradientFinalizer,
                 optimizer=nn.SGD(names["stage"].trainable_params(), learning_rate=0.1))
    return names


def setup_p2p(ctx):
    import mindspore as ms

    from mindscience.distributed import manager

    _init(pipeline_parallel_size=2)
    return {"ms": ms, "x": _tensor((2, 3), ctx.rank), "group": manager.get_pipeline_parallel_group(),
            "shape": (2, 3), "grad": _tensor((2, 3), 30 + ctx.rank)}


def setup_zero_save(ctx):
    _init()  # dp4
    return {"net": _mlp(), "schedule": _schedule()}


def setup_zero_load(ctx):
    from mindspore import nn

    from mindscience.distributed import DistributedOptimizer, checkpoint

    _init(tensor_parallel_size=2)  # tp2 x dp2; the page's previous block imported the rest
    return {"net": _mlp(), "schedule": _schedule(), "nn": nn, "checkpoint": checkpoint,
            "DistributedOptimizer": DistributedOptimizer}


def setup_checkpoint(ctx):
    from mindspore import nn

    _init(tensor_parallel_size=2)
    model = _mlp()
    return {"model": model, "optimizer": nn.Adam(model.trainable_params(), learning_rate=1e-3)}


def setup_parallelize(ctx):
    import _parallelize_checks

    return {"MyDenseModel": lambda: _parallelize_checks.DenseLM(gqa=False)}


def setup_gpt(ctx):
    import mindspore as ms

    from mindscience.distributed.models import TransformerConfig

    cfg = TransformerConfig.from_model_spec("tiny-llama")
    rng = np.random.default_rng(7)
    rows = 2  # num_microbatches=2 micro-batches of 1 sequence
    return {"input_ids": ms.Tensor(rng.integers(0, cfg.vocab_size, (rows, cfg.seq_length)).astype(np.int32)),
            "labels": ms.Tensor(rng.integers(0, cfg.vocab_size, (rows, cfg.seq_length)).astype(np.int32))}


SETUPS = {name[len("setup_"):].replace("_", "-"): fn for name, fn in globals().items()
          if name.startswith("setup_") and callable(fn)}


# ----------------------------------------------------------------------------- promises
def _finite(value) -> bool:
    return bool(np.isfinite(np.asarray(value.asnumpy() if hasattr(value, "asnumpy") else value)).all())


def _train_step_runs(ns) -> dict:
    """Call the snippet's compiled ``train_step`` once on a small batch: its loss is finite."""
    out = ns["train_step"](_tensor((2, 8), 40), _tensor((2, 4), 41))
    loss = out[0] if isinstance(out, tuple) else out
    return {"loss_finite": _finite(loss)}


AFTER = {
    # Called once: the GradientFinalizer step. The DistributedOptimizer steps of the memory page
    # (dp-net, fsdp) pass as a fresh msrun script but failed to compile in this shared rank after
    # the other snippets ("'Tensor' object has no attribute 'name'"), so they are only defined here.
    "finalizer-net": _train_step_runs,
    "groups": lambda ns: {"y_shape": list(ns["y"].shape), "tp_ranks": list(ns["tp"].ranks)},
    "moe-groups": lambda ns: {"ep_ranks": list(ns["ep"].ranks), "edp_ranks": list(ns["edp"].ranks),
                              "dispatch_ranks": list(ns["dispatch"].ranks), "first": ns["first"]},
    "mappings-uneven": lambda ns: {"sizes": list(ns["sizes"]), "full_shape": list(ns["full"].shape),
                                   "full_is_x": bool(np.array_equal(ns["full"].asnumpy(), ns["x"].asnumpy())),
                                   "heads_shape": list(ns["heads"].shape)},
    "mappings-jit": lambda ns: {"value": float(ns["value"].asnumpy()),
                                "expected": float(2 * (ns["x"].asnumpy() ** 2).sum())},
    "layers": lambda ns: {"y_shape": list(ns["y"].shape)},
    "attention": lambda ns: {"loss_finite": _finite(ns["loss"]), "out_shape": list(ns["out"].shape),
                             "y_shape": list(ns["y"].shape)},
    "pipeline-recompute": lambda ns: {"what_ran": ns["last_recompute"]()[0],
                                      "would_run": ns["runtime_recompute"]("1f1b", "pynative", "full", pp=1)[0]},
    "pipeline-runtime": lambda ns: {"loss_finite": _finite(ns["loss"])},
    "recompute-rules": lambda ns: {"kept": ns["kept"], "kept_jit": ns["kept_jit"]},
    "checkpoint": lambda ns: {"loaded_step": ns["info"]["step"]},  # "step" is the harness's
    "gpt": lambda ns: {"loss_finite": _finite(ns["loss"])},
}


@contextlib.contextmanager
def _cwd(path):
    old = os.getcwd()
    os.makedirs(path, exist_ok=True)
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


@check("docs.snippet")
def snippet(ctx: CheckContext, path: str, index: int) -> dict:
    """Run snippet ``index`` of page ``path`` under its setup; one record."""
    import mindspore as ms

    from mindscience.distributed import manager

    record = {"check": "docs.snippet", "page": path, "index": index}
    start = time.perf_counter()
    try:
        found = snippets_of(path)[index]
        record["setup"] = found.setup
        if manager.is_initialized():
            manager.destroy_parallel()
        ms.set_context(mode=ms.PYNATIVE_MODE)
        with _cwd(os.path.join(ctx.out_dir, WORKDIR)):
            # A real module: ms.jit resolves a function's globals by importing its __module__.
            module = types.ModuleType(f"_docs_snippet_{len(sys.modules)}")
            sys.modules[module.__name__] = module
            names = module.__dict__
            names.update(SETUPS[found.setup](ctx))
            filename = os.path.join(ROOT, f"{path}#{index}")
            # ms.jit reads a function's source (inspect.getsource): give it the snippet's.
            linecache.cache[filename] = (len(found.code), None, found.code.splitlines(True), filename)
            exec(compile(found.code, filename, "exec"), names)  # noqa: S102
            record.update(AFTER.get(found.setup, lambda ns: {})(names))
        record["passed"] = True
    except Exception:  # noqa: BLE001 - reported to the test, which prints it
        record.update(passed=False, error=traceback.format_exc()[-3000:])
    finally:
        if manager.is_initialized():
            manager.destroy_parallel()
    record["seconds"] = round(time.perf_counter() - start, 2)
    return record
