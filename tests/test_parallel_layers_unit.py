"""In-process tests of the issue-17 layers: VocabParallelEmbedding, vocab_parallel_cross_entropy,
context_parallel_attention / ContextParallelAttention / zigzag, and the RNG tracker.

A plain process (no ``communication.init()``): tp = cp = 1, or hand-made groups of size > 1
for what needs no communication (construction, shards, argument errors). The 4-rank checks
run in the shared layers job (``_layers_job.py``, ``test_layers.py``).
"""

from __future__ import annotations

import numpy as np
import pytest

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import initializer

from mindscience.distributed import collectives, manager
from mindscience.distributed import random as msrandom
from mindscience.distributed.group import ParallelGroup
from mindscience.distributed.harness.checks.attention import dense_attention
from mindscience.distributed.modules import (
    ContextParallelAttention, VocabParallelEmbedding, context_parallel_attention,
    vocab_parallel_cross_entropy, zigzag_shard, zigzag_unshard,
)
from mindscience.distributed.sharding import get_sharding

TRIVIAL_CP = ParallelGroup.trivial("cp")


def fake(size, rank, key="tp"):
    return ParallelGroup(key=key, ranks=tuple(range(size)), rank=rank, backend_name="unused")


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.fixture(autouse=True)
def _plain_process():
    assert not manager.is_initialized()
    ms.set_context(mode=ms.PYNATIVE_MODE)


# --------------------------------------------------------------------------- embedding
def test_embedding_tp1_equals_nn_embedding_forward_and_backward():
    ms.set_seed(4)
    dense = nn.Embedding(12, 6)
    ms.set_seed(4)
    layer = VocabParallelEmbedding(12, 6)
    np.testing.assert_array_equal(layer.weight.asnumpy(), dense.embedding_table.asnumpy())
    ids = Tensor(np.array([[0, 11], [5, 5], [3, 7]], np.int32))
    cot = Tensor(rand(3, 2, 6))
    np.testing.assert_array_equal(layer(ids).asnumpy(), dense(ids).asnumpy())
    (grad,) = ms.grad(lambda i: (layer(i) * cot).sum(), grad_position=None, weights=[layer.weight])(ids)
    want = np.zeros((12, 6), np.float32)
    np.add.at(want, ids.asnumpy().reshape(-1), cot.asnumpy().reshape(-1, 6))
    np.testing.assert_allclose(grad.asnumpy(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tp", [2, 4])
def test_embedding_shards_reassemble_to_the_full_table(tp):
    ms.set_seed(8)
    full = Parameter(initializer("normal", (8 * tp, 4), ms.float32)).asnumpy()
    shards = []
    for rank in range(tp):
        ms.set_seed(8)
        layer = VocabParallelEmbedding(8 * tp, 4, group=fake(tp, rank))
        assert (layer.vocab_start, layer.vocab_end) == (8 * rank, 8 * rank + 8)
        assert get_sharding(layer.weight)["axis"] == "tp" and get_sharding(layer.weight)["partition_dim"] == 0
        shards.append(layer.weight.asnumpy())
    np.testing.assert_array_equal(np.concatenate(shards), full)


def test_embedding_table_is_marked_split_at_tp1_too():
    # A tp = 1 checkpoint records the split dim, so it can be resharded to a larger tp.
    layer = VocabParallelEmbedding(8, 4)
    assert get_sharding(layer.weight) == {"axis": "tp", "partition_dim": 0, "partition_stride": 1,
                                          "sequence_parallel": False}


def test_embedding_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"num_embeddings=10 is not divisible .* 4.*num_embeddings=12"):
        VocabParallelEmbedding(10, 4, group=fake(4, 0))
    layer = VocabParallelEmbedding(8, 4)
    before = collectives.call_count()
    for bad in ([[0, 8]], [[-1, 2]]):
        with pytest.raises(ValueError, match=r"must lie in \[0, 8\)"):
            layer(Tensor(np.array(bad, np.int32)))
    with pytest.raises(ValueError, match="integer tensor"):
        layer(Tensor(np.zeros((2,), np.float32)))
    assert collectives.call_count() == before


# --------------------------------------------------------------------------- cross-entropy
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("mode", ["pynative", "jit"])
def test_cross_entropy_tp1_equals_ops_cross_entropy(smoothing, mode):
    logits = Tensor(rand(4, 3, 9) * 5 + np.float32(40) * (np.arange(9) == 2))
    target = Tensor(np.random.default_rng(1).integers(0, 9, (4, 3)).astype(np.int32))
    cot = Tensor(rand(4, 3, seed=2))

    def ours(x):
        return (vocab_parallel_cross_entropy(x, target, smoothing) * cot).sum()

    def dense(x):
        loss = ops.cross_entropy(x.reshape(-1, 9), target.reshape(-1), reduction="none",
                                 label_smoothing=smoothing)
        return (loss * cot.reshape(-1)).sum()

    grad = ms.value_and_grad(ours)
    grad = ms.jit(grad) if mode == "jit" else grad
    (v1, g1), (v2, g2) = grad(logits), ms.value_and_grad(dense)(logits)
    np.testing.assert_allclose(v1.asnumpy(), v2.asnumpy(), rtol=1e-6)
    np.testing.assert_allclose(g1.asnumpy(), g2.asnumpy(), atol=1e-6)


def test_cross_entropy_bf16_logits_compute_in_float32():
    logits = Tensor(rand(5, 7) * 3).astype(ms.bfloat16)
    target = Tensor(np.arange(5, dtype=np.int32))
    loss = vocab_parallel_cross_entropy(logits, target)
    assert loss.dtype == ms.float32 and loss.shape == (5,)
    want = ops.cross_entropy(logits.float(), target, reduction="none")
    np.testing.assert_allclose(loss.asnumpy(), want.asnumpy(), rtol=1e-6)
    grad = ms.grad(lambda x: vocab_parallel_cross_entropy(x, target).sum())(logits)
    assert grad.dtype == ms.bfloat16


@pytest.mark.parametrize("call,words", [
    (lambda: vocab_parallel_cross_entropy(Tensor(rand(2, 3)), Tensor(np.zeros(3, np.int32))), "same leading"),
    (lambda: vocab_parallel_cross_entropy(Tensor(rand(2, 3)), Tensor(np.array([0, 3], np.int32))), r"\[0, 3\)"),
    (lambda: vocab_parallel_cross_entropy(Tensor(rand(2, 3)), Tensor(np.zeros(2, np.float32))), "int32/int64"),
    (lambda: vocab_parallel_cross_entropy(Tensor(rand(2, 3)), Tensor(np.zeros(2, np.int32)), 1.0), r"\[0, 1\)"),
])
def test_cross_entropy_errors(call, words):
    with pytest.raises(ValueError, match=words):
        call()


# --------------------------------------------------------------------------- attention
@pytest.mark.parametrize("method", ["ring", "ulysses", "allgather_kv"])
@pytest.mark.parametrize("causal,nkv", [(False, 4), (True, 2)])
def test_attention_on_one_rank_is_dense_attention(method, causal, nkv):
    q, k, v, cot = rand(6, 2, 4, 8), rand(6, 2, nkv, 8, seed=1), rand(6, 2, nkv, 8, seed=2), rand(6, 2, 4, 8, seed=3)
    want = dense_attention(q, k, v, cot, causal)

    def loss(a, b, c):
        out = context_parallel_attention(a, b, c, TRIVIAL_CP, method=method, causal=causal)
        return (out * Tensor(cot)).sum(), out

    (_, out), grads = ms.value_and_grad(loss, (0, 1, 2), has_aux=True)(Tensor(q), Tensor(k), Tensor(v))
    for got, ref in zip([out, *grads], want):
        np.testing.assert_allclose(got.asnumpy(), ref, atol=1e-5)


@pytest.mark.parametrize("kwargs,words", [
    (dict(method="ulysses"), "whole heads"),
    (dict(split_sizes=[4, 4, 4]), "list of 4 sizes"),
    (dict(split_sizes=[4, 4, 4, -1]), "integers >= 0"),
    (dict(split_sizes=[5, 4, 4, 4]), "hold 4 rows"),
    (dict(load_balance=True), "causal=True"),
    (dict(load_balance=True, causal=True, split_sizes=[4] * 4), "no split_sizes"),
    (dict(method="flash"), "expected one of"),
    (dict(softmax_scale=-1.0), "positive"),
])
def test_attention_argument_errors_come_first(kwargs, words):
    x = Tensor(rand(4, 1, 6, 8))  # 6 heads: not divisible by 4 ranks
    before = collectives.call_count()
    with pytest.raises(ValueError, match=words):
        context_parallel_attention(x, x, x, fake(4, 0, "cp"), **kwargs)
    assert collectives.call_count() == before


def test_attention_layer_errors():
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        ContextParallelAttention(10, 4)
    with pytest.raises(ValueError, match="num_query_groups=3 is not divisible"):
        ContextParallelAttention(24, 6, num_query_groups=3, tp_group=fake(2, 0))
    with pytest.raises(ValueError, match="ulysses"):
        ContextParallelAttention(32, 4, num_query_groups=2, method="ulysses", tp_group=fake(2, 0),
                                 cp_group=fake(2, 0, "cp"))
    # The zigzag layout is the causal ring's: refused when the layer is built.
    for bad in (dict(causal=False), dict(causal=True, method="ulysses")):
        with pytest.raises(ValueError, match="load_balance=True needs method='ring' and causal=True"):
            ContextParallelAttention(32, 4, load_balance=True, **bad)
    ContextParallelAttention(32, 4, load_balance=True, causal=True)  # the valid combination builds


def test_zigzag_rows():
    x = Tensor(np.arange(16, dtype=np.float32).reshape(16, 1))
    got = [zigzag_shard(x, fake(4, r, "cp")).asnumpy().ravel().tolist() for r in range(4)]
    assert got == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert zigzag_unshard(x, TRIVIAL_CP) is x
    with pytest.raises(ValueError, match="2\\*4 = 8 chunks"):
        zigzag_shard(Tensor(np.zeros((12, 1), np.float32)), fake(4, 0, "cp"))


# --------------------------------------------------------------------------- RNG
def test_seed_rule_is_megatrons():
    assert msrandom.seeds_for(1234) == {"default": 1234, "model-parallel-rng": 3952}
    assert msrandom.seeds_for(1234, tp_rank=1, pp_rank=2) == {"default": 1434, "model-parallel-rng": 4153}
    assert msrandom.seeds_for(1, dp_rank=3, data_parallel_random_init=True)["default"] == 31


def _mask():
    return ops.dropout(Tensor(np.ones(128, np.float32)), 0.5).asnumpy() > 0


def test_tracker_fork_replays_and_leaves_the_default_stream_alone():
    assert msrandom.model_parallel_seed(3)["model-parallel-rng"] == 3 + 2718
    plain = [_mask() for _ in range(2)]
    msrandom.model_parallel_seed(3)
    tracker = msrandom.get_rng_tracker()
    states = tracker.get_states()
    first = _mask()
    with tracker.fork():
        forked = [_mask(), _mask()]
    second = _mask()
    np.testing.assert_array_equal(first, plain[0])
    np.testing.assert_array_equal(second, plain[1])  # the fork drew nothing from the default
    assert (forked[0] != plain[0]).any()
    tracker.set_states(states)
    with tracker.fork():
        np.testing.assert_array_equal(_mask(), forked[0])
        np.testing.assert_array_equal(_mask(), forked[1])
    with pytest.raises(ValueError, match="no stream 'other'"):
        with tracker.fork("other"):
            pass
    with pytest.raises(ValueError, match="seed=-1"):
        msrandom.model_parallel_seed(-1)


def test_long_sequence_example_in_a_plain_process():
    import importlib
    import sys

    from _examples_checks import examples_dir

    if examples_dir() not in sys.path:
        sys.path.insert(0, examples_dir())
    record = importlib.import_module("long_sequence").run(seq_len=64, heads=1, head_dim=8)
    assert record["passed"] and record["max_error"] <= 1e-6, record
    assert set(record["peak_mib"]) == {"ring", "allgather_kv"} and record["peak_reset"]
    assert all(v > 0 for v in record["peak_mib"].values())
