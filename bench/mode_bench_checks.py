"""Rank-side part of ``bench/bench_modes.py`` (a benchmark, not a test).

Registers the harness check ``bench.modes``. Every rank builds tp = world (4 ranks:
``initialize_parallel(tensor_parallel_size=4)``) and times, on the tp group:

* section ``a``: each of the nine mappings' forward, compiled (``ms.jit`` of a named
  function that calls the mapping) vs eager (PyNative);
* section ``b``: each mapping's forward+backward,
  ``ms.jit(ms.value_and_grad(loss))`` vs ``ms.value_and_grad(loss)`` with
  ``loss = sum(mapping(x) * c)`` (``c`` fixed). ``autograd="grad"`` uses ``ms.grad``
  instead; then the compiled graph may drop the forward collective where the gradient
  does not depend on it (measured at 0.25 MiB: reduce_from_all 0.5 ms, gather_from_hidden
  4.9 ms, against 130-160 ms eager), so the default returns the loss value as a training
  step does;
* section ``u``: the four sequence mappings that communicate, eager forward, uneven
  (``S = 4k+1``, ``split_sizes=even_split_sizes(S, G)``) vs even (``S = 4k``);
* section ``v``: the same as ``u`` compiled (``ms.jit``) on both sides.

Every compiled function is compiled once by an untimed first call (its time is
recorded as ``compile_ms``) before the warm-up and the timed rounds.

Size convention: as ``bench/mapping_bench_checks.py`` (nccl-tests' meaning of "size",
F = ``size_mib`` MiB float32 = ``(S, H)`` with ``H = 4096``, ``S = F / (4 H)``, i.e.
(1024, 4096) at 16 MiB; G = 4). Inputs per mapping: copy_to_all, reduce_from_all,
scatter_to_*, reduce_scatter_to_sequence and both all-to-alls take the ``(S, H)``
tensor (the all-to-alls send F per rank); gather_from_hidden takes ``(S, H/G)`` and
gather_from_sequence ``(S/G, H)`` (the gathered output is F). Uneven section: the
tensor that is F in this convention gets ``S + 1`` rows instead of ``S``:
gather_from_sequence output ``(S+1, H)``, reduce_scatter_to_sequence input
``(S+1, H)``, all_to_all_from_hidden_to_sequence input ``(S+1, H)``, and
all_to_all_from_sequence_to_hidden input ``(sizes[r], H)`` with global sequence
``G*S + 1`` (each rank sends about F).

Timing: exactly as ``bench/mapping_bench_checks.py``: ``warmup`` calls of each side,
then ``repeats`` rounds; a round times ``iters`` calls of one side after a barrier
(eager all-reduce of a tiny tensor + ``asnumpy``) and ends with
``mindspore.runtime.synchronize()``; the sides alternate A B / B A between rounds.
The parent takes the slowest rank per round and the median over rounds.

Checks of the numbers: compiled vs eager outputs (and gradients) must be equal
(``max_error`` 0: the inputs are small integers, sums exact in float32); each uneven
output is compared with a numpy reference built from every rank's input (every rank
can make every rank's input: it depends only on the rank).
"""

from __future__ import annotations

import time

import numpy as np

from mapping_bench_checks import H, tp_group_and_rows

from mindscience.distributed.harness.checks.mapping_reference import MAPPING_NAMES
from mindscience.distributed.harness.registry import CheckContext, check

# The nine public mappings (the reference's list also holds a gather variant).
MAPPINGS = tuple(name for name in MAPPING_NAMES if "(" not in name)
UNEVEN = (
    "gather_from_sequence",
    "reduce_scatter_to_sequence",
    "all_to_all_from_sequence_to_hidden",
    "all_to_all_from_hidden_to_sequence",
)


def _pattern(shape, offset: int, mod: int) -> np.ndarray:
    n = int(np.prod(shape))
    return ((np.arange(n, dtype=np.int64) + offset) % mod + 1).astype(np.float32).reshape(shape)


# Compiled code parses what it calls: the functions handed to ms.jit / ms.grad are
# closures made here (named functions, no lambdas, no default arguments, no imports).
def _forward_fn(mapping, group, sizes):
    if sizes is None:
        def forward(x):
            return mapping(x, group)
    else:
        def forward(x):
            return mapping(x, group, split_sizes=sizes)
    return forward


def _loss_fn(mapping, group, c):
    def loss(x):
        return (mapping(x, group) * c).sum()
    return loss


def _uneven_reference(name, G, r, S_full, sizes):
    """This rank's expected output of ``name`` with ``split_sizes=sizes`` (numpy)."""
    off = [0]
    for s in sizes:
        off.append(off[-1] + s)
    if name == "gather_from_sequence":
        return np.concatenate([_pattern((sizes[q], H), 7 * q, 7) for q in range(G)], 0)
    if name == "reduce_scatter_to_sequence":
        total = sum(_pattern((S_full, H), 7 * q, 7) for q in range(G))
        return total[off[r]:off[r + 1]]
    if name == "all_to_all_from_sequence_to_hidden":
        w = H // G
        return np.concatenate([_pattern((sizes[q], H), 7 * q, 7)[:, r * w:(r + 1) * w]
                               for q in range(G)], 0)
    if name == "all_to_all_from_hidden_to_sequence":
        return np.concatenate([_pattern((S_full, H), 7 * q, 7)[off[r]:off[r + 1]]
                               for q in range(G)], -1)
    raise ValueError(name)


@check("bench.modes")
def bench_modes(
    ctx: CheckContext,
    size_mib: float = 16,
    iters: int = 1,
    repeats: int = 4,
    warmup: int = 1,
    sections: str = "abu",
    mappings: str = "",
    autograd: str = "value_and_grad",
):
    import mindspore as ms

    from mindscience.distributed import collectives as C
    from mindscience.distributed import mappings as M

    g, S = tp_group_and_rows(ctx, size_mib)
    G, r = g.size, g.rank
    selected = [m for m in (mappings.split(",") if mappings else MAPPINGS) if m]

    def T(a):
        return ms.Tensor(a)

    full = T(_pattern((S, H), 7 * r, 7))             # (S, H)      F
    seq = T(_pattern((S // G, H), 7 * r, 7))         # (S/G, H)    F/G, sequence shard
    hid = T(_pattern((S, H // G), 7 * r, 7))         # (S, H/G)    F/G, hidden shard
    tiny = T(np.ones(G, np.float32))
    inputs = {
        "copy_to_all": full, "reduce_from_all": full, "scatter_to_hidden": full,
        "gather_from_hidden": hid, "scatter_to_sequence": full, "gather_from_sequence": seq,
        "reduce_scatter_to_sequence": full, "all_to_all_from_hidden_to_sequence": full,
        "all_to_all_from_sequence_to_hidden": full,
    }
    # The first ms.runtime.synchronize() on CPU only logs and returns (see
    # mapping_bench_checks.py); spend it here.
    ms.runtime.synchronize()

    def barrier():
        C.all_reduce(tiny, g).asnumpy()

    def timed_pair(fa, fb, compile_a=False, compile_b=False):
        """Per-round ms of both sides; the first call of a compiled side compiles it."""
        outs = {}
        compile_ms = {}
        for key, f, comp in (("a", fa, compile_a), ("b", fb, compile_b)):
            if comp:
                barrier()
                t0 = time.perf_counter()
                outs[key] = f()
                ms.runtime.synchronize()
                compile_ms[key] = (time.perf_counter() - t0) * 1e3
        for _ in range(int(warmup)):
            outs["a"] = fa()
            outs["b"] = fb()
        ms.runtime.synchronize()
        ta, tb = [], []
        for rep in range(int(repeats)):
            order = (("a", fa, ta), ("b", fb, tb))
            if rep % 2:
                order = order[::-1]
            for key, f, acc in order:
                barrier()
                t0 = time.perf_counter()
                for _ in range(int(iters)):
                    outs[key] = f()
                ms.runtime.synchronize()
                acc.append((time.perf_counter() - t0) / int(iters) * 1e3)
        return ta, tb, outs["a"], outs["b"], compile_ms

    def max_err(a, b):
        a, b = a.asnumpy(), np.asarray(b.asnumpy() if hasattr(b, "asnumpy") else b)
        if a.shape != b.shape:
            return float("inf")
        return float(np.abs(a - b).max()) if a.size else 0.0

    records = []

    def record(section, name, what, ta, tb, err, compile_ms, extra=None):
        rec = {
            "check": "bench.modes", "section": section, "mapping": name, "what": what,
            "t_map": ta, "t_bare": tb, "max_error": err,
            "passed": err is None or err == 0.0, "S": S, "H": H, "G": G,
            "compile_ms": compile_ms,
        }
        rec.update(extra or {})
        records.append(rec)

    # ------------------------------------------------- (a) forward, compiled vs eager
    if "a" in sections:
        for name in selected:
            fn = getattr(M, name)
            x = inputs[name]
            forward = _forward_fn(fn, g, None)
            compiled = ms.jit(forward)
            ta, tb, oa, ob, cms = timed_pair(lambda: compiled(x), lambda: forward(x), compile_a=True)
            record("a", name, f"forward, input {tuple(x.shape)}", ta, tb, max_err(oa, ob), cms,
                   {"out_shape": list(oa.shape)})

    # ------------------------------------------ (b) forward+backward, compiled vs eager
    if "b" in sections:
        for name in selected:
            fn = getattr(M, name)
            x = inputs[name]
            out_shape = tuple(fn(x, g).shape)
            c = T(_pattern(out_shape, 0, 5))
            diff = ms.value_and_grad if autograd == "value_and_grad" else ms.grad
            grad_eager = diff(_loss_fn(fn, g, c))
            grad_compiled = ms.jit(diff(_loss_fn(fn, g, c)))
            ta, tb, oa, ob, cms = timed_pair(lambda: grad_compiled(x), lambda: grad_eager(x),
                                             compile_a=True)
            if autograd == "value_and_grad":
                err = max(max_err(oa[0], ob[0]), max_err(oa[1], ob[1]))
            else:
                err = max_err(oa, ob)
            record("b", name, f"{autograd} of sum(out*c), input {tuple(x.shape)}", ta, tb,
                   err, cms)

    # ---------------------------------------------------- (u, v) uneven vs even splits
    for section, compiled_mode in (("u", False), ("v", True)):
        if section not in sections:
            continue
        for name in UNEVEN:
            if name not in selected:
                continue
            fn = getattr(M, name)
            S_seq = G * S if name == "all_to_all_from_sequence_to_hidden" else S
            sides = {}
            for kind, S_full in (("uneven", S_seq + 1), ("even", S_seq)):
                sizes = tuple(M.even_split_sizes(S_full, G))
                if name in ("gather_from_sequence", "all_to_all_from_sequence_to_hidden"):
                    x = T(_pattern((sizes[r], H), 7 * r, 7))      # this rank's shard
                else:
                    x = T(_pattern((S_full, H), 7 * r, 7))        # the full sequence
                f = _forward_fn(fn, g, list(sizes))
                if compiled_mode:
                    f = ms.jit(f)
                sides[kind] = (f, x, sizes, S_full)
            fu, xu, su, Su = sides["uneven"]
            fe, xe, _, Se = sides["even"]
            ta, tb, oa, ob, cms = timed_pair(lambda: fu(xu), lambda: fe(xe),
                                             compile_a=compiled_mode, compile_b=compiled_mode)
            want = _uneven_reference(name, G, r, Su, su)
            # ``what`` is the row key of the parent: the same on every rank.
            record(section, name, f"S={Su} split_sizes={list(su)} vs S={Se} even", ta, tb,
                   max_err(oa, want), cms,
                   {"mode": "compiled" if compiled_mode else "eager", "S_uneven": Su,
                    "S_even": Se, "split_sizes": list(su),
                    "input_shapes": [list(xu.shape), list(xe.shape)]})
    return records
