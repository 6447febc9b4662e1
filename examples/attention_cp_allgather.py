"""Context-parallel attention by all-gathering k and v, checked against dense attention.

    msrun --worker_num=4 --local_worker_num=4 --master_port=8118 --log_dir=logs/attn_agkv \
          --join=True examples/attention_cp_allgather.py

The sequence is split over the cp ranks. Each rank keeps the queries of its chunk and
all-gathers the keys and values of the whole sequence:

    x_r (S/cp, B, D): my chunk of the sequence (rows r*S/cp .. (r+1)*S/cp - 1)
      -> qkv projection (replicated weights)             q_r, k_r, v_r  (S/cp, B, h, hd)
      -> k = gather_from_sequence(k_r), v = ...(v_r)     (S, B, h, hd)
      -> softmax attention of my queries over all keys   (S/cp, B, D)
         (causal mask uses global positions: query i is at r*S/cp + i)
      -> output projection (replicated weights)          (S/cp, B, D)

Uneven sequences: when cp does not divide S (``run(seq_len=1003)`` or ``--seq-len 1003``
on 4 ranks) rank r holds ``split_sizes[r]`` rows, ``split_sizes =
mappings.even_split_sizes(S, cp)`` (``[251, 251, 251, 250]``); the gathers take
``split_sizes=`` and the causal mask uses the uneven offsets,
``mappings.split_offsets(split_sizes)[r]`` (``[0, 251, 502, 753]``):

    msrun --worker_num=4 --local_worker_num=4 --master_port=8118 --log_dir=logs/attn_agkv_uneven \
          --join=True examples/attention_cp_allgather.py --seq-len 1003

Backward, ``gather_from_sequence`` reduce-scatters the k/v gradients: every rank's
queries touch every key, so the key gradients are partial sums over the ranks. Simple
and exact, but every rank holds the full k and v (memory O(S)); ring attention avoids
that. Weight gradients are summed over cp before comparison (see attention_ulysses.py).
Exits 1 on a mismatch.
"""

from __future__ import annotations

import sys

from mindspore import mint, nn

import _common as C
from mindscience.distributed.modules import context_parallel_attention


class AllGatherKVAttention(nn.Cell):
    def __init__(self, d_model: int, num_heads: int, causal: bool = True):
        super().__init__()
        self.cp = C.cp_group()
        self.head_dim = d_model // num_heads
        self.causal = causal
        self.qkv = mint.nn.Linear(d_model, 3 * d_model)
        self.proj = mint.nn.Linear(d_model, d_model)

    def construct(self, x, split_sizes=None):
        # split_sizes: rows of each cp rank for an uneven sequence (None: S/cp each)
        q, k, v = C.split_qkv(self.qkv(x), self.head_dim)   # each (S/cp, B, h, hd)
        # the library gathers k and v (split_sizes for an uneven sequence) and masks with
        # the global positions of this rank's queries
        out = context_parallel_attention(q, k, v, self.cp, method="allgather_kv",
                                         causal=self.causal, split_sizes=split_sizes)
        return self.proj(out.reshape(x.shape[0], x.shape[1], -1))


def run(seq_len: int = 8, batch: int = 2, d_model: int = 16, num_heads: int = 4,
        causal: bool = True, seed: int = 0, atol: float = C.ATOL) -> dict:
    """Compare with the dense model on this rank; the parallel groups must exist.

    A ``seq_len`` that cp does not divide (e.g. 1003 over cp = 4) runs the uneven path
    (``split_sizes = mappings.even_split_sizes(seq_len, cp)``)."""
    return C.compare_cp_attention("examples.attention_cp_allgather", AllGatherKVAttention, seq_len, batch, d_model, num_heads, causal, seed, atol)


def main(argv=None) -> int:
    return C.cp_main(run, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
