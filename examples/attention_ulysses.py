"""Ulysses context-parallel attention (DeepSpeed-Ulysses), checked against dense attention.

    msrun --worker_num=4 --local_worker_num=4 --master_port=8118 --log_dir=logs/attn_uly \
          --join=True examples/attention_ulysses.py

The sequence is split over the cp ranks; two all-to-alls swap "my rows, all heads" for
"all rows, my heads" around the attention, so each rank attends over the WHOLE
sequence for ``num_heads / cp`` heads:

    x_r (S/cp, B, D): my chunk of the sequence
      -> qkv projection (replicated weights)                    (S/cp, B, 3D)
      -> all_to_all_from_sequence_to_hidden                     (S, B, 3D/cp): my heads
      -> softmax attention over my heads, full sequence         (S, B, D/cp)
      -> all_to_all_from_hidden_to_sequence                     (S/cp, B, D)
      -> output projection (replicated weights)                 (S/cp, B, D)

Uneven sequences: when cp does not divide S (``run(seq_len=1003)`` or ``--seq-len 1003``
on 4 ranks) rank r holds ``split_sizes[r]`` rows, ``split_sizes =
mappings.even_split_sizes(S, cp)`` (``[251, 251, 251, 250]``), and both all-to-alls take
``split_sizes=``; the attention itself sees the whole sequence, so the causal mask needs
no offset:

    msrun --worker_num=4 --local_worker_num=4 --master_port=8118 --log_dir=logs/attn_uly_uneven \
          --join=True examples/attention_ulysses.py --seq-len 1003

The library does the all-to-alls: ``modules.context_parallel_attention(q, k, v, cp,
method="ulysses")`` (this script only adds the projections around it). Shape convention
(see ``mindscience.distributed.mappings``): "hidden" is the last dim
and "sequence" the first; ``all_to_all_from_sequence_to_hidden`` takes a hidden-complete
sequence chunk ``(S/G, ..., H)`` to a sequence-complete hidden chunk ``(S, ..., H/G)``,
and ``all_to_all_from_hidden_to_sequence`` is its inverse. The fused qkv features are
laid out per head, so one all-to-all moves q, k and v of whole heads at once.

The weights are replicated over cp, so each rank's weight gradient is its chunk's share:
they are summed over the cp group (as the dp-cp gradient all-reduce does in training)
before being compared with the dense gradients. Exits 1 on a mismatch.
"""

from __future__ import annotations

import sys

from mindspore import mint, nn

import _common as C
from mindscience.distributed.modules import context_parallel_attention


class UlyssesAttention(nn.Cell):
    def __init__(self, d_model: int, num_heads: int, causal: bool = True):
        super().__init__()
        self.cp = C.cp_group()
        if num_heads % self.cp.size:
            raise ValueError(f"num_heads={num_heads} is not divisible by cp={self.cp.size}")
        self.head_dim = d_model // num_heads
        self.causal = causal
        self.qkv = mint.nn.Linear(d_model, 3 * d_model)
        self.proj = mint.nn.Linear(d_model, d_model)

    def construct(self, x, split_sizes=None):
        # split_sizes: rows of each cp rank for an uneven sequence (None: S/cp each)
        q, k, v = C.split_qkv(self.qkv(x), self.head_dim)            # (S/cp, B, h, hd) each
        out = context_parallel_attention(q, k, v, self.cp, method="ulysses", causal=self.causal,
                                         split_sizes=split_sizes)   # (S/cp, B, h, hd)
        return self.proj(out.reshape(x.shape[0], x.shape[1], -1))


def run(seq_len: int = 8, batch: int = 2, d_model: int = 16, num_heads: int = 4,
        causal: bool = True, seed: int = 0, atol: float = C.ATOL) -> dict:
    """Compare with the dense model on this rank; the parallel groups must exist.

    A ``seq_len`` that cp does not divide (e.g. 1003 over cp = 4) runs the uneven path
    (``split_sizes = mappings.even_split_sizes(seq_len, cp)``)."""
    return C.compare_cp_attention("examples.attention_ulysses", UlyssesAttention, seq_len, batch, d_model, num_heads, causal, seed, atol)


def main(argv=None) -> int:
    return C.cp_main(run, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
