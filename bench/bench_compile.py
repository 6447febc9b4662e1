"""Compile time of compiled (``ms.jit``) code: the GPT step, and the tuple-building constructs.

    python bench/bench_compile.py step [--layers 2] [--microbatches 2] [--models 2] [--cfg NAME=1]
    python bench/bench_compile.py constructs [--n 28]

One process (no launch), one CPU kernel thread, synchronous PyNative (as the harness ranks).

* ``step``: builds ``--models`` dense ``GPTModel`` (tiny-gpt shape: hidden 32, 4 heads, ffn 64,
  seq 16, vocab 64) one after the other and times the first call of
  ``forward_backward(mode="jit")`` of each (the compile) and a second call; prints wall and CPU
  seconds (``time.process_time()``: all the process's threads, less sensitive to other jobs on
  the machine than wall time). ``--cfg NAME=VALUE`` sets ``mindspore.graph._parse.
  compile_config.NAME`` first (``COMPILE_PROFILE=1`` prints MindSpore's compile phases).
* ``constructs``: ``ms.jit`` of ``n`` additions of small tensors written five ways (a generator,
  a loop concatenating a tuple, a loop appending to a list, list item assignment, one
  ``HyperMap``); prints each one's compile seconds. Each runs in a fresh process (a compiled
  function is cached in its process).

docs/COMPILED_MODE.md ("Compile time") has the figures and what they led to.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

CONSTRUCTS = ("generator", "loop_tuple", "append", "setitem", "hypermap")


def _step(args) -> int:
    import mindspore as ms
    from mindspore.graph._parse import compile_config

    for item in args.cfg:
        name, value = item.split("=", 1)
        setattr(compile_config, name, value)
    ms.set_context(mode=ms.PYNATIVE_MODE, pynative_synchronize=True)
    ms.device_context.cpu.op_tuning.threads_num(1)
    from mindscience.distributed.models import GPTModel, TransformerConfig

    cfg = TransformerConfig.from_model_spec(
        "tiny-gpt", hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=16,
        vocab_size=64, num_layers=args.layers)
    rng = np.random.default_rng(0)
    rows = 2 * args.microbatches
    ids = rng.integers(0, cfg.vocab_size, (rows, cfg.seq_length)).astype(np.int32)
    labels = rng.integers(0, cfg.vocab_size, (rows, cfg.seq_length)).astype(np.int32)
    for k in range(args.models):
        model = GPTModel(cfg, seed=3)
        record = {"model": k, "layers": args.layers, "microbatches": args.microbatches,
                  "cfg": args.cfg}
        for call in ("compile", "again"):
            t0, c0 = time.perf_counter(), time.process_time()
            loss, _ = model.forward_backward(ids, labels, num_microbatches=args.microbatches,
                                             mode="jit")
            value = float(loss.asnumpy())
            record[f"{call}_wall_s"] = round(time.perf_counter() - t0, 3)
            record[f"{call}_cpu_s"] = round(time.process_time() - c0, 3)
        record["loss"] = value
        print(json.dumps(record), flush=True)
    return 0


def _construct(how: str, n: int) -> None:
    """Compile and run ``n`` additions written as ``how``; print the seconds as JSON."""
    import mindspore as ms
    from mindspore import ops

    ms.set_context(mode=ms.PYNATIVE_MODE, pynative_synchronize=True)
    add = ops.MultitypeFuncGraph("bench_add")

    @add.register("Tensor", "Tensor")
    def _add(a, b):
        return a + b

    each = ops.HyperMap(add)

    def fn(*args):
        acc, g = args[:n], args[n:]
        if how == "generator":
            return tuple(a + b for a, b in zip(acc, g))
        if how == "loop_tuple":
            out = ()
            for i in range(n):
                out = out + (acc[i] + g[i],)
            return out
        if how == "append":
            out = []
            for i in range(n):
                out.append(acc[i] + g[i])
            return tuple(out)
        if how == "setitem":
            out = [None] * n
            for i in range(n):
                out[i] = acc[i] + g[i]
            return tuple(out)
        return each(acc, g)

    xs = [ms.Tensor(np.full((4, 3), i, np.float32)) for i in range(2 * n)]
    compiled = ms.jit(fn)
    t0, c0 = time.perf_counter(), time.process_time()
    out = compiled(*xs)
    total = float(sum(float(o.asnumpy().sum()) for o in out))
    print(json.dumps({"construct": how, "n": n, "wall_s": round(time.perf_counter() - t0, 3),
                      "cpu_s": round(time.process_time() - c0, 3), "sum": total}), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    step = sub.add_parser("step", help="compile of GPTModel.forward_backward(mode='jit')")
    step.add_argument("--layers", type=int, default=2)
    step.add_argument("--microbatches", type=int, default=2)
    step.add_argument("--models", type=int, default=2)
    step.add_argument("--cfg", action="append", default=[],
                      help="NAME=VALUE of mindspore.graph._parse.compile_config")
    cons = sub.add_parser("constructs", help="compile of n additions written five ways")
    cons.add_argument("--n", type=int, default=28)
    cons.add_argument("--only", choices=CONSTRUCTS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.what == "step":
        return _step(args)
    if args.only:
        _construct(args.only, args.n)
        return 0
    for how in CONSTRUCTS:
        subprocess.run([sys.executable, __file__, "constructs", "--n", str(args.n), "--only", how],
                       check=True, stderr=subprocess.DEVNULL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
