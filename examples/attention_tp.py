"""Tensor-parallel attention (Megatron style), checked against dense softmax attention.

    msrun --worker_num=4 --local_worker_num=4 --master_port=8118 --log_dir=logs/attn_tp \
          --join=True examples/attention_tp.py

Each of the tp ranks owns ``num_heads / tp`` heads:

    x (S, B, D), the same on every rank
      -> ColumnParallelLinear(D, 3D, gather_output=False)   (S, B, 3D/tp): q, k, v of my heads
      -> softmax attention over my heads                    (S, B, D/tp)
      -> RowParallelLinear(D, D, input_is_parallel=True)    (S, B, D), all-reduced

One all-reduce forward (after the output projection) and one backward (of the input
gradient, in the column layer). The fused qkv features are laid out per head
(``[head, q|k|v, head_dim]``), so the column split hands every rank whole heads.

Checked: the output, the input gradient and every weight/bias gradient equal the dense
model's (``DenseAttention`` built after the same seed), sliced where sharded.
Exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import mindspore as ms
from mindspore import nn

import _common as C
from mindscience.distributed.modules import ColumnParallelLinear, RowParallelLinear


class TensorParallelAttention(nn.Cell):
    def __init__(self, d_model: int, num_heads: int, causal: bool = True):
        super().__init__()
        tp = C.tp_group().size
        if num_heads % tp:
            raise ValueError(f"num_heads={num_heads} is not divisible by tp={tp}")
        self.head_dim = d_model // num_heads
        self.causal = causal
        # Same construction order as DenseAttention: same seed -> same full weights.
        self.qkv = ColumnParallelLinear(d_model, 3 * d_model, gather_output=False,
                                        compute_dtype=ms.float32)
        self.proj = RowParallelLinear(d_model, d_model, input_is_parallel=True,
                                      compute_dtype=ms.float32)

    def construct(self, x):
        q, k, v = C.split_qkv(self.qkv(x), self.head_dim)  # my heads only
        return self.proj(C.softmax_attention(q, k, v, self.causal))


def run(seq_len: int = 8, batch: int = 2, d_model: int = 16, num_heads: int = 4,
        causal: bool = True, seed: int = 0, atol: float = C.ATOL) -> dict:
    """Compare with the dense model on this rank; the parallel groups must exist."""
    tp = C.tp_group()
    rng = np.random.default_rng(seed)
    x = ms.Tensor(rng.standard_normal((seq_len, batch, d_model)), ms.float32)
    cot = ms.Tensor(rng.standard_normal((seq_len, batch, d_model)), ms.float32)

    ms.set_seed(seed)
    dense = C.DenseAttention(d_model, num_heads, causal)
    ms.set_seed(seed)
    par = TensorParallelAttention(d_model, num_heads, causal)

    d_out, d_dx, d_g = C.forward_backward(dense, x, cot)
    p_out, p_dx, p_g = C.forward_backward(par, x, cot)
    errors = {
        "output": C.max_abs(p_out, d_out),
        "grad x": C.max_abs(p_dx, d_dx),
        # column layer: rows of the weight and the bias are sharded
        "grad qkv.weight": C.max_abs(p_g["qkv.weight"], C.rows(d_g["qkv.weight"], tp)),
        "grad qkv.bias": C.max_abs(p_g["qkv.bias"], C.rows(d_g["qkv.bias"], tp)),
        # row layer: columns of the weight are sharded, the bias is whole
        "grad proj.weight": C.max_abs(p_g["proj.weight"], C.cols(d_g["proj.weight"], tp)),
        "grad proj.bias": C.max_abs(p_g["proj.bias"], d_g["proj.bias"]),
    }
    return C.result("examples.attention_tp", errors, atol, tp=tp.size)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: all ranks)")
    args = parser.parse_args(argv)
    from mindspore.communication import get_group_size

    C.setup(tensor_parallel_size=args.tp or get_group_size())
    return C.report(run())


if __name__ == "__main__":
    sys.exit(main())
