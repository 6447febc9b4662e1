"""TransformerConfig and GPTModel: the config (pure), the dense model in this process, and
ONE 4-rank job (tests/_models_job.py) comparing every layout with the dense model.

The 4-rank job (measured, see _models_job.py for the cases): every case's loss and every
gradient, gathered to its global shape, agree with the dense model computed inside the
rank within 1e-5 relative (float32; measured <= 1.3e-6), and the global weights are
identical (0.0).
"""

from __future__ import annotations

import math
import subprocess
import sys
from itertools import product

import numpy as np
import pytest

from mindscience.distributed.costmodel.errors import ModelConstraintError, ModelError
from mindscience.distributed.costmodel.spec import load_workload
from mindscience.distributed.models import TransformerConfig
from mindscience.distributed.models.config import resolve_model_file
from mindscience.distributed.models.weights import draw, tp_slice, tp_unslice

PRESETS = ("tiny-gpt", "tiny-llama", "gqa-7b", "gpt3-175b", "sci-transformer-s")
SMALL = dict(num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=24,
             seq_length=8, vocab_size=32)


# --------------------------------------------------------------------------- config (pure)
def test_config_module_does_not_import_mindspore():
    code = ("import sys; from mindscience.distributed.models import TransformerConfig; "
            "TransformerConfig.from_model_spec('tiny-llama').num_parameters(); "
            "print('mindspore' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("preset", PRESETS)
def test_from_model_spec_reads_the_preset_like_plan(preset):
    cfg = TransformerConfig.from_model_spec(preset)
    work = load_workload(resolve_model_file(preset))
    for key in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                "ffn_hidden_size", "seq_length", "vocab_size", "normalization", "activation",
                "position_embedding", "tie_embeddings", "bias", "dropout"):
        assert getattr(cfg, key) == getattr(work.model, key), key
    for key in ("micro_batch_size", "global_batch_size", "precision", "recompute", "zero_stage",
                "sequence_parallel", "context_parallel_method", "virtual_pipeline_stages"):
        assert getattr(cfg, key) == getattr(work.training, key), key
    # the same config from the file path and from the Workload
    assert TransformerConfig.from_model_spec(str(resolve_model_file(preset))) == cfg
    assert TransformerConfig.from_model_spec(work) == cfg


def test_tiny_presets_have_the_contract_shapes():
    gpt = TransformerConfig.from_model_spec("tiny-gpt")
    llama = TransformerConfig.from_model_spec("tiny-llama")
    assert (gpt.normalization, gpt.activation, gpt.position_embedding, gpt.tie_embeddings,
            gpt.num_query_groups) == ("layernorm", "gelu", "learned", True, 4)
    assert (llama.normalization, llama.activation, llama.position_embedding,
            llama.tie_embeddings, llama.bias, llama.num_query_groups) == (
        "rmsnorm", "swiglu", "rope", False, False, 2)


def test_overrides_and_keyword_construction():
    cfg = TransformerConfig.from_model_spec("tiny-gpt", num_layers=5, first_stage_layers=2)
    assert cfg.num_layers == 5 and cfg.stage_layers(2) == [2, 3]
    kw = TransformerConfig(**SMALL)
    assert kw.num_query_groups == 4 and kw.ffn_hidden_size == 24 and kw.precision == "fp32"
    assert kw.replace(num_layers=3).num_layers == 3


def _layer_count(cfg) -> int:
    """C4's per-layer structure, written out term by term."""
    h, f, g, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_query_groups, cfg.head_dim
    norm = 2 * h if cfg.normalization == "layernorm" else h
    qkv_out = h + 2 * g * d
    f1 = 2 * f if cfg.activation == "swiglu" else f
    weights = h * qkv_out + h * h + h * f1 + f * h
    biases = (qkv_out + h + f1 + h) if cfg.bias else 0
    return 2 * norm + weights + biases


OPTIONS = list(product(("layernorm", "rmsnorm"), ("gelu", "swiglu"), ("learned", "rope"),
                       (True, False), (True, False)))


@pytest.mark.parametrize("norm,act,pos,tie,bias", OPTIONS)
def test_num_parameters_follows_the_contract(norm, act, pos, tie, bias):
    cfg = TransformerConfig(**{**SMALL, "num_query_groups": 2}, normalization=norm,
                            activation=act, position_embedding=pos, tie_embeddings=tie, bias=bias)
    h, s, v = cfg.hidden_size, cfg.seq_length, cfg.vocab_size
    want = (cfg.num_layers * _layer_count(cfg) + v * h + (s * h if pos == "learned" else 0)
            + (2 * h if norm == "layernorm" else h) + (0 if tie else v * h))
    assert cfg.num_parameters() == want


def _costmodel_counts_options() -> bool:
    from mindscience.distributed.costmodel.memory import total_parameters

    base = TransformerConfig(**SMALL)
    return total_parameters(base.replace(normalization="rmsnorm").model_spec()) != \
        total_parameters(base.model_spec())


def test_num_parameters_equals_the_cost_model_for_the_gpt_shape():
    from mindscience.distributed.costmodel.memory import total_parameters

    for preset in ("tiny-gpt", "gpt3-175b"):
        cfg = TransformerConfig.from_model_spec(preset)
        assert cfg.num_parameters() == total_parameters(cfg.model_spec())


@pytest.mark.parametrize("norm,act,pos,tie,bias", OPTIONS)
def test_num_parameters_equals_the_cost_model_for_every_option(norm, act, pos, tie, bias):
    from mindscience.distributed.costmodel.memory import total_parameters

    if not _costmodel_counts_options():
        pytest.skip("costmodel.memory.total_parameters does not count contract C4's options yet")
    cfg = TransformerConfig(**{**SMALL, "num_query_groups": 2}, normalization=norm,
                            activation=act, position_embedding=pos, tie_embeddings=tie, bias=bias)
    assert cfg.num_parameters() == total_parameters(cfg.model_spec())


def test_config_errors_name_the_value():
    with pytest.raises(ModelError, match="no-such-model.*tiny-gpt"):
        TransformerConfig.from_model_spec("no-such-model")
    with pytest.raises(ModelError, match="unknown field.*num_layer\\b"):
        TransformerConfig.from_model_spec("tiny-gpt", num_layer=3)
    with pytest.raises(ModelError, match="activation='relu'"):
        TransformerConfig(**SMALL, activation="relu")
    with pytest.raises(ModelError, match="num_query_groups=3"):
        TransformerConfig(**SMALL, num_query_groups=3)
    with pytest.raises(ModelError, match="context_parallel_method='zigzag'"):
        TransformerConfig(**SMALL, context_parallel_method="zigzag")


@pytest.mark.parametrize("over,layout,match", [
    ({"vocab_size": 30}, dict(tp=4), "vocab_size=30 is not divisible by tp=4.*32"),
    ({"num_query_groups": 2}, dict(tp=4), "num_query_groups=2 is not divisible by tp=4"),
    ({"ffn_hidden_size": 30}, dict(tp=4), "ffn_hidden_size=30"),
    ({}, dict(cp=3), "seq_length=8 is not divisible by 6 at cp=3"),
    ({"context_parallel_method": "allgather_kv"}, dict(cp=3), "seq_length=8 is not divisible by 3"),
    ({"context_parallel_method": "ulysses"}, dict(tp=2, cp=4), "ulysses.*num_query_groups/tp"),
    ({"seq_length": 12, "context_parallel_method": "allgather_kv"}, dict(tp=4, cp=2),
     "sequence_parallel at tp=4.*6 tokens"),
    ({"virtual_pipeline_stages": 2}, dict(pp=1), "virtual_pipeline_stages=2 needs"),
    ({"num_layers": 3}, dict(pp=2), "num_layers=3 cannot be cut"),
    ({"vocab_size": 0}, dict(), "vocab_size=0"),
])
def test_check_layout_errors(over, layout, match):
    cfg = TransformerConfig(**{**SMALL, **over})
    with pytest.raises((ModelConstraintError, ModelError), match=match):
        cfg.check_layout(**layout)


def test_check_layout_returns_the_stage_layers():
    cfg = TransformerConfig(**{**SMALL, "num_layers": 8}, virtual_pipeline_stages=2)
    assert cfg.check_layout(tp=2, cp=2, pp=2) == [2, 2, 2, 2]
    assert cfg.replace(virtual_pipeline_stages=1, last_stage_layers=5).check_layout(pp=2) == [3, 5]


# --------------------------------------------------------------------------- weights (pure)
def test_global_weights_are_keyed_by_name_and_seed():
    a = draw(3, "layers.0.attention.qkv.weight", (6, 4), "normal")
    assert np.array_equal(a, draw(3, "layers.0.attention.qkv.weight", (6, 4), "normal"))
    assert not np.array_equal(a, draw(4, "layers.0.attention.qkv.weight", (6, 4), "normal"))
    assert not np.array_equal(a, draw(3, "layers.1.attention.qkv.weight", (6, 4), "normal"))
    assert abs(float(a.std()) - 0.02) < 0.01
    out = draw(3, "layers.0.mlp.fc2.weight", (400, 400), "output", num_layers=8)
    assert abs(float(out.std()) - 0.02 / math.sqrt(16)) < 1e-3


def test_strided_slices_put_back_together():
    full = np.arange(24).reshape(8, 3)
    parts = [tp_slice(full, 0, r, 2, stride=2) for r in range(2)]
    assert parts[0][:, 0].tolist() == [0, 3, 12, 15]  # gate rows 0-1, up rows 4-5
    assert np.array_equal(tp_unslice(parts, 0, stride=2), full)
    cols = [tp_slice(full, 1, r, 3) for r in range(3)]
    assert np.array_equal(tp_unslice(cols, 1), full)


# --------------------------------------------------------------------------- dense model
ms = pytest.importorskip("mindspore")


def _dense(cfg, seed=5):
    from mindscience.distributed.models import GPTModel

    return GPTModel(cfg, seed=seed)


def _batch(cfg, rows, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, cfg.vocab_size, (rows, cfg.seq_length)).astype(np.int32),
            rng.integers(0, cfg.vocab_size, (rows, cfg.seq_length)).astype(np.int32))


def _numpy_loss(cfg, w: dict, ids, labels) -> float:
    """The model's loss in float64 numpy from its weights by name (an independent forward)."""
    from math import erf

    erf_v = np.vectorize(erf)
    b, s = ids.shape
    h, n, g, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups, cfg.head_dim

    def norm(x, p):
        if cfg.normalization == "rmsnorm":
            return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5) * w[p + ".weight"]
        c = x - x.mean(-1, keepdims=True)
        return c / np.sqrt((c * c).mean(-1, keepdims=True) + 1e-5) * w[p + ".weight"] + w[p + ".bias"]

    def lin(x, p):
        y = x @ w[p + ".weight"].T
        return y + w[p + ".bias"] if cfg.bias else y

    def rope(x):  # (b, s, heads, d)
        inv = 1.0 / 10000 ** (np.arange(0, d, 2) / d)
        ang = np.outer(np.arange(s), inv)
        ang = np.concatenate([ang, ang], -1)[None, :, None, :]
        rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
        return x * np.cos(ang) + rot * np.sin(ang)

    x = w["embedding.word_embeddings.weight"][ids]
    if cfg.position_embedding == "learned":
        x = x + w["embedding.position_embeddings.weight"][None, :s]
    mask = np.tril(np.ones((s, s), bool))
    for i in range(cfg.num_layers):
        p = f"layers.{i}"
        t = lin(norm(x, p + ".input_norm"), p + ".attention.qkv").reshape(b, s, g, n // g + 2, d)
        q = t[:, :, :, :n // g].reshape(b, s, n, d)
        k, v = t[:, :, :, n // g], t[:, :, :, n // g + 1]
        if cfg.position_embedding == "rope":
            q, k = rope(q), rope(k)
        out = np.empty_like(q)
        for head in range(n):
            sc = q[:, :, head] @ k[:, :, head // (n // g)].transpose(0, 2, 1) / math.sqrt(d)
            sc = np.where(mask, sc, -np.inf)
            pr = np.exp(sc - sc.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            out[:, :, head] = pr @ v[:, :, head // (n // g)]
        x = x + lin(out.reshape(b, s, n * d), p + ".attention.proj")
        y = lin(norm(x, p + ".post_attention_norm"), p + ".mlp.fc1")
        if cfg.activation == "swiglu":
            gate, up = np.split(y, 2, -1)
            y = gate / (1 + np.exp(-gate)) * up
        else:
            y = 0.5 * y * (1 + erf_v(y / math.sqrt(2)))
        x = x + lin(y, p + ".mlp.fc2")
    x = norm(x, "final_norm")
    table = w["embedding.word_embeddings.weight" if cfg.tie_embeddings else "output_layer.weight"]
    z = x @ table.T
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-np.take_along_axis(logp, labels[..., None], -1).mean())


GPT_SMALL = dict(SMALL)
LLAMA_SMALL = dict(SMALL, num_query_groups=2, normalization="rmsnorm", activation="swiglu",
                   position_embedding="rope", tie_embeddings=False, bias=False)


@pytest.mark.parametrize("shape", [GPT_SMALL, LLAMA_SMALL], ids=["gpt", "llama"])
def test_dense_model_matches_a_numpy_forward_and_finite_differences(shape):
    cfg = TransformerConfig(**shape)
    model = _dense(cfg)
    params = model.trainable_params()
    assert sum(int(np.prod(p.shape)) for p in params) == cfg.num_parameters()
    ids, labels = _batch(cfg, 2)
    loss, grads = model.forward_backward(ids, labels, num_microbatches=1, mode="pynative")
    w = {p.name: p.asnumpy().astype(np.float64) for p in params}
    want = _numpy_loss(cfg, w, ids, labels)
    assert abs(float(loss.asnumpy()) - want) <= 1e-5 * want
    # central differences in float64 on a few entries of a few tensors
    rng = np.random.default_rng(1)
    names = [p.name for p in params]
    for name in ("embedding.word_embeddings.weight", "layers.1.attention.qkv.weight",
                 "layers.0.mlp.fc1.weight", "final_norm.weight"):
        g = grads[names.index(name)].asnumpy()
        for _ in range(2):
            idx = tuple(int(rng.integers(0, n)) for n in w[name].shape)
            if name.startswith("embedding"):
                idx = (int(ids[0, 0]),) + idx[1:]  # a row that is looked up
            eps = 1e-4
            w[name][idx] += eps
            up = _numpy_loss(cfg, w, ids, labels)
            w[name][idx] -= 2 * eps
            down = _numpy_loss(cfg, w, ids, labels)
            w[name][idx] += eps
            fd = (up - down) / (2 * eps)
            assert abs(g[idx] - fd) <= 1e-3 * max(abs(fd), float(np.abs(g).max())), (name, idx)


def test_dense_names_are_global_and_weights_do_not_depend_on_the_model_size():
    cfg = TransformerConfig(**LLAMA_SMALL)
    small, big = _dense(cfg), _dense(cfg.replace(num_layers=3))
    names = [p.name for p in big.trainable_params()]
    assert names[0] == "embedding.word_embeddings.weight"
    assert "layers.2.mlp.fc2.weight" in names and names[-1] == "output_layer.weight"
    assert "embedding.position_embeddings.weight" not in names  # RoPE: no table
    mine = {p.name: p.asnumpy() for p in small.trainable_params()}
    for p in big.trainable_params():
        if p.name not in mine:
            continue
        if p.name.endswith(("proj.weight", "fc2.weight")):
            # output projections are drawn with std 0.02 / sqrt(2 L): the same draw, rescaled
            np.testing.assert_allclose(p.asnumpy() * math.sqrt(3), mine[p.name] * math.sqrt(2),
                                       rtol=1e-5, atol=1e-8)
        else:
            assert np.array_equal(p.asnumpy(), mine[p.name]), p.name
    other = _dense(cfg, seed=6)
    assert not np.array_equal(other.trainable_params()[0].asnumpy(),
                              small.trainable_params()[0].asnumpy())


def test_seed_defaults_to_mindspore_set_seed():
    cfg = TransformerConfig(**GPT_SMALL)
    from mindscience.distributed.models import GPTModel

    ms.set_seed(11)
    a = GPTModel(cfg).trainable_params()[0].asnumpy()
    assert np.array_equal(a, _dense(cfg, seed=11).trainable_params()[0].asnumpy())


def test_microbatches_recompute_and_jit_give_the_same_step():
    cfg = TransformerConfig(**LLAMA_SMALL)
    ids, labels = _batch(cfg, 4, seed=2)
    ref_loss, ref = _dense(cfg).forward_backward(ids, labels, 1, mode="pynative")
    variants = {
        "4 micro-batches": (_dense(cfg), dict(num_microbatches=4, mode="pynative")),
        "full recompute": (_dense(cfg.replace(recompute="full")), dict(num_microbatches=2, mode="pynative")),
        "selective recompute": (_dense(cfg.replace(recompute="selective")),
                                dict(num_microbatches=1, mode="pynative")),
        "jit": (_dense(cfg), dict(num_microbatches=2, mode="jit")),
    }
    for what, (model, kw) in variants.items():
        loss, grads = model.forward_backward(ids, labels, **kw)
        assert abs(float(loss.asnumpy()) - float(ref_loss.asnumpy())) <= 1e-6, what
        for g, r in zip(grads, ref):
            err = np.abs(g.asnumpy() - r.asnumpy()).max() / np.abs(r.asnumpy()).max()
            assert err <= 1e-5, what


def test_jit_step_of_four_layers_equals_pynative():
    """The compiled step at tiny-gpt's depth (4 layers, tied embedding, learned positions).

    Up to 3 layers compiled; at 4 MindSpore stopped inlining the shared attention cell and
    its autodiff failed on the keyword calls that packed a ParallelGroup into the argument
    tuple ("The python type ParallelGroup cannot be converted"), the error of
    ``msdist train --mode jit``.
    """
    cfg = TransformerConfig(**dict(GPT_SMALL, num_layers=4))
    ids, labels = _batch(cfg, 4, seed=3)
    ref_loss, ref = _dense(cfg).forward_backward(ids, labels, 2, mode="pynative")
    loss, grads = _dense(cfg).forward_backward(ids, labels, 2, mode="jit")
    assert abs(float(loss.asnumpy()) - float(ref_loss.asnumpy())) <= 1e-6
    assert len(grads) == len(ref) == 4 * 12 + 4
    for g, r in zip(grads, ref):
        err = np.abs(g.asnumpy() - r.asnumpy()).max() / np.abs(r.asnumpy()).max()
        assert err <= 1e-5


def _dropout_step(cfg, mode, m=2):
    ms.set_seed(7)  # the default stream of the dropouts (the weights come from seed=5)
    loss, grads = _dense(cfg).forward_backward(*_batch(cfg, 4, seed=4), m, mode=mode)
    return float(loss.asnumpy()), [g.asnumpy() for g in grads]


def _max_rel(grads, ref):
    return max(np.abs(g - r).max() / np.abs(r).max() for g, r in zip(grads, ref))


@pytest.mark.parametrize("mode", ["pynative", "jit"])
def test_dropout_is_seeded_and_replayed_by_full_recompute(mode):
    """Dropout draws from the seeded stream (the same step twice is identical, and differs
    from no dropout), and full recompute replays its masks: identical gradients. Measured
    with Cell.recompute() (what the model used before random.recompute) in PyNative:
    a new mask in the recomputed forward, gradients 1.2 (relative) off."""
    cfg = TransformerConfig(**dict(GPT_SMALL, num_layers=4, dropout=0.2))
    loss, grads = _dropout_step(cfg, mode)
    again, grads_again = _dropout_step(cfg, mode)
    plain, _ = _dropout_step(cfg.replace(dropout=0.0), mode)
    recomputed, grads_rc = _dropout_step(cfg.replace(recompute="full"), mode)
    assert again == loss and _max_rel(grads_again, grads) == 0.0
    assert abs(plain - loss) > 1e-4
    assert recomputed == loss and _max_rel(grads_rc, grads) == 0.0


def test_dropout_masks_of_jit_and_pynative_agree_on_one_microbatch():
    """Both draw each site's seeds in the same order from the same stream, so one
    micro-batch gets the same masks (later ones differ: a compiled kernel advances its
    own state)."""
    cfg = TransformerConfig(**dict(GPT_SMALL, num_layers=2, dropout=0.2))
    loss, grads = _dropout_step(cfg, "pynative", m=1)
    compiled, grads_c = _dropout_step(cfg, "jit", m=1)
    assert abs(compiled - loss) <= 1e-6 and _max_rel(grads_c, grads) <= 1e-5


def test_dropout_draws_from_the_stream_its_activations_need():
    """``Dropout(p, parallel=True)`` takes the tracker's model-parallel stream (what
    ``ops.dropout`` inside ``fork()`` draws), ``parallel=False`` the default one; two
    sites of one compiled graph, and two runs of it, draw different masks."""
    from mindspore import nn, ops

    from mindscience.distributed import random as msrandom
    from mindscience.distributed.models.layers import Dropout

    x = ms.Tensor(np.ones((256,), np.float32))
    tracker = msrandom.get_rng_tracker()
    saved = tracker.get_states()

    def fresh():
        ms.set_seed(5)
        tracker.reset()
        tracker.add(msrandom.MODEL_PARALLEL_RNG, 77)

    def mask(t):
        return t.asnumpy() > 0

    try:
        fresh()
        forked = Dropout(0.5, True)
        forked.set_train(True)
        got = mask(forked(x))
        fresh()
        with tracker.fork():
            want = mask(ops.dropout(x, p=0.5))
        fresh()
        default = mask(ops.dropout(x, p=0.5))
        fresh()
        plain = Dropout(0.5, False)
        plain.set_train(True)
        assert (got == want).all() and (got != default).any()
        assert (mask(plain(x)) == default).all()

        class Two(nn.Cell):
            def __init__(self):
                super().__init__()
                self.a, self.b = Dropout(0.5, True), Dropout(0.5, True)

            def construct(self, y):
                return self.a(y), self.b(y)

        two = Two()
        two.set_train(True)
        run = ms.jit(two.construct)
        a1, b1 = (mask(t) for t in run(x))
        a2, _ = (mask(t) for t in run(x))
        assert (a1 != b1).any() and (a1 != a2).any() and 0.3 < a1.mean() < 0.7
    finally:
        tracker.set_states(saved)


def test_forward_backward_input_errors():
    cfg = TransformerConfig(**GPT_SMALL)
    model = _dense(cfg)
    ids, labels = _batch(cfg, 4)
    with pytest.raises(ModelError, match=r"input_ids has shape \(4, 7\).*seq_length=8"):
        model.forward_backward(ids[:, :7], labels[:, :7])
    with pytest.raises(ModelError, match="num_microbatches=3"):
        model.forward_backward(ids, labels, num_microbatches=3)
    with pytest.raises(ModelError, match="outside \\[0, 32\\)"):
        model.forward_backward(ids + 32, labels)
    with pytest.raises(ModelError, match="mode='graph'"):
        model.forward_backward(ids, labels, mode="graph")
    with pytest.raises(ModelError, match="dtype float32"):
        model.forward_backward(ids.astype(np.float32), labels)
    with pytest.raises(TypeError, match="TransformerConfig"):
        from mindscience.distributed.models import GPTModel

        GPTModel({"num_layers": 2})


def test_sequence_rows_zigzag():
    from mindscience.distributed.models import sequence_rows

    assert sequence_rows(8, 2, 0, True).tolist() == [0, 1, 6, 7]
    assert sequence_rows(8, 2, 1, True).tolist() == [2, 3, 4, 5]
    assert sequence_rows(8, 2, 1, False).tolist() == [4, 5, 6, 7]
    every = np.sort(np.concatenate([sequence_rows(16, 4, r, True) for r in range(4)]))
    assert every.tolist() == list(range(16))


# --------------------------------------------------------------------------- 4 ranks
@pytest.fixture(scope="module")
def job():
    import _models_job

    result = _models_job.run_job()
    assert result.ok, _models_job.describe_failures(result)
    return result


def _records(job, check):
    import _models_job

    return _models_job.records_of(job, check)


CASES = {"ring": "tp2-cp2", "ulysses": "tp2-cp2", "allgather_kv": "tp2-cp2",
         "ring_gqa_rope": "tp2-cp2", "1f1b_tp": "tp2-cp1-dp1-pp2", "interleaved": "tp1-cp1-dp2-pp2",
         "unequal": "tp1-cp1-dp2-pp2", "sequence_parallel": "tp2-cp1-dp2"}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_every_layout_matches_the_dense_model(job, case):
    recs = [r for r in _records(job, "models.parity") if r["case"] == case]
    assert len(recs) == 4
    for r in recs:
        assert r["layout"].startswith(CASES[case]), r["layout"]
        assert r["loss_rel_err"] <= 1e-5, r
        assert r["max_grad_rel_err"] <= 1e-5, (r["worst_param"], r["max_grad_rel_err"])
        assert r["max_weight_err"] == 0.0
        assert r["passed"]
        assert abs(r["loss"] - math.log(64)) < 0.5  # the step really ran: ~ln V at init
    # every gradient of the dense model was compared on some rank
    compared = set().union(*(r["compared"] for r in recs))
    assert compared == set(recs[0]["dense_params"])


@pytest.mark.multiprocess
def test_pipeline_ranks_hold_the_layers_of_their_stages(job):
    layers = {}
    for r in _records(job, "models.parity"):
        layers.setdefault(r["case"], set()).add(tuple(r["layer_indices"]))
    assert layers["interleaved"] == {(0, 2), (1, 3)}   # v = 2: chunk c of rank i is stage 2c + i
    assert layers["unequal"] == {(0, 1), (2, 3, 4)}    # first_stage_layers=2 of 5
    assert layers["1f1b_tp"] == {(0, 1), (2, 3)}
    assert layers["ring"] == {(0, 1)}


# What the pipeline runtime ran: kept stage forwards (the model's recompute inside them), in
# PyNative and jit, with tp collectives in the stage too (1f1b_tp: jit at tp2 x pp2).
PIPELINE_RUNS = {"1f1b_tp": "none", "interleaved": "selective", "unequal": "none"}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(PIPELINE_RUNS))
def test_pipeline_keeps_the_stage_forwards(job, case):
    recs = [r for r in _records(job, "models.parity") if r["case"] == case]
    assert len(recs) == 4
    for r in recs:
        assert r["what_runs"] == PIPELINE_RUNS[case], r
        assert r["passed"], r


@pytest.mark.multiprocess
def test_bad_configs_raise_on_every_rank_before_any_collective(job):
    recs = _records(job, "models.errors")
    assert len(recs) == 4 * 4
    for r in recs:
        assert r["raised"] == "ModelConstraintError", r
    msgs = {r["case"]: r["message"] for r in recs}
    assert "vocab_size=63 is not divisible by tp=2" in msgs["vocab"]
    assert "num_query_groups=1" in msgs["groups"]
    assert "seq_length=18" in msgs["seq"]
    assert "ulysses" in msgs["ulysses"]


# --------------------------------------------------------------------------- 8 ranks
@pytest.mark.multiprocess
def test_dropout_at_tp2_draws_the_right_streams_and_recompute_replays_them(job):
    recs = _records(job, "models.dropout")
    # per rank: sequence parallel in PyNative and jit, replicated in PyNative
    assert len(recs) == 4 * 3
    for r in recs:
        assert r["layout"].startswith("tp2-cp1-dp2"), r["layout"]
        assert r["recompute_grad_max_diff"] == 0.0 and r["loss"] == r["loss_recompute"], r
        # sequence-parallel rows: other masks on each tp rank; replicated: the same
        assert r["tp_masks_differ"] == r["sequence_parallel"], r
        if not r["sequence_parallel"]:
            assert r["loss_rel_err"] <= 1e-5 and r["max_grad_rel_err"] <= 1e-5, r
        assert r["passed"], r
    assert {(r["sequence_parallel"], r["mode"]) for r in recs} == {
        (True, "pynative"), (True, "jit"), (False, "pynative")}


@pytest.mark.multiprocess
def test_8ranks_tp2_pp2_dp2_matches_the_dense_model():
    """tp2 x pp2 (1F1B, 2 micro-batches) x dp2, tied embedding: the loss and every gradient
    within 1e-5 relative of the dense model's, in the session's 8-rank launch."""
    import _models_job

    result = _models_job.run_job8()
    assert result.ok, _models_job.describe_failures(result)
    recs = _models_job.records_of(result, "models.parity")
    assert len(recs) == _models_job.WORLD_SIZE_8
    for r in recs:
        assert r["case"] == "1f1b_tp_dp" and r["layout"].startswith("tp2-cp1-dp2-pp2"), r["layout"]
        assert r["loss_rel_err"] <= 1e-5, r
        assert r["max_grad_rel_err"] <= 1e-5, (r["worst_param"], r["max_grad_rel_err"])
        assert r["max_weight_err"] == 0.0 and r["passed"]
        assert abs(r["loss"] - math.log(64)) < 0.5
    assert {tuple(r["layer_indices"]) for r in recs} == {(0,), (1,)}
    # full recompute: each layer recomputed inside the kept stage forwards (model_request)
    assert {(r["recompute"], r["what_runs"]) for r in recs} == {("full", "selective")}
    compared = set().union(*(r["compared"] for r in recs))
    assert compared == set(recs[0]["dense_params"])
