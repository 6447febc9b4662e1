"""Rank-side part of ``bench/bench_mappings.py`` (a benchmark, not a test).

Registers the harness check ``bench.mappings``. Every rank builds tp = world (4 ranks:
``initialize_parallel(tensor_parallel_size=4)``) and times, on the tp group:

* section ``a``: each mapping's forward vs the bare ``collectives`` call it wraps;
* section ``b``: each mapping's forward+backward through ``ms.grad`` (loss =
  ``sum(out * c)``, ``c`` fixed) vs the same collectives called by hand (forward
  collective, the same loss, ``dy = ones * c`` = d loss / d out as autograd computes
  it, backward collective applied to ``dy``), plus the loss alone as a baseline;
* section ``c``: the CPU compositions vs all-reduce / all-gather of the same tensor,
  all-gather along the last dim vs dim 0, the library's collectives vs raw
  ``mindspore.mint.distributed`` calls.

Size convention (nccl-tests' meaning of "size", F = ``size_mib`` MiB float32 =
``(S, H)`` with ``H = 4096``, ``S = F / (4 H)``, i.e. (1024, 4096) at 16 MiB; G = 4):

* all-reduce: the reduced tensor is F (input = output = (S, H));
* reduce-scatter: the input is F ((S, H) -> (S/G, H));
* all-gather: the gathered OUTPUT is F (each rank gives (S/G, H) or (S, H/G));
* all-to-all: each rank's send buffer is F ((S, H) in, same bytes out).

Timing: ``warmup`` calls of each side, then ``repeats`` rounds; a round times
``iters`` back-to-back calls of one side after a barrier (all-reduce of a tiny tensor
+ ``asnumpy``) and ends with ``mindspore.runtime.synchronize()``; the two sides
alternate A B / B A between rounds so that drift cancels. Each record holds the
per-round mean ms per call of both sides; the parent takes the slowest rank per round
and the median over rounds.

Why ``iters=1`` by default: PyNative on CPU runs ops asynchronously, and
``mindspore._Function.apply`` (every mapping) waits for the queued work before it
returns (measured: a mapping call after ~40 ms of queued kernels took ~25 ms, a plain
``own_slice`` 0.7 ms). In a loop of back-to-back calls the bare collectives would then
overlap Python dispatch with execution and the mappings would not; with one call per
timed loop, each call is isolated by the barrier before and the sync after, on both
sides. ``--iters N`` shows the back-to-back figure.
"""

from __future__ import annotations

import time

import numpy as np

from mindscience.distributed.harness.registry import CheckContext, check

H = 4096
MIB = 1 << 20


def _pattern(shape, offset: int, mod: int) -> np.ndarray:
    n = int(np.prod(shape))
    return ((np.arange(n, dtype=np.int64) + offset) % mod + 1).astype(np.float32).reshape(shape)


def tp_group_and_rows(ctx: CheckContext, size_mib: float):
    """The tp group (the whole world unless a layout says otherwise) and the number of
    rows S, a multiple of G, of a float32 (S, H) tensor of about ``size_mib`` MiB."""
    from mindscience.distributed import manager

    if not manager.is_initialized():
        manager.initialize_parallel(tensor_parallel_size=ctx.world_size)
    g = manager.get_tensor_parallel_group()
    S = int(size_mib * MIB) // (4 * H)
    S -= S % g.size
    if S < g.size:
        raise ValueError(f"size_mib={size_mib} is too small for a ({g.size}*k, {H}) tensor")
    return g, S


@check("bench.mappings")
def bench_mappings(
    ctx: CheckContext,
    size_mib: float = 16,
    iters: int = 1,
    repeats: int = 4,
    warmup: int = 1,
    sections: str = "abc",
):
    import mindspore as ms
    from mindspore import mint, ops
    from mindspore.mint import distributed as md

    from mindscience.distributed import collectives as C
    from mindscience.distributed import mappings as M

    g, S = tp_group_and_rows(ctx, size_mib)
    G, r = g.size, g.rank

    def T(a):
        return ms.Tensor(a)

    full = T(_pattern((S, H), 7 * r, 7))             # (S, H)      F, partial sums etc.
    seq = T(_pattern((S // G, H), 7 * r, 7))         # (S/G, H)    F/G, sequence shard
    hid = T(_pattern((S, H // G), 7 * r, 7))         # (S, H/G)    F/G, hidden shard
    tiny = T(np.ones(G, np.float32))
    full_np = full.asnumpy().copy()
    # PyNative on CPU runs ops asynchronously. The FIRST ms.runtime.synchronize() on CPU
    # only logs "CPU device is not supported" and returns; later calls do wait (measured
    # with MindSpore 2.10). Spend that first call here so every timed loop really syncs.
    ms.runtime.synchronize()

    def barrier():
        C.all_reduce(tiny, g).asnumpy()

    def c_like(shape):
        return T(_pattern(tuple(shape), 0, 5))

    def timed_pair(fa, fb):
        outs = {}
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
        return ta, tb, outs["a"], outs["b"]

    def max_err(a, b):
        if a is None or b is None:
            return None
        a, b = a.asnumpy(), b.asnumpy()
        if a.shape != b.shape:
            return float("inf")
        return float(np.abs(a - b).max()) if a.size else 0.0

    records = []

    def record(section, name, what, fa, fb, extra=None, compare=True):
        ta, tb, oa, ob = timed_pair(fa, fb)
        err = max_err(oa, ob) if compare else None
        rec = {
            "check": "bench.mappings", "section": section, "mapping": name, "what": what,
            "t_map": ta, "t_bare": tb, "max_error": err,
            "passed": err is None or err == 0.0, "S": S, "H": H, "G": G,
        }
        rec.update(extra or {})
        records.append(rec)

    # ------------------------------------------------------------------ (a) forward
    if "a" in sections:
        rows = [
            ("copy_to_all", "identity (no comm)", lambda: M.copy_to_all(full, g), lambda: full),
            ("reduce_from_all", "all_reduce (S,H)", lambda: M.reduce_from_all(full, g),
             lambda: C.all_reduce(full, g)),
            ("scatter_to_hidden", "own_slice last dim (no comm)",
             lambda: M.scatter_to_hidden(full, g), lambda: C.own_slice(full, g, -1)),
            ("gather_from_hidden", "all_gather dim -1 (S,H/G)->(S,H)",
             lambda: M.gather_from_hidden(hid, g), lambda: C.all_gather(hid, g, -1)),
            ("scatter_to_sequence", "own_slice dim 0 (no comm)",
             lambda: M.scatter_to_sequence(full, g), lambda: C.own_slice(full, g, 0)),
            ("gather_from_sequence", "all_gather dim 0 (S/G,H)->(S,H)",
             lambda: M.gather_from_sequence(seq, g), lambda: C.all_gather(seq, g, 0)),
            ("reduce_scatter_to_sequence", "reduce_scatter (S,H)->(S/G,H)",
             lambda: M.reduce_scatter_to_sequence(full, g), lambda: C.reduce_scatter(full, g)),
            ("all_to_all_from_hidden_to_sequence", "all_to_all split 0 concat -1, (S,H) sent",
             lambda: M.all_to_all_from_hidden_to_sequence(full, g),
             lambda: C.all_to_all(full, g, 0, -1)),
            ("all_to_all_from_sequence_to_hidden", "all_to_all split -1 concat 0, (S,H) sent",
             lambda: M.all_to_all_from_sequence_to_hidden(full, g),
             lambda: C.all_to_all(full, g, -1, 0)),
        ]
        for name, what, fm, fb in rows:
            record("a", name, what, fm, fb, {"comm": "no comm" not in what})

    # ------------------------------------------------------------ (b) forward+backward
    if "b" in sections:
        def grad_of(mapping, c):
            def loss(x):
                return (mapping(x) * c).sum()

            return ms.grad(loss)

        # (mapping, input, forward collective, backward collective applied to c, what)
        specs = [
            ("copy_to_all", M.copy_to_all, full, lambda x: x,
             lambda d: C.all_reduce(d, g), "fwd identity; bwd all_reduce (S,H)"),
            ("reduce_from_all", M.reduce_from_all, full, lambda x: C.all_reduce(x, g),
             lambda d: d, "fwd all_reduce (S,H); bwd identity"),
            ("scatter_to_hidden", M.scatter_to_hidden, full, lambda x: C.own_slice(x, g, -1),
             lambda d: C.all_gather(d, g, -1), "fwd slice; bwd all_gather dim -1 ->(S,H)"),
            ("gather_from_hidden", M.gather_from_hidden, hid, lambda x: C.all_gather(x, g, -1),
             lambda d: C.own_slice(d, g, -1), "fwd all_gather dim -1 ->(S,H); bwd slice"),
            ("scatter_to_sequence", M.scatter_to_sequence, full, lambda x: C.own_slice(x, g, 0),
             lambda d: C.all_gather(d, g, 0), "fwd slice; bwd all_gather dim 0 ->(S,H)"),
            ("gather_from_sequence", M.gather_from_sequence, seq, lambda x: C.all_gather(x, g, 0),
             lambda d: C.reduce_scatter(d, g), "fwd all_gather dim 0 ->(S,H); bwd reduce_scatter (S,H)"),
            ("reduce_scatter_to_sequence", M.reduce_scatter_to_sequence, full,
             lambda x: C.reduce_scatter(x, g), lambda d: C.all_gather(d, g, 0),
             "fwd reduce_scatter (S,H); bwd all_gather dim 0 ->(S,H)"),
            ("all_to_all_from_hidden_to_sequence", M.all_to_all_from_hidden_to_sequence, full,
             lambda x: C.all_to_all(x, g, 0, -1), lambda d: C.all_to_all(d, g, -1, 0),
             "fwd a2a (S,H)->(S/G,GH); bwd a2a back"),
            ("all_to_all_from_sequence_to_hidden", M.all_to_all_from_sequence_to_hidden, full,
             lambda x: C.all_to_all(x, g, -1, 0), lambda d: C.all_to_all(d, g, 0, -1),
             "fwd a2a (S,H)->(GS,H/G); bwd a2a back"),
        ]
        # Baseline: the loss alone (no mapping), to show what autograd costs by itself.
        specs.insert(0, ("(loss only, no mapping)", lambda x, g: x, full, lambda x: x, lambda d: d,
                         "no comm: sum(x*c) and its gradient"))
        for name, mapping, x, fwd, bwd, what in specs:
            c = c_like(fwd(x).shape)
            gfn = grad_of(lambda x, m=mapping: m(x, g), c)

            def by_hand(x=x, fwd=fwd, bwd=bwd, c=c):
                out = fwd(x)
                (out * c).sum()
                # d loss / d out, computed as autograd does: grad of sum (ones) times c.
                dy = ops.ones(out.shape, out.dtype) * c
                return bwd(dy)

            record("b", name, what, lambda x=x, gfn=gfn: gfn(x), by_hand)

    # ------------------------------------------------------------------ (c) compositions
    if "c" in sections:
        def raw_all_reduce_inplace(buf=mint.empty(full.shape, dtype=full.dtype).copy_(full)):
            md.all_reduce(buf, "sum", g.group_name)  # in place, no copy (values grow; timing only)
            return buf

        outs_seq = [mint.empty(seq.shape, dtype=seq.dtype) for _ in range(G)]

        def raw_all_gather_list():
            md.all_gather(outs_seq, seq, g.group_name)  # preallocated list, no cat
            return None

        rows = [
            ("reduce_scatter (composed)", "C.reduce_scatter (S,H) vs C.all_reduce (S,H)",
             lambda: C.reduce_scatter(full, g), lambda: C.all_reduce(full, g)),
            ("all_to_all split 0 concat -1 (composed)",
             "C.all_to_all(x,0,-1) vs C.all_gather(x,-1), x=(S,H)",
             lambda: C.all_to_all(full, g, 0, -1), lambda: C.all_gather(full, g, -1)),
            ("all_to_all split -1 concat 0 (composed)",
             "C.all_to_all(x,-1,0) vs C.all_gather(x,0), x=(S,H)",
             lambda: C.all_to_all(full, g, -1, 0), lambda: C.all_gather(full, g, 0)),
            ("all_gather dim -1 vs dim 0", "C.all_gather(x,-1) vs C.all_gather(x,0), x=(S/G,H) ->F",
             lambda: C.all_gather(seq, g, -1), lambda: C.all_gather(seq, g, 0)),
            ("C.all_reduce vs raw", "C.all_reduce (copy + in-place) vs md.all_reduce in place, (S,H)",
             lambda: C.all_reduce(full, g), raw_all_reduce_inplace),
            ("C.all_gather vs raw", "C.all_gather(x,0) (empty buffers+gather+cat) vs md.all_gather into a kept list, x=(S/G,H)",
             lambda: C.all_gather(seq, g, 0), raw_all_gather_list),
        ]
        for name, what, fa, fb in rows:
            # Different outputs by design (in-place sums, kept lists): timing only.
            record("c", name, what, fa, fb, compare=False)

    # The input must survive every in-place backend call (md.all_reduce on copies).
    records.append({"check": "bench.mappings", "section": "sanity", "mapping": "input unchanged",
                    "max_error": float(np.abs(full.asnumpy() - full_np).max()),
                    "passed": bool(np.array_equal(full.asnumpy(), full_np))})
    return records
