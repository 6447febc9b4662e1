"""Cost model: parameters, Korthikanti's activation formulas, stage memory, traffic, constraints.

Expected values are written out by hand from the papers' formulas (not from the module).
"""

from dataclasses import replace
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mindscience.distributed.costmodel import (
    ClusterSpec,
    ModelConstraintError,
    ModelError,
    ModelSpec,
    TrainingSpec,
    Workload,
    check,
    estimate,
    load_workload,
    layer_activation_bytes,
    stage_parameters,
    stage_rows,
    total_parameters,
    violations,
)
from mindscience.distributed.costmodel.comm import send_factor, traffic, zero_traffic
from mindscience.distributed.costmodel.memory import bytes_per_parameter
from mindscience.distributed.costmodel.params import layer_parameters
from mindscience.distributed.costmodel.runtime import Runtime, what_runs
from mindscience.distributed.costmodel.steptime import stage_slot_flops, step_time
from mindscience.distributed.costmodel.report import memory_report
from mindscience.distributed.topology import Layout

GPT3 = ModelSpec(num_layers=96, hidden_size=12288, num_attention_heads=96, seq_length=2048, dropout=0.1,
                 vocab_size=51200, name="gpt3")
L, H, A, S, V = 96, 12288, 96, 2048, 51200
SBH = S * 1 * H  # micro-batch 1
MIB = 1024**2


# ------------------------------------------------------------------ parameters
def test_gpt3_parameter_count_matches_narayanan():
    # Narayanan et al. 2021: P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)) = 174.6 B.
    narayanan = 12 * L * H**2 + 13 * L * H + (V + S) * H
    assert narayanan == 174_615_822_336
    total = total_parameters(GPT3)
    assert total == narayanan + 2 * H  # plus the final layernorm the paper's formula drops
    assert abs(total - 174.6e9) / 174.6e9 < 0.005


def test_gqa_and_ffn_parameters():
    # 7B-shaped GQA: q h*h, k and v h*(g*d) each, out h*h, MLP 2*h*f; biases h+2gd, h, f, h; 2 layernorms 4h.
    m = ModelSpec(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                  ffn_hidden_size=21504, seq_length=4096, vocab_size=32000)
    d, kv = 128, 8 * 128
    layer = 4096 * (4096 + 2 * kv) + 4096 * 4096 + 2 * 4096 * 21504 + (4096 + 2 * kv) + 4096 + 21504 + 4096 + 4 * 4096
    assert m.kv_channels == d
    assert total_parameters(m) == 32 * layer + 32000 * 4096 + 4096 * 4096 + 2 * 4096


def test_stage_parameters_gpt3_tp8_pp8():
    # Per layer: split 12h^2 + 7h (weights, QKV and first-MLP biases) over tp; 6h replicated.
    split, replicated = 12 * H * H + 7 * H, 6 * H
    first = stage_parameters(GPT3, tp=8, pp=8, stage=0)
    assert first == (12 * split // 8 + V * H // 8, 12 * replicated + S * H)
    assert first[0] + first[1] == 2_822_731_776
    assert stage_parameters(GPT3, 8, 8, 3) == (12 * split // 8, 12 * replicated)
    # The last stage holds the tied output layer: a copy of the word embedding (summed over
    # the embedding group), as the library's pipeline models keep it.
    assert stage_parameters(GPT3, 8, 8, 7) == (12 * split // 8 + V * H // 8, 12 * replicated + 2 * H)


@st.composite
def sharded_models(draw):
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    pp = draw(st.sampled_from([1, 2, 3, 4]))
    groups = tp * draw(st.integers(1, 3))
    heads = groups * draw(st.integers(1, 3))
    model = ModelSpec(
        num_layers=pp * draw(st.integers(1, 4)),
        hidden_size=heads * draw(st.integers(1, 16)),
        num_attention_heads=heads,
        num_query_groups=groups,
        ffn_hidden_size=tp * draw(st.integers(1, 64)),
        seq_length=draw(st.integers(1, 4096)),
        vocab_size=tp * draw(st.integers(0, 1000)),
    )
    return model, tp, pp


@settings(max_examples=200, deadline=None)
@given(sharded_models())
def test_parameters_summed_over_the_tp_pp_grid_equal_the_total(case):
    """Every parameter is held by exactly one rank of a tp x pp grid, except the replicated
    ones (layernorms, row-parallel biases, positions), which each of the tp ranks holds,
    and a tied embedding, whose copy the last of pp > 1 stages holds."""
    model, tp, pp = case
    per_rank = [stage_parameters(model, tp, pp, stage) for stage in range(pp) for _ in range(tp)]
    held = sum(shard + whole for shard, whole in per_rank)
    replicated_copies = (tp - 1) * sum(stage_parameters(model, tp, pp, s)[1] for s in range(pp))
    tied_copy = model.vocab_size * model.hidden_size if pp > 1 else 0
    assert held - replicated_copies - tied_copy == total_parameters(model)


# ------------------------------------------------------------------ activations (Korthikanti Table 2)
def korthikanti(t, sp, recompute):
    """Table 2 of Korthikanti et al. 2022 in bytes per layer (16-bit activations), with the
    scores term 4as/h instead of 5as/h: the library's attention has no dropout, so of
    Korthikanti's softmax output (2), dropout mask (1) and dropped copy (2) it keeps the
    scores (2) and probabilities (2) of its dense core."""
    if recompute == "full":
        return Fraction(2 * SBH, t if sp else 1)
    if recompute == "selective":
        per = Fraction(34, t) if sp else 10 + Fraction(24, t)
    else:
        scores = Fraction(4 * A * S, H * t)
        per = Fraction(34, t) + scores if sp else 10 + Fraction(24, t) + scores
    return SBH * per


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("t,sp", [(1, False), (8, False), (8, True), (4, True), (2, False)])
def test_layer_activations_reproduce_table_2(t, sp, recompute):
    training = TrainingSpec(recompute=recompute, sequence_parallel=sp)
    assert layer_activation_bytes(GPT3, training, tp=t, cp=1) == korthikanti(t, sp, recompute)


def test_gpt3_tp8_sp_selective_is_34_over_t_exactly():
    value = layer_activation_bytes(GPT3, TrainingSpec(recompute="selective"), tp=8, cp=1)
    assert value == S * 1 * H * 34 // 8 == 106_954_752
    # Unparallelized: s*b*h*(34 + 4*a*s/h) = sbh * (34 + 64).
    assert layer_activation_bytes(GPT3, TrainingSpec(sequence_parallel=False), 1, 1) == SBH * 98


def test_fp32_activations_double_every_non_mask_term():
    # 16 bits: 10 = 4 tensors * 2 + 2 masks; 24 = 12 * 2; 4 = 2 tensors * 2. 32 bits: 18, 48, 8.
    training = TrainingSpec(precision="fp32", sequence_parallel=False)
    assert layer_activation_bytes(GPT3, training, 8, 1) == SBH * (18 + Fraction(48, 8) + Fraction(8 * A * S, H * 8))


def test_without_dropout_the_masks_are_gone_and_the_ring_keeps_no_scores():
    nodrop = ModelSpec(num_layers=96, hidden_size=H, num_attention_heads=A, seq_length=S, vocab_size=V)
    # 10 -> 8 (no masks) with the 24 split over t = 8, no sequence parallelism, selective.
    training = TrainingSpec(sequence_parallel=False, recompute="selective")
    assert layer_activation_bytes(nodrop, training, 8, 1) == SBH * 8 + SBH * 24 // 8
    # cp = 2 with the ring (the default method): s/cp tokens, no scores even without recomputation.
    ring = TrainingSpec(sequence_parallel=True)
    assert layer_activation_bytes(GPT3, ring, tp=4, cp=2) == (S // 2) * H * Fraction(34, 4)
    # SwiGLU keeps its fused 2f input and f output: split 2*(2h + 2gd + 3f) per token.
    swiglu = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=0,
                       ffn_hidden_size=128, activation="swiglu")
    assert layer_activation_bytes(swiglu, TrainingSpec(recompute="selective", sequence_parallel=False), 1, 1) == \
        32 * (4 * 2 * 64 + 2 * (2 * 64 + 2 * 64 + 3 * 128))


def test_context_parallel_divides_the_sequence_and_keeps_full_attention():
    # Ulysses: s/cp tokens per rank; scores for a/(t*cp) heads over the whole sequence.
    training = TrainingSpec(sequence_parallel=True, context_parallel_method="ulysses")
    got = layer_activation_bytes(GPT3, training, tp=4, cp=2)
    assert got == (S // 2) * H * Fraction(34, 4) + 4 * (A // 8) * S * S


def test_gpt3_stage_memory_tp8_pp8_by_hand():
    # Korthikanti's 1F1B memory (every layer's activations of the micro-batches in flight):
    # stage_rows without the library runtime's stage re-run.
    training = TrainingSpec(global_batch_size=1536, recompute="selective")
    layout = Layout(world_size=64, tp=8, pp=8, devices_per_node=8)
    stages = stage_rows(GPT3, training, 8, 1, 8, 1, 800 * MIB)
    report = {"memory": memory_report(stages, 64 * 1024**3),
              "model": {"num_microbatches": estimate(layout, Workload(model=GPT3, training=training))
                        ["model"]["num_microbatches"]}}
    first = report["memory"]["stages"][0]
    params = 2_822_731_776
    layer = 106_954_752
    scores = 4 * A * S * S // 8  # the one layer being recomputed: scores and probabilities
    embedding = (8 * S + SBH // 8) * 8  # token ids + dropout mask, 8 micro-batches in flight
    activations = 12 * layer * 8 + scores + embedding
    assert first["microbatches_in_flight"] == 8 and report["model"]["num_microbatches"] == 1536
    assert first["parameters"] == params
    assert (first["weights_bytes"], first["gradients_bytes"], first["optimizer_bytes"]) == (2 * params, 4 * params, 12 * params)
    assert first["activations_bytes"] == activations == 10_494_279_680
    assert first["communicator_bytes"] == 2 * 400 * MIB  # tp and pp communicators
    assert first["total_bytes"] == 18 * params + activations + 800 * MIB == 62_142_312_448
    last = report["memory"]["stages"][7]
    assert last["microbatches_in_flight"] == 1
    # Korthikanti 4.3: the output layer adds 4sbh/t * (1 + v/h).
    assert last["activations_bytes"] == 12 * layer + scores + 4 * SBH // 8 * (1 + Fraction(V, H))
    assert report["memory"]["peak_bytes"] == first["total_bytes"]
    assert report["memory"]["fits"] is True  # 57.9 GiB of 64


def test_distributed_optimizer_is_6_plus_12_over_dp_cp():
    model = ModelSpec(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=512, vocab_size=1024)
    plain = stage_rows(model, TrainingSpec(), 1, 2, 1, 4)[0]
    sharded = stage_rows(model, TrainingSpec(distributed_optimizer=True), 1, 2, 1, 4)[0]
    p = plain["parameters"]
    assert plain["weights_bytes"] + plain["gradients_bytes"] + plain["optimizer_bytes"] == 18 * p
    assert sharded["weights_bytes"] + sharded["gradients_bytes"] + sharded["optimizer_bytes"] == 6 * p + 12 * p // 8


def test_full_recompute_stores_layer_inputs_and_rebuilds_one_layer():
    training = TrainingSpec(recompute="full", global_batch_size=64)
    rows = stage_rows(GPT3, training, 8, 1, 8, 1)
    everything = int(korthikanti(8, True, "none"))
    assert rows[3]["activations_bytes"] == 12 * (2 * SBH // 8) * 5 + everything  # stage 3: 8 - 3 in flight


# ------------------------------------------------------------------ communication
def test_send_factors_are_nccl_tests_bus_factors():
    assert send_factor("all_reduce", 8) == 2 * 7 / 8
    assert send_factor("all_gather", 8) == send_factor("reduce_scatter", 8) == send_factor("all_to_all", 8) == 7 / 8
    assert send_factor("send_recv", 2) == 1 and send_factor("all_reduce", 1) == 0


def test_gpt3_traffic_tp8_pp8_by_hand():
    training = TrainingSpec(global_batch_size=1536, recompute="selective")
    rows = {(r["group"], r["op"]): r for r in traffic(GPT3, training, tp=8, cp=1, pp=8, dp=1)}
    passes = 12 * 1536  # layers per stage x micro-batches
    message = SBH * 2
    assert rows["tp", "all_gather"]["count"] == 6 * passes
    assert rows["tp", "all_gather"]["bytes"] == 6 * passes * message * 7 // 8
    assert rows["tp", "reduce_scatter"]["bytes"] == 4 * passes * message * 7 // 8
    assert rows["pp", "send_recv"]["count"] == 2 * 1536
    assert rows["pp", "send_recv"]["bytes"] == 2 * 1536 * message // 8
    assert ("dp-cp", "all_reduce") not in rows  # dp = cp = 1
    layout = Layout(world_size=64, tp=8, pp=8, devices_per_node=8)
    comm = estimate(layout, Workload(model=GPT3, training=training))["communication"]
    by_group = {r["group"]: r for r in comm["per_step"]}
    assert by_group["tp"]["crosses_nodes"] is False and by_group["pp"]["crosses_nodes"] is True
    assert by_group["pp"]["est_time_s"] == pytest.approx(2 * 1536 * message / 8 / 25e9)
    assert comm["bottleneck"] == "tp"


def test_traffic_without_sp_cp_and_distributed_optimizer():
    m = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  seq_length=32, vocab_size=128)
    training = TrainingSpec(sequence_parallel=False, distributed_optimizer=True, global_batch_size=4,
                            context_parallel_method="ulysses")
    rows = {(r["group"], r["op"]): r for r in traffic(m, training, tp=2, cp=2, pp=1, dp=2)}
    passes = 2 * 2  # 2 layers x m = 4 / (1 * 2)
    act = 16 * 64 * 2  # s/cp * b * h * 2 bytes
    assert rows["tp", "all_reduce"]["bytes"] == 4 * passes * act * 2 * 1 // 2
    # q, out: h/tp = 32 channels; k, v: g*d/tp = 16; forward and backward; (cp-1)/cp = 1/2.
    assert rows["cp", "all_to_all"]["count"] == 8 * passes
    assert rows["cp", "all_to_all"]["bytes"] == 2 * passes * 16 * (32 + 32 + 16 + 16) * 2 // 2
    params = sum(stage_parameters(m, 2, 1, 0))
    assert rows["dp-cp", "reduce_scatter"]["bytes"] == params * 4 * 3 // 4
    assert rows["dp-cp", "all_gather"]["bytes"] == params * 2 * 3 // 4


# ------------------------------------------------------------------ constraints and values
@pytest.mark.parametrize(
    "model,training,sizes,name,fix",
    [
        (dict(num_attention_heads=6, hidden_size=48), {}, (4, 1, 1, 1), "num_attention_heads % tp", "tp that divides 6"),
        (dict(num_attention_heads=8, num_query_groups=2), {}, (4, 1, 1, 1), "num_query_groups % tp", "tp that divides 2"),
        (dict(num_attention_heads=8), dict(context_parallel_method="ulysses"), (2, 8, 1, 1),
         "(num_attention_heads / tp) % cp", "cp that divides 4"),
        (dict(num_attention_heads=8, num_query_groups=4), dict(context_parallel_method="ulysses"), (2, 4, 1, 1),
         "(num_query_groups / tp) % cp", "cp that divides 2"),
        (dict(num_layers=3), {}, (1, 1, 2, 1), "num_layers % pp", "pp that divides 3"),
        (dict(seq_length=6), {}, (4, 1, 1, 1), "seq_length % (tp*cp)", "sequence_parallel: false"),
        (dict(seq_length=6), dict(sequence_parallel=False), (1, 4, 1, 1), "seq_length % cp", "cp that divides 6"),
        (dict(ffn_hidden_size=6), {}, (4, 1, 1, 1), "ffn_hidden_size % tp", "tp that divides 6"),
        (dict(vocab_size=10), {}, (4, 1, 1, 1), "vocab_size % tp", "Pad vocab_size"),
        ({}, dict(global_batch_size=3), (1, 1, 1, 2), "global_batch_size % (micro_batch_size*dp)", "multiple of 2"),
    ],
)
def test_each_constraint_names_itself_and_the_fix(model, training, sizes, name, fix):
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=8, seq_length=1024, vocab_size=512, ffn_hidden_size=256)
    spec, train = ModelSpec(**{**base, **model}), TrainingSpec(**training)
    found = violations(spec, train, *sizes)
    assert [n for n, _ in found] == [name]
    assert name in found[0][1] and fix in found[0][1]
    tp, cp, pp, dp = sizes
    with pytest.raises(ModelConstraintError, match="fails") as err:
        check(spec, train, Layout(world_size=tp * cp * pp * dp, tp=tp, cp=cp, pp=pp))
    assert err.value.constraint == name and isinstance(err.value, ValueError)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        (dict(num_layers=0), "num_layers=0 is invalid"),
        (dict(hidden_size=True), "hidden_size=True is invalid"),
        (dict(hidden_size=100), "hidden_size=100 is not divisible by num_attention_heads=8"),
        (dict(num_query_groups=3), "num_query_groups=3 does not divide num_attention_heads=8"),
        (dict(num_query_groups=16), "num_query_groups=16 does not divide"),
        (dict(vocab_size=-1), "vocab_size=-1 is invalid"),
    ],
)
def test_model_values_are_validated(kwargs, fragment):
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=8, seq_length=128, vocab_size=512)
    with pytest.raises(ModelError, match=fragment.replace("(", r"\(")):
        ModelSpec(**{**base, **kwargs})


@pytest.mark.parametrize(
    "cls,kwargs,fragment",
    [
        (TrainingSpec, dict(precision="fp8"), "precision='fp8' is invalid: expected one of bf16, fp16, fp32"),
        (TrainingSpec, dict(recompute="some"), "recompute='some' is invalid"),
        (TrainingSpec, dict(micro_batch_size=0), "micro_batch_size=0"),
        (TrainingSpec, dict(sequence_parallel=1), "sequence_parallel=1 is invalid: expected true or false"),
        (ClusterSpec, dict(device_memory_gb=0), "device_memory_gb=0 is invalid"),
        (ClusterSpec, dict(inter_node_gbps=-1), "inter_node_gbps=-1"),
    ],
)
def test_training_and_cluster_values_are_validated(cls, kwargs, fragment):
    with pytest.raises(ModelError, match=fragment):
        cls(**kwargs)


def test_estimate_without_model_says_how_to_add_one():
    with pytest.raises(ModelError, match="--model"):
        estimate(Layout(world_size=2), Workload())


def test_docstring_examples_hold():
    import doctest

    from mindscience.distributed import costmodel
    from mindscience.distributed.costmodel import (calibrate, comm, constraints, devices, memory, params, report,
                                                   runtime, search, spec, steptime)
    from mindscience.distributed.topology import layout

    for module in (costmodel, calibrate, comm, constraints, devices, memory, params, report, runtime, search, spec,
                   steptime, layout):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__


# ------------------------------------------------------------------ C4 architecture options (parameters)
TINY_GPT = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=64,
                     vocab_size=256)
TINY_LLAMA = ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                       seq_length=64, vocab_size=256, normalization="rmsnorm", activation="swiglu",
                       position_embedding="rope", tie_embeddings=False, bias=False)


def test_tiny_presets_parameters_by_hand():
    # tiny-gpt layer: norms 2 x 2*64, qkv 64*192 + 192, out 64*64 + 64, fc1 64*256 + 256, fc2 256*64 + 64.
    layer = 2 * 128 + (64 * 192 + 192) + (64 * 64 + 64) + (64 * 256 + 256) + (256 * 64 + 64)
    assert layer == 49_984
    assert total_parameters(TINY_GPT) == 4 * layer + 256 * 64 + 64 * 64 + 128 == 220_544
    # tiny-llama layer: norms 2 x 64, qkv 64*(64 + 2*2*16), out 64*64, fc1 64*(2*128) (gate + up), fc2 128*64.
    layer = 2 * 64 + 64 * 128 + 64 * 64 + 64 * 256 + 128 * 64
    assert layer == 36_992
    # embedding 256*64, final norm 64, untied output 256*64, no position table.
    assert total_parameters(TINY_LLAMA) == 4 * layer + 256 * 64 + 64 + 256 * 64 == 180_800
    for name, model in (("tiny-gpt", TINY_GPT), ("tiny-llama", TINY_LLAMA)):
        preset = load_workload(f"layouts/models/{name}.yaml")
        assert total_parameters(preset.model) == total_parameters(model)
        assert (preset.training.micro_batch_size, preset.training.global_batch_size, preset.training.precision,
                preset.training.zero_stage, preset.training.recompute) == (2, 8, "fp32", 0, "none")


@pytest.mark.parametrize("normalization", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("position", ["learned", "rope"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_every_architecture_combination_counts_c4_and_the_model_config(normalization, activation, position, tied,
                                                                        bias):
    h, f, g, d, s, v, l = 48, 96, 2, 12, 40, 120, 3
    model = ModelSpec(num_layers=l, hidden_size=h, num_attention_heads=4, num_query_groups=g, ffn_hidden_size=f,
                      seq_length=s, vocab_size=v, normalization=normalization, activation=activation,
                      position_embedding=position, tie_embeddings=tied, bias=bias)
    # Contract C4, written out term by term.
    norm = 2 * h if normalization == "layernorm" else h
    fc1 = 2 * f if activation == "swiglu" else f
    qkv = h + 2 * g * d
    layer = (2 * norm + h * qkv + h * h + h * fc1 + f * h
             + (qkv + h + fc1 + h if bias else 0))
    total = l * layer + v * h + (s * h if position == "learned" else 0) + norm + (0 if tied else v * h)
    assert total_parameters(model) == total
    from mindscience.distributed.models.config import TransformerConfig

    assert TransformerConfig.from_model_spec(model).num_parameters() == total


def test_stage_parameters_hold_the_untied_head_and_the_tied_copy():
    # pp = 2 on tiny-llama (untied): stage 1 holds 2 layers, the final norm and the V/t x h head.
    layer = 36_992
    assert stage_parameters(TINY_LLAMA, 1, 2, 0) == (2 * (layer - 2 * 64) + 256 * 64, 2 * 2 * 64)
    assert stage_parameters(TINY_LLAMA, 1, 2, 1) == (2 * (layer - 2 * 64) + 256 * 64, 2 * 2 * 64 + 64)
    # pp = 1, tied: no copy (the embedding is the head).
    assert sum(stage_parameters(TINY_GPT, 1, 1, 0)) == 220_544
    # tp = 2: split parts halve, replicated ones (norms, row-parallel biases, positions) stay.
    split, whole = stage_parameters(TINY_GPT, 2, 1, 0)
    assert whole == 4 * (2 * 128 + 2 * 64) + 64 * 64 + 128
    assert 2 * split + whole == 220_544


# ------------------------------------------------------------------ ZeRO stages (contract C2)
def _optimizer_rules(monkeypatch, rules: dict):
    """The cost model's view of the library's pure rules: ``{name: function}``; others missing."""
    import mindscience.distributed.costmodel.runtime as rt

    monkeypatch.setattr(rt, "_rule", lambda module, name: rules.get(name))


FP32_OWN_SHARD = {"main_weight_bytes": lambda param_bytes, zero_stage: 0 if param_bytes == 4 else 4}


@pytest.mark.parametrize("precision,library,expected", [
    ("bf16", None, [(2, 4, 12), (2, 4, 12 / 4), (2, 4 / 4, 12 / 4), (2 / 4, 4 / 4, 12 / 4)]),
    ("bf16", FP32_OWN_SHARD, [(2, 4, 12), (2, 4, 12 / 4), (2, 4 / 4, 12 / 4), (2 / 4, 4 / 4, 12 / 4)]),
    # Before part 4 of issue 37 (the fallback): fp32 models keep a second fp32 copy at stages 1-3.
    ("fp32", None, [(4, 4, 8), (4, 4, 12 / 4), (4, 4 / 4, 12 / 4), (4 / 4, 4 / 4, 12 / 4)]),
    # optimizer.overlap_rules.main_weight_bytes: fp32 parameters are their own main weights.
    ("fp32", FP32_OWN_SHARD, [(4, 4, 8), (4, 4, 8 / 4), (4, 4 / 4, 8 / 4), (4 / 4, 4 / 4, 8 / 4)]),
])
def test_bytes_per_parameter_of_every_zero_stage(monkeypatch, precision, library, expected):
    # d = dp * cp = 4 and every dim 0 of this model divides by 4: no padding, so the bytes are P x C2's figures.
    _optimizer_rules(monkeypatch, library or {})
    model = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64, vocab_size=256)
    params = total_parameters(model)
    for z, (w, g, o) in enumerate(expected):
        assert bytes_per_parameter(precision, z, 4) == {"weights": w, "gradients": g, "optimizer": o}
        row = stage_rows(model, TrainingSpec(precision=precision, zero_stage=z, global_batch_size=8), 1, 2, 1, 2)[0]
        assert row["parameters"] == params and row["zero_stage"] == z
        assert (row["weights_bytes"], row["gradients_bytes"], row["optimizer_bytes"]) == (w * params, g * params,
                                                                                         o * params)
    # C2's totals: bf16 18, 6 + 12/d, 2 + 16/d, 18/d; fp32 16, 8 + 12/d, 4 + 16/d, 20/d (own shard:
    # 8 + 8/d, 4 + 12/d, 16/d).
    totals = [sum(bytes_per_parameter(precision, z, 4).values()) for z in range(4)]
    assert totals == ([18, 9, 6, 4.5] if precision == "bf16" else [16, 11, 8, 5] if library is None else [16, 10, 7, 4])


def test_zero_shards_are_padded_per_parameter(monkeypatch):
    _optimizer_rules(monkeypatch, {})  # the library before part 4: an fp32 main copy at stages 1-3
    # d = 3 on tiny-gpt: a (r, *rest) parameter keeps ceil(r/3) rows. Per layer: norms 4 x 22, qkv 64 x 64,
    # its bias 64, out 22 x 64 and bias 22, fc1 86 x 64 and bias 86, fc2 22 x 256 and bias 22.
    layer = 4 * 22 + 64 * 64 + 64 + 22 * 64 + 22 + 86 * 64 + 86 + 22 * 256 + 22
    assert layer == 16_922
    padded = 4 * layer + 86 * 64 + 22 * 64 + 2 * 22  # + word embedding, positions, final norm
    assert padded == 74_644
    training = TrainingSpec(precision="fp32", zero_stage=3, global_batch_size=6)
    row = stage_rows(TINY_GPT, training, 1, 1, 1, 3)[0]
    assert row["weights_bytes"] == 4 * padded and row["gradients_bytes"] == 4 * padded
    assert row["optimizer_bytes"] == 12 * padded
    _optimizer_rules(monkeypatch, FP32_OWN_SHARD)  # fp32 parameters as their own main weights: moments only
    assert stage_rows(TINY_GPT, training, 1, 1, 1, 3)[0]["optimizer_bytes"] == 8 * padded
    _optimizer_rules(monkeypatch, {})
    # Stage 3 keeps the stage's gathered weights for a micro-batch (fully_shard, no reshard).
    assert row["gathered_bytes"] == 4 * 220_544
    # Stage 1 on the same layout: weights and gradients whole, only the optimizer state padded.
    one = stage_rows(TINY_GPT, replace(training, zero_stage=1), 1, 1, 1, 3)[0]
    assert (one["weights_bytes"], one["gradients_bytes"], one["optimizer_bytes"], one["gathered_bytes"]) == (
        4 * 220_544, 4 * 220_544, 12 * padded, 0)


def test_zero_stage_traffic_by_hand():
    # tiny-gpt fp32 on dp = 2 (every dim 0 is even: no padding), m = 8 / (2 * 2) = 2 micro-batches.
    params, tensors = 220_544, 4 * 12 + 1 + 1 + 2
    base = TrainingSpec(precision="fp32", micro_batch_size=2, global_batch_size=8)

    def dp_rows(z, runtime=None):
        rows = traffic(TINY_GPT, replace(base, zero_stage=z), 1, 1, 1, 2, runtime)
        return {r["op"]: (r["count"], r["bytes"]) for r in rows if r["group"] == "dp-cp"}

    all_reduce = params * 4 * 2 * 1 // 2  # 2(n-1)/n of the fp32 gradients
    assert dp_rows(0) == {"all_reduce": (1, all_reduce)}
    # Stages 1-2: reduce-scatter of fp32 gradients + all-gather of the fp32 weights: the bytes of the all-reduce.
    assert dp_rows(1) == dp_rows(2) == {"reduce_scatter": (1, params * 4 // 2), "all_gather": (1, params * 4 // 2)}
    # Stage 3: per parameter and micro-batch one all-gather (forward) and one reduce-scatter (backward).
    assert dp_rows(3) == {"all_gather": (tensors * 2, 2 * params * 4 // 2),
                          "reduce_scatter": (tensors * 2, 2 * params * 4 // 2)}
    # With the pipeline runtime's re-run forward the weights are gathered twice: 1.5x an all-reduce per
    # micro-batch (Rajbhandari et al. 2020).
    again = zero_traffic(TINY_GPT, replace(base, zero_stage=3), 1, 1, 2, 1, regather=True)
    per_microbatch = sum(r["bytes"] for r in again)
    assert per_microbatch == 3 * params * 4 // 2 == 1.5 * all_reduce


def test_zero3_step_time_exposes_the_gathers():
    unit = ClusterSpec(peak_tflops=1, compute_efficiency=1, intra_node_gbps=1, intra_node_latency_us=10)
    training = TrainingSpec(precision="fp32", micro_batch_size=2, global_batch_size=8, zero_stage=3)
    t = step_time(TINY_GPT, training, unit, 1, 1, 1, 2)
    rows = [r for r in traffic(TINY_GPT, training, 1, 1, 1, 2) if r["group"] == "dp-cp"]
    expected = sum(r["count"] * 10e-6 + r["bytes"] / 1e9 for r in rows)
    assert t["breakdown"]["dp_s"] == pytest.approx(expected)  # overlap_grad_reduce hides nothing at stage 3


# ------------------------------------------------------------------ unequal stages
TOY5 = ModelSpec(num_layers=5, hidden_size=4, num_attention_heads=1, seq_length=8, vocab_size=0)


def test_unequal_stages_memory_and_step_time_by_hand():
    # 5 layers on pp = 2 with first_stage_layers = 2: [2, 3]; one toy layer = 4096 forward FLOPs.
    training = TrainingSpec(first_stage_layers=2, global_batch_size=4, sequence_parallel=False, precision="fp32")
    assert violations(TOY5, training, 1, 1, 2, 1) == []
    rows = stage_rows(TOY5, training, 1, 1, 2, 1)
    assert [r["layers"] for r in rows] == [2, 3]
    layer = sum(layer_parameters(TOY5))
    assert rows[0]["parameters"] == 2 * layer + 8 * 4  # + the learned positions
    assert rows[1]["parameters"] == 3 * layer + 2 * 4  # + the final layernorm
    unit = ClusterSpec(peak_tflops=1, compute_efficiency=1)
    # Korthikanti pricing: the busiest stage is stage 1 (3 layers): slot 3 x 3 x 4096 FLOPs, m = 4.
    t = step_time(TOY5, training, unit, 1, 1, 2, 1)
    assert t["breakdown"]["compute_s"] == pytest.approx(4 * 3 * 3 * 4096 / 1e12)
    # As the library runs it: the stage forwards are kept (no note), the same slot.
    training, runtime, notes = what_runs(training, 1, 1, 2, 1)
    assert runtime == Runtime(stage_recompute=False) and notes == []
    t = step_time(TOY5, training, unit, 1, 1, 2, 1, runtime=runtime)
    assert t["breakdown"]["compute_s"] == pytest.approx(4 * 3 * 3 * 4096 / 1e12)
    # 4 + 1 layers, kept: stage 0's 4 layers x 3 passes decide.
    heavy = replace(training, first_stage_layers=4)
    t = step_time(TOY5, heavy, unit, 1, 1, 2, 1, runtime=runtime)
    assert t["breakdown"]["compute_s"] == pytest.approx(4 * 3 * 4 * 4096 / 1e12)
    # Where the runtime re-runs stage 0's forward (2 layers: 4 x 2 x 4096 = 32,768 < 36,864, no
    # matter); with 4 + 1 the re-run decides: 4 x 4 x 4096.
    rerun = Runtime(stage_recompute=True)
    t = step_time(TOY5, training, unit, 1, 1, 2, 1, runtime=rerun)
    assert t["breakdown"]["compute_s"] == pytest.approx(4 * 3 * 3 * 4096 / 1e12)
    t = step_time(TOY5, heavy, unit, 1, 1, 2, 1, runtime=rerun)
    assert t["breakdown"]["compute_s"] == pytest.approx(4 * 4 * 4 * 4096 / 1e12)
    # A cut that does not work is a constraint naming the options.
    bad = violations(TOY5, TrainingSpec(first_stage_layers=4, last_stage_layers=2), 1, 1, 2, 1)
    assert [n for n, _ in bad] == ["num_layers % pp"] and "first_stage_layers=4" in bad[0][1]
    assert "first_stage_layers" in violations(TOY5, TrainingSpec(), 1, 1, 2, 1)[0][1]


def test_llama3_stage_cut_counts_the_embedding_and_the_loss():
    llama = ModelSpec(num_layers=126, hidden_size=16384, num_attention_heads=128, num_query_groups=8,
                      ffn_hidden_size=53248, seq_length=8192, vocab_size=128256, normalization="rmsnorm",
                      activation="swiglu", position_embedding="rope", tie_embeddings=False, bias=False)
    training = TrainingSpec(zero_stage=3, account_for_embedding_in_pipeline_split=True,
                            account_for_loss_in_pipeline_split=True, global_batch_size=2048)
    rows = stage_rows(llama, training, 8, 1, 16, 64)
    assert [r["layers"] for r in rows] == [7] + [8] * 14 + [7]
    assert violations(llama, TrainingSpec(), 8, 1, 16, 64)[0][0] == "num_layers % pp"  # 126 % 16 evenly: no
    assert violations(llama, training, 8, 1, 16, 64) == []


# ------------------------------------------------------------------ what the library runs (notes)
def test_what_runs_notes_and_prices_the_runtime(monkeypatch):
    _optimizer_rules(monkeypatch, {})  # no overlap or fsdp rules: the library before issue 37's parts 2-3
    training = TrainingSpec(recompute="selective")
    priced, runtime, notes = what_runs(training, tp=2, cp=1, pp=2, dp=2)
    # The pipeline keeps its stage forwards (pipeline.recompute.runtime_recompute): no pp note.
    assert runtime.stage_recompute is False and priced.overlap_grad_reduce is False
    assert not any(n.startswith("pp=") for n in notes)
    # ... compiled too, also with tp collectives in the stage (runtime_recompute(mode="jit")
    # keeps): no compiled-mode pipeline note.
    assert not any(n.startswith("compiled mode:") for n in notes)
    assert not any(n.startswith("compiled mode:") for n in what_runs(training, tp=1, cp=1, pp=2, dp=4)[2])
    assert "priced as not overlapped" in notes[0]
    # pp = 1, dp = 1: nothing differs, no note.
    assert what_runs(training, 1, 1, 1, 1) == (training, Runtime(stage_recompute=False), [])
    # recompute full on pp = 2: the model recomputes each layer inside kept stage forwards
    # (model_request), the runtime re-runs nothing more.
    assert what_runs(TrainingSpec(recompute="full"), 1, 1, 2, 1) == (
        TrainingSpec(recompute="full"), Runtime(stage_recompute=False), [])
    # ZeRO-3 says how fully_shard gathers; overlap is irrelevant there.
    notes = what_runs(TrainingSpec(zero_stage=3), 1, 1, 1, 4)[2]
    assert len(notes) == 1 and notes[0].startswith("zero_stage 3: fully_shard all-gathers every parameter")


def _rules_of_issue_37():
    """The contract's rules as issue 37 describes the library after parts 2-4 (PyNative overlaps, jit not)."""
    def grad(mode, zero_stage, pp=1):
        if zero_stage == 3:
            return False, "fully_shard reduce-scatters in its backward"
        return (True, "launched from a gradient hook") if mode == "pynative" or pp > 1 else \
            (False, "a compiled backward runs its hooks after the graph")

    def fsdp(mode, reshard_after_forward=True, prefetch=True):
        if mode == "pynative":
            return {"reshard_after_forward": reshard_after_forward, "prefetch": prefetch,
                    "gathers_per_unit": 2 if reshard_after_forward else 1,
                    "units_alive": (2 if prefetch else 1) if reshard_after_forward else None, "reason": None}
        return {"reshard_after_forward": False, "prefetch": False, "gathers_per_unit": 1, "units_alive": None,
                "reason": "compiled code gathers each parameter inside the graph"}

    return {"grad_reduce_overlap": grad, "param_gather_overlap": lambda mode, z: (False, "gathered in the step"),
            "main_weight_bytes": FP32_OWN_SHARD["main_weight_bytes"], "fsdp_runtime": fsdp}


def test_what_runs_gives_no_overlap_note_where_the_library_overlaps(monkeypatch):
    _optimizer_rules(monkeypatch, _rules_of_issue_37())
    training = TrainingSpec(recompute="selective")
    priced, runtime, notes = what_runs(training, tp=1, cp=1, pp=1, dp=4)
    # PyNative overlaps the reduction: priced overlapped, and only the compiled mode's difference is said.
    assert priced.overlap_grad_reduce is True
    assert [n.split(":")[0] for n in notes] == ["compiled mode"] and "a compiled backward" in notes[0]
    # In the pipeline both modes overlap (after each chunk's last backward): no overlap note at all.
    assert not any("overlap" in n for n in what_runs(training, 1, 1, 2, 4)[2])
    # Asked in compiled mode (msdist train --mode jit): not overlapped there, said so.
    priced, _, notes = what_runs(training, 1, 1, 1, 4, mode="jit")
    assert priced.overlap_grad_reduce is False and notes[0].startswith("training.overlap_grad_reduce: a compiled")
    # overlap_param_gather is not run by this library yet: priced exposed, with a note at stages 1-2 only.
    priced, _, notes = what_runs(TrainingSpec(zero_stage=1, overlap_param_gather=True), 1, 1, 1, 4)
    assert priced.overlap_param_gather is False
    assert "training.overlap_param_gather: gathered in the step; priced as not overlapped." in notes
    # FSDP in PyNative: per-unit buckets, resharded (2 gathers), 2 units alive, prefetched: no note.
    priced, runtime, notes = what_runs(TrainingSpec(zero_stage=3), 1, 1, 1, 4)
    assert notes == [] and (priced.reshard_after_forward, priced.fsdp_prefetch) == (True, True)
    assert runtime == Runtime(stage_recompute=False, fsdp_units=True, fsdp_gathers_per_unit=2, fsdp_units_alive=2)
    # Compiled: per parameter, kept, with the library's reason.
    priced, runtime, notes = what_runs(TrainingSpec(zero_stage=3), 1, 1, 1, 4, mode="jit")
    assert runtime == Runtime() and not priced.reshard_after_forward
    assert notes == ["zero_stage 3: compiled code gathers each parameter inside the graph; priced so."]


def test_overlapped_reduction_shrinks_the_exposed_dp_time(monkeypatch):
    # tiny-gpt at dp4, one micro-batch of 2, on 1 TFLOP/s, 1 GB/s, 10 us: the all-reduce (2 x 3/4 x 4 bytes x
    # 220,544 parameters = 1.32 ms + 10 us) against the backward (2 x forward FLOPs at 1 TFLOP/s).
    training = TrainingSpec(micro_batch_size=2, global_batch_size=8, precision="fp32")
    unit = ClusterSpec(peak_tflops=1, compute_efficiency=1, intra_node_gbps=1, intra_node_latency_us=10)
    _optimizer_rules(monkeypatch, {})
    priced, runtime, _ = what_runs(training, 1, 1, 1, 4)
    exposed = step_time(TINY_GPT, priced, unit, 1, 1, 1, 4, runtime=runtime)
    reduce_s = 10e-6 + 2 * 3 / 4 * 4 * 220_544 / 1e9
    assert exposed["breakdown"]["dp_s"] == pytest.approx(reduce_s) == exposed["dp_reduce_s"]
    _optimizer_rules(monkeypatch, _rules_of_issue_37())
    priced, runtime, _ = what_runs(training, 1, 1, 1, 4)
    hidden = step_time(TINY_GPT, priced, unit, 1, 1, 1, 4, runtime=runtime)
    backward = stage_slot_flops(TINY_GPT, priced, 1, 1, 1)["backward"] / 1e12
    assert hidden["breakdown"]["dp_s"] == pytest.approx(reduce_s - backward)
    assert hidden["step_time_s"] == pytest.approx(exposed["step_time_s"] - backward)


def test_fsdp_units_gather_per_layer_and_keep_units_alive(monkeypatch):
    # tiny-gpt at dp3, fp32, ZeRO-3: 4 layer units of 49,984 parameters, the root (embeddings, final norm)
    # 16,384 + 4,096 + 128.
    training = TrainingSpec(micro_batch_size=2, global_batch_size=6, precision="fp32", zero_stage=3)
    _optimizer_rules(monkeypatch, {})
    priced, runtime, _ = what_runs(training, 1, 1, 1, 3)
    kept = stage_rows(TINY_GPT, priced, 1, 1, 1, 3, runtime=runtime)[0]
    per_param = {r["op"]: r for r in traffic(TINY_GPT, priced, 1, 1, 1, 3, runtime)}
    assert kept["gathered_bytes"] == 4 * 220_544 and per_param["all_gather"]["count"] == 52
    _optimizer_rules(monkeypatch, _rules_of_issue_37())
    priced, runtime, _ = what_runs(training, 1, 1, 1, 3)
    layer = 49_984
    assert 4 * layer + 16_384 + 4_096 + 128 == 220_544
    row = stage_rows(TINY_GPT, priced, 1, 1, 1, 3, runtime=runtime)[0]
    # Two layer units alive (units_alive) and the root, not the stage's four layers.
    assert row["gathered_bytes"] == 4 * (2 * layer + 20_608)
    rows = {r["op"]: r for r in traffic(TINY_GPT, priced, 1, 1, 1, 3, runtime)}
    # One bucket per unit: the 4 leaves twice (forward, backward after the reshard), the root once; one
    # reduce-scatter per unit; the bytes: padded shards x 3 of the leaves twice and the root once.
    assert rows["all_gather"]["count"] == 4 * 2 + 1 and rows["reduce_scatter"]["count"] == 5
    assert rows["all_gather"]["bytes"] > per_param["all_gather"]["bytes"]
    # units_alive 1 without prefetch.
    one = stage_rows(TINY_GPT, replace(priced, fsdp_prefetch=False), 1, 1, 1, 3,
                     runtime=what_runs(replace(training, fsdp_prefetch=False), 1, 1, 1, 3)[1])[0]
    assert one["gathered_bytes"] == 4 * (layer + 20_608)


def test_estimate_prices_the_pipeline_runtime_and_reports_notes():
    # GPT-3 tp8 x pp8 x 1F1B + selective (Korthikanti et al.): the runtime keeps each in-flight
    # micro-batch's stage forward, so stage 0 holds p = 8 micro-batches of its 12 layers (34/t sbh
    # each: 96 layer-activations, Korthikanti's 34 sbhL/t), their 8 embeddings (token ids and the
    # dropout mask) and the recomputed scores of one layer.
    training = TrainingSpec(global_batch_size=1536, recompute="selective")
    layout = Layout(world_size=64, tp=8, pp=8, devices_per_node=8)
    report = estimate(layout, Workload(model=GPT3, training=training))
    first = report["memory"]["stages"][0]
    layer, scores = 106_954_752, 4 * A * S * S // 8
    assert first["activations_bytes"] == 96 * layer + 8 * (8 * S + SBH // 8) + scores
    last = report["memory"]["stages"][7]
    # The last stage: one micro-batch in flight, its 12 layers, the scores, the output layer's inputs.
    assert last["activations_bytes"] == 12 * layer + scores + 4 * SBH // 8 * (1 + Fraction(V, H))
    assert report["model"]["runtime"] == {"stage_recompute": False, "fsdp_units": False, "fsdp_gathers_per_unit": 1,
                                          "fsdp_units_alive": None}
    assert report["model"]["priced_training"]["recompute"] == "selective"
    assert not any(n.startswith("pp=") for n in report["notes"])
    # Compute: a kept stage runs 3 passes of its 12 layers (+ the selective scores); the last adds the
    # logits and is the busiest. Where the runtime re-runs (Runtime(stage_recompute=True)), stages 0-6
    # run 4 passes and are busier (the later one on the tie).
    kept = stage_slot_flops(GPT3, training, 8, 1, 8, Runtime(stage_recompute=False))
    assert kept["stage"] == 7
    assert report["time"]["slot_s"] * 150e12 == pytest.approx(kept["total"])
    slot = stage_slot_flops(GPT3, training, 8, 1, 8, Runtime(stage_recompute=True))
    layer = 24 * S * H * H + 4 * S * S * H
    assert slot["stage"] == 6
    assert slot["total"] == pytest.approx((4 * 12 * layer + 12 * 4 * S * S * H) / 8)  # + selective scores
    assert kept["total"] < slot["total"]


# ------------------------------------------------------------------ against the library's own Parameters
@pytest.mark.parametrize("preset", ["tiny-gpt", "tiny-llama"])
def test_bytes_equal_distributed_optimizer_memory_bytes(preset):
    """The cost model's weights/gradients/optimizer bytes are what DistributedOptimizer.memory_bytes()
    counts from the Parameters GPTModel builds (one process, d = 1: every C4 parameter, the fp32 main
    weights rule of each precision and stage). The padded d > 1 shards are checked against contract C1
    above (test_zero_shards_are_padded_per_parameter)."""
    from mindscience.distributed.models import GPTModel, TransformerConfig
    from mindscience.distributed.optimizer import DistributedOptimizer

    workload = load_workload(f"layouts/models/{preset}.yaml")
    for precision in ("fp32", "bf16"):
        for z in (0, 1, 2):  # one model per optimizer: a Parameter belongs to one DistributedOptimizer
            net = GPTModel(TransformerConfig.from_model_spec(preset, precision=precision), seed=0, parallel=False)
            assert sum(int(np.prod(p.shape)) for p in net.trainable_params()) == total_parameters(workload.model)
            got = DistributedOptimizer(net.trainable_params(), zero_stage=z).memory_bytes()
            row = stage_rows(workload.model, replace(workload.training, precision=precision, zero_stage=z),
                             1, 1, 1, 1)[0]
            assert got == {k: row[f"{k}_bytes"] for k in ("weights", "gradients", "optimizer")}, (precision, z)


def test_overlap_param_gather_is_priced_as_the_library_runs_it():
    """The library's own rule (optimizer.overlap_rules): PyNative at stages 1-2 launches the
    weights' gathers for the next forward (priced overlapped, a note for compiled mode);
    compiled it gathers in the step (priced exposed, said so); stage 0 and one rank: nothing."""
    priced, _, notes = what_runs(TrainingSpec(zero_stage=1, overlap_param_gather=True), 1, 1, 1, 4)
    assert priced.overlap_param_gather is True
    said = [n for n in notes if "all-gather" in n]
    assert len(said) == 1 and said[0].startswith("compiled mode: the updated weights' all-gather is priced "
                                                 "overlapped with the next forward")
    priced, _, notes = what_runs(TrainingSpec(zero_stage=2, overlap_param_gather=True), 1, 1, 1, 4, mode="jit")
    assert priced.overlap_param_gather is False
    assert any(n.startswith("training.overlap_param_gather: compiled: the updated weights' all-gather is part "
                            "of the step's graph") for n in notes), notes
    for z, dp in ((0, 4), (1, 1)):
        priced, _, notes = what_runs(TrainingSpec(zero_stage=z, overlap_param_gather=True), 1, 1, 1, dp)
        assert priced.overlap_param_gather is False and not any("overlap_param_gather" in n for n in notes)
