"""Helpers shared by the examples: job setup, softmax attention, comparisons, reporting.

Not an example itself. The example scripts import it as a sibling module (``python
examples/x.py`` and ``msrun ... examples/x.py`` put ``examples/`` on ``sys.path``).
"""

from __future__ import annotations

import math
import os

import numpy as np

import mindspore as ms
from mindspore import mint, nn, ops

from mindscience.distributed import collectives, manager, mappings
from mindscience.distributed.group import ParallelGroup

ATOL = 1e-4


# ----------------------------------------------------------------------------- job setup
def launched_by_msrun() -> bool:
    return "MS_ROLE" in os.environ


def setup(tensor_parallel_size: int = 1, context_parallel_size: int = 1,
          pipeline_parallel_size: int = 1) -> None:
    """Join the msrun job and build the parallel groups (skips what is already done).

    In a plain ``python examples/x.py`` process (no msrun) nothing is initialized: the
    layers and mappings then run on size-1 groups, i.e. as the dense model.
    The examples' ``run()`` functions expect this done, so that a caller holding other
    groups (the test harness) can run them too.
    """
    ms.set_context(mode=ms.PYNATIVE_MODE)
    sizes = (tensor_parallel_size, context_parallel_size, pipeline_parallel_size)
    if not launched_by_msrun():
        if math.prod(sizes) > 1:
            raise SystemExit("parallel sizes > 1 need a job started with msrun")
        return
    from mindspore.communication import init

    if os.environ.get("MS_ROLE") == "MS_SCHED":
        init()  # msrun's scheduler runs this script too: serve the job, then leave
        raise SystemExit(0)
    if not manager._communication_initialized():  # noqa: SLF001 - avoid a second init()
        init()
    layout = manager.get_layout() if manager.is_initialized() else None
    if layout is not None and (layout.tp, layout.cp, layout.pp) == sizes:
        return
    manager.destroy_parallel()
    manager.initialize_parallel(
        tensor_parallel_size=tensor_parallel_size, context_parallel_size=context_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
    )


def tp_group() -> ParallelGroup:
    """The tensor-parallel group, or a size-1 group when nothing is initialized."""
    return manager.get_tensor_parallel_group() if manager.is_initialized() else ParallelGroup.trivial("tp")


def cp_group() -> ParallelGroup:
    """The context-parallel group, or a size-1 group when nothing is initialized."""
    return manager.get_context_parallel_group() if manager.is_initialized() else ParallelGroup.trivial("cp")


def dp_group() -> ParallelGroup:
    """The data-parallel group, or a size-1 group when nothing is initialized."""
    return manager.get_data_parallel_group() if manager.is_initialized() else ParallelGroup.trivial("dp")


def pp_group() -> ParallelGroup:
    """The pipeline-parallel group, or a size-1 group when nothing is initialized."""
    return manager.get_pipeline_parallel_group() if manager.is_initialized() else ParallelGroup.trivial("pp")


def layout_label() -> str:
    """The layout in force as ``"tp2 x cp2 x dp2 x pp1"`` (all 1 when nothing is initialized)."""
    layout = manager.get_layout() if manager.is_initialized() else None
    sizes = {k: (getattr(layout, k) if layout is not None else 1) for k in ("tp", "cp", "dp", "pp")}
    return " x ".join(f"{k}{v}" for k, v in sizes.items())


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (``--steps 0`` is refused with the value and the fix)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected an integer >= 1")
    return value


def numel(net) -> int:
    """How many parameter values ``net`` holds in this process (its shards at a layout)."""
    return sum(int(np.prod(p.shape)) for p in net.trainable_params())


def world_rank() -> int:
    from mindspore.communication import get_rank

    return get_rank()


def all_ranks_passed(passed: bool) -> bool:
    """True when ``passed`` holds on every rank of the job (a world all-reduce)."""
    from mindspore.communication import get_group_size

    if get_group_size() == 1:
        return passed
    failed = ops.AllReduce()(ms.Tensor([0.0 if passed else 1.0], ms.float32))
    return float(failed.asnumpy()[0]) == 0.0


# ----------------------------------------------------------------------------- attention
def split_qkv(qkv, head_dim: int):
    """``(S, B, h*3*hd)`` -> q, k, v of shape ``(S, B, h, hd)``.

    The fused projection's features are laid out per head, ``[head, (q|k|v), hd]``, so
    that any contiguous chunk of ``3*hd*k`` features holds ``k`` complete heads: a
    column-parallel (or all-to-all) split of the last dim then hands out whole heads.
    """
    s, b, f = qkv.shape
    t = qkv.reshape(s, b, f // (3 * head_dim), 3, head_dim)
    return t[:, :, :, 0], t[:, :, :, 1], t[:, :, :, 2]


def softmax_attention(q, k, v, causal: bool = True, q_offset: int = 0):
    """Plain softmax attention. q ``(Sq, B, h, hd)``, k/v ``(Sk, B, h, hd)`` -> ``(Sq, B, h*hd)``.

    With ``causal``, query ``i`` (global position ``q_offset + i``) sees keys ``0..q_offset+i``.
    """
    sq, b, h, hd = q.shape
    sk = k.shape[0]
    qh = q.transpose(1, 2, 0, 3)  # (B, h, Sq, hd)
    kh = k.transpose(1, 2, 3, 0)  # (B, h, hd, Sk)
    vh = v.transpose(1, 2, 0, 3)  # (B, h, Sk, hd)
    scores = mint.matmul(qh, kh) * (1.0 / math.sqrt(hd))
    if causal:
        rows = np.arange(sq)[:, None] + q_offset
        mask = ms.Tensor(np.arange(sk)[None, :] > rows)
        scores = ops.masked_fill(scores, mask, float("-inf"))
    probs = mint.nn.functional.softmax(scores, dim=-1)
    out = mint.matmul(probs, vh)  # (B, h, Sq, hd)
    return out.transpose(2, 0, 1, 3).reshape(sq, b, h * hd)


class DenseAttention(ms.nn.Cell):
    """The reference: fused qkv projection, softmax attention, output projection."""

    def __init__(self, d_model: int, num_heads: int, causal: bool = True):
        super().__init__()
        self.head_dim = d_model // num_heads
        self.causal = causal
        self.qkv = mint.nn.Linear(d_model, 3 * d_model)
        self.proj = mint.nn.Linear(d_model, d_model)

    def construct(self, x):
        q, k, v = split_qkv(self.qkv(x), self.head_dim)
        return self.proj(softmax_attention(q, k, v, self.causal))


# ----------------------------------------------------------------------------- comparing
def forward_backward(net, x, cotangent, **call_kwargs):
    """Output, input gradient and parameter gradients of ``sum(net(x, **call_kwargs) * cotangent)``."""
    params = net.trainable_params()

    def loss_fn(inp):
        out = net(inp, **call_kwargs)
        return (out * cotangent).sum(), out

    grad_fn = ms.value_and_grad(loss_fn, grad_position=0, weights=params, has_aux=True)
    (_, out), (dx, dparams) = grad_fn(x)
    return out, dx, {p.name: g for p, g in zip(params, dparams)}


def max_abs(a, b) -> float:
    a = a.asnumpy() if hasattr(a, "asnumpy") else np.asarray(a)
    b = b.asnumpy() if hasattr(b, "asnumpy") else np.asarray(b)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {a.shape} vs {b.shape}")
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.size else 0.0


def rows(t, group, split_sizes=None):
    """This rank's chunk of dim 0 (the sequence) of a full tensor: the even chunk, or
    with ``split_sizes`` (rows per group rank) its ``split_sizes[rank]`` rows."""
    if split_sizes is None:
        n = t.shape[0] // group.size
        return t[group.rank * n:(group.rank + 1) * n]
    start = mappings.split_offsets(split_sizes)[group.rank]
    return t[start:start + split_sizes[group.rank]]


def sequence_split(seq_len: int, group):
    """None when the group divides ``seq_len`` (the even split), else the balanced
    uneven split ``mappings.even_split_sizes(seq_len, G)``, e.g. 1003 over 4 ranks:
    ``[251, 251, 251, 250]``."""
    if seq_len % group.size == 0:
        return None
    return mappings.even_split_sizes(seq_len, group.size)


def cols(t, group):
    """This rank's chunk of the last dim of a full tensor."""
    n = t.shape[-1] // group.size
    return t[..., group.rank * n:(group.rank + 1) * n]


def all_reduce_grads(grads: dict, group) -> dict:
    """Sum replicated parameters' gradients over ``group`` (what data/context-parallel
    training does before the optimizer step)."""
    return {name: collectives.all_reduce(g, group) for name, g in grads.items()}


def result(name: str, errors: dict, atol: float = ATOL, **extra) -> dict:
    """A harness-style record: passed when every error is within ``atol``."""
    max_error = max(errors.values()) if errors else 0.0
    return {
        "check": name,
        "passed": bool(max_error <= atol),
        "max_error": max_error,
        "errors": errors,
        "atol": atol,
        **extra,
    }


def report(record: dict) -> int:
    """Print the record (rank 0 prints the table, every rank its failures); exit code."""
    rank = world_rank()
    ok_everywhere = all_ranks_passed(record["passed"])
    if rank == 0 or not record["passed"]:
        lines = [f"[rank {rank}] {record['check']}: max |parallel - dense| per quantity"]
        for key, err in record["errors"].items():
            flag = "ok" if err <= record["atol"] else "MISMATCH"
            lines.append(f"  {key:<28} {err:.3e}  {flag}")
        for key, value in record.items():
            if key not in ("check", "passed", "max_error", "errors", "atol"):
                lines.append(f"  {key}: {value}")
        print("\n".join(lines), flush=True)
    if rank == 0:
        verdict = "PASSED" if ok_everywhere else "FAILED"
        print(f"{record['check']}: {verdict} on all ranks (atol {record['atol']:g})", flush=True)
    return 0 if ok_everywhere else 1


def compare_cp_attention(name: str, model_cls, seq_len: int = 8, batch: int = 2, d_model: int = 16,
                         num_heads: int = 4, causal: bool = True, seed: int = 0, atol: float = ATOL) -> dict:
    """A context-parallel attention against the dense one, forward and backward, on this rank.

    Each rank feeds its rows of the sequence; the replicated weights' gradients are summed
    over cp (each rank holds its chunk's share) before the comparison. When cp does not
    divide ``seq_len`` (e.g. 1,003 over cp = 4) the sequence is sharded unevenly
    (:func:`sequence_split`: ``[251, 251, 251, 250]``) and the model is called as
    ``model(x, split_sizes=sizes)``; the record then carries ``seq_len`` and ``split_sizes``.
    """
    cp = cp_group()
    sizes = sequence_split(seq_len, cp)
    rng = np.random.default_rng(seed)
    x = ms.Tensor(rng.standard_normal((seq_len, batch, d_model)), ms.float32)
    cot = ms.Tensor(rng.standard_normal((seq_len, batch, d_model)), ms.float32)

    ms.set_seed(seed)
    dense = DenseAttention(d_model, num_heads, causal)
    ms.set_seed(seed)
    par = model_cls(d_model, num_heads, causal)

    d_out, d_dx, d_g = forward_backward(dense, x, cot)
    if sizes is None:
        p_out, p_dx, p_g = forward_backward(par, rows(x, cp), rows(cot, cp))
        extra = {}
    else:
        p_out, p_dx, p_g = forward_backward(par, rows(x, cp, sizes), rows(cot, cp, sizes),
                                            split_sizes=sizes)
        extra = {"seq_len": seq_len, "split_sizes": sizes}
    p_g = all_reduce_grads(p_g, cp)
    errors = {"output": max_abs(p_out, rows(d_out, cp, sizes)),
              "grad x": max_abs(p_dx, rows(d_dx, cp, sizes))}
    errors.update({f"grad {n}": max_abs(p_g[n], d_g[n]) for n in sorted(d_g)})
    return result(name, errors, atol, cp=cp.size, **extra)


def cp_main(run, description: str, argv=None) -> int:
    """Command line of the context-parallel examples: ``--cp N`` (default: all ranks),
    ``--seq-len S`` (default: the example's; one that cp does not divide, e.g. 1003 on
    4 ranks, shards the sequence unevenly) and ``--batch B``."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--cp", type=int, default=None, help="context-parallel size (default: all ranks)")
    parser.add_argument("--seq-len", type=int, default=None, metavar="S",
                        help="sequence length (default 8); when cp does not divide it (e.g. 1003 "
                             "over cp=4) the sequence is sharded unevenly with "
                             "mappings.even_split_sizes(S, cp)")
    parser.add_argument("--batch", type=int, default=None, metavar="B", help="batch size (default 2)")
    args = parser.parse_args(argv)
    for flag, value in (("--seq-len", args.seq_len), ("--batch", args.batch), ("--cp", args.cp)):
        if value is not None and value < 1:
            parser.error(f"{flag} {value} is invalid: expected an integer >= 1")
    from mindspore.communication import get_group_size

    setup(context_parallel_size=args.cp or get_group_size())
    kwargs = {k: v for k, v in (("seq_len", args.seq_len), ("batch", args.batch)) if v is not None}
    return report(run(**kwargs))


class LayerNorm(nn.Cell):
    """LayerNorm over the last dim (``mint.nn.LayerNorm`` has no CPU kernel in 2.10)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = ms.Parameter(ms.Tensor(np.ones(dim, np.float32)), name="weight")
        self.bias = ms.Parameter(ms.Tensor(np.zeros(dim, np.float32)), name="bias")
        self.eps = eps

    def construct(self, x):
        mean = mint.mean(x, -1, keepdim=True)
        var = mint.mean((x - mean) ** 2, -1, keepdim=True)
        return (x - mean) / mint.sqrt(var + self.eps) * self.weight + self.bias
