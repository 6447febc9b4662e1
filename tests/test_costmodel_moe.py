"""The cost model of mixture-of-experts models (issue 36): keys, counts, memory, traffic, suggest, plan.

Pure arithmetic (no MindSpore): values are checked against hand counts and the published
parameter totals of the bundled presets.
"""

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from mindscience.distributed.costmodel.runtime import main_weight_bytes
from mindscience.distributed.costmodel import ModelConstraintError, ModelError, estimate, load_workload
from mindscience.distributed.costmodel.comm import send_factor, traffic
from mindscience.distributed.costmodel.constraints import violations
from mindscience.distributed.costmodel.memory import stage_rows
from mindscience.distributed.costmodel.params import (active_parameters, expert_parameters, rank_moe_layers,
                                                      total_parameters)
from mindscience.distributed.costmodel.search import expert_choices, suggest
from mindscience.distributed.costmodel.spec import ModelSpec, TrainingSpec, Workload
from mindscience.distributed.costmodel.steptime import model_flops_per_sample, stage_slot_flops
from mindscience.distributed.models.config import TransformerConfig
from mindscience.distributed.topology import Layout, load_layout
from mscli.layouts import bundled_models
from mscli.main import app
from test_cli_plan import assert_bad_input, write

runner = CliRunner()
MOE_PRESETS = ("tiny-moe", "mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3")


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def preset(name):
    return load_workload(bundled_models()[name])


def tiny(**keys):
    """tiny-moe's shape with changes (4 layers, h 64, 4 heads / 2 groups, 8 SwiGLU experts of 64)."""
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
                seq_length=64, vocab_size=256, normalization="rmsnorm", activation="swiglu",
                position_embedding="rope", tie_embeddings=False, bias=False, num_moe_experts=8,
                moe_router_topk=2, moe_ffn_hidden_size=64)
    return ModelSpec(**{**base, **keys})


# ------------------------------------------------------------------ parameter counts
def hand_count(h, layers, heads, groups, vocab, experts, topk, fe, shared=0, dense_layers=0, dense_ffn=0):
    """Untied, no biases, RMSNorm, SwiGLU, RoPE: per layer attention h*(h + 2 g d) + h*h, 2 norms."""
    d = h // heads
    attention = h * (h + 2 * groups * d) + h * h + 2 * h
    expert = 3 * h * fe
    moe_layer = attention + experts * h + experts * expert + (3 * h * shared if shared else 0)
    active_layer = attention + experts * h + topk * expert + (3 * h * shared if shared else 0)
    dense_layer = attention + 3 * h * dense_ffn
    edges = 2 * vocab * h + h
    moe = layers - dense_layers
    return (moe * moe_layer + dense_layers * dense_layer + edges,
            moe * active_layer + dense_layers * dense_layer + edges)


@pytest.mark.parametrize("name,hand,published,total_tol,active_tol", [
    # Exact shapes: within 0.3 % of the model cards' rounded totals.
    ("mixtral-8x7b", dict(h=4096, layers=32, heads=32, groups=8, vocab=32000, experts=8, topk=2, fe=14336),
     (46.7e9, 12.9e9), 0.003, 0.003),
    # 64-channel heads instead of 128 (not expressible): -0.45B attention, 1.4 % / 12 % under.
    ("qwen3-30b-a3b", dict(h=2048, layers=48, heads=32, groups=4, vocab=151936, experts=128, topk=8, fe=768),
     (30.5e9, 3.3e9), 0.02, 0.13),
    # MLA priced as 4h^2 attention (+18.5M a layer) and no MTP module: +0.2 % total, +4.5 % active
    # (the report's 37B; the released checkpoint's card says 36.6B active without the head's 0.9B twice).
    ("deepseek-v3", dict(h=7168, layers=61, heads=128, groups=128, vocab=129280, experts=256, topk=8, fe=2048,
                         shared=2048, dense_layers=3, dense_ffn=18432),
     (671e9, 37e9), 0.002, 0.05),
])
def test_preset_parameters_match_hand_counts_and_published_totals(name, hand, published, total_tol, active_tol):
    model = preset(name).model
    total, active = hand_count(**hand)
    assert (total_parameters(model), active_parameters(model)) == (total, active)
    assert abs(total / published[0] - 1) <= total_tol
    assert abs(active / published[1] - 1) <= active_tol
    assert TransformerConfig.from_model_spec(name).num_parameters() == total


def test_published_totals_exact_figures():
    # The figures the docs quote (docs/COST_MODEL.md, "Mixture of experts").
    assert total_parameters(preset("mixtral-8x7b").model) == 46_702_792_704
    assert active_parameters(preset("mixtral-8x7b").model) == 12_879_925_248
    assert total_parameters(preset("qwen3-30b-a3b").model) == 30_079_125_504
    assert total_parameters(preset("deepseek-v3").model) == 672_149_632_000
    assert active_parameters(preset("deepseek-v3").model) == 38_675_510_272


def test_tiny_moe_by_hand_and_config_equals_cost_model():
    # A layer: 2 norms 128, qkv 64*(64+2*2*16) = 8192, out 4096, router 8*64 = 512,
    # experts 8 * (64*128 + 64*64) = 98,304: 111,232; x4 + embedding and output 2*256*64 + norm 64.
    assert total_parameters(preset("tiny-moe").model) == 4 * 111_232 + 32_768 + 64 == 477_760
    assert active_parameters(preset("tiny-moe").model) == 477_760 - 4 * 6 * 12_288
    cfg = TransformerConfig.from_model_spec("tiny-moe")
    assert cfg.num_parameters() == 477_760 and cfg.expert_parameters() == 98_304
    # Shared experts with biases, a 0/1 pattern, GELU: the config and the cost model agree.
    for keys in (dict(moe_shared_expert_intermediate_size=32, bias=True, activation="gelu",
                      normalization="layernorm", moe_layer_freq=[0, 1, 0, 1]),
                 dict(moe_layer_freq=2, tie_embeddings=True, position_embedding="learned")):
        m = tiny(**keys)
        assert TransformerConfig.from_model_spec(m).num_parameters() == total_parameters(m)
    m = tiny(moe_shared_expert_intermediate_size=32, bias=True, activation="gelu", moe_layer_freq=[0, 1, 0, 1])
    dense_layer = TransformerConfig.from_model_spec(m).layer_parameters()
    moe_layer = TransformerConfig.from_model_spec(m).layer_parameters(moe=True)
    # Dense MLP gelu f=64 with biases: 64*64+64 + 64*64+64; MoE: router 512 + experts 8*(64*64*2)
    # + shared MLP gelu 32 without biases (moe.SharedExperts has none) 64*32 + 32*64.
    assert moe_layer - dense_layer == 512 + 8 * 2 * 64 * 64 + 2 * 64 * 32 - (2 * 64 * 64 + 128)


def test_is_moe_layer_patterns():
    ds = TransformerConfig.from_model_spec("deepseek-v3")
    assert [ds.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]
    assert sum(ds.is_moe_layer(i) for i in range(61)) == 58 == preset("deepseek-v3").model.num_moe_layers
    assert tiny(moe_layer_freq=2).moe_layers == (True, False, True, False)
    assert not TransformerConfig.from_model_spec("tiny-gpt").is_moe
    with pytest.raises(ModelError, match="layer index 4 is out of range"):
        TransformerConfig.from_model_spec("tiny-moe").is_moe_layer(4)
    # MoE layers per pipeline rank follow the stage cut: deepseek-v3's dense layers are on rank 0.
    training = TrainingSpec(last_stage_layers=1)
    assert rank_moe_layers(preset("deepseek-v3").model, training, 16) == [1] + [4] * 14 + [1]


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("keys,fragment", [
    (dict(moe_router_topk=9), "moe_router_topk=9 is invalid: a token cannot use more experts than num_moe_experts=8"),
    (dict(moe_router_num_groups=3, moe_router_group_topk=1), "moe_router_num_groups=3 does not divide num_moe_experts=8"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=5), "moe_router_group_topk=5 is invalid"),
    (dict(moe_router_num_groups=4, moe_router_group_topk=1, moe_router_topk=3), "exceeds the experts of the"),
    (dict(moe_router_num_groups=4), "moe_router_num_groups is set without moe_router_group_topk"),
    (dict(moe_expert_capacity_factor=0), "moe_expert_capacity_factor=0 is invalid: expected a number > 0"),
    (dict(moe_expert_capacity_factor=-1.5), "moe_expert_capacity_factor=-1.5 is invalid"),
    (dict(moe_router_score_function="tanh"), "moe_router_score_function='tanh' is invalid: expected one of softmax, sigmoid"),
    (dict(moe_token_dispatcher_type="flex"), "moe_token_dispatcher_type='flex' is invalid"),
    (dict(moe_router_load_balancing_type="sinkhorn"), "moe_router_load_balancing_type='sinkhorn' is invalid"),
    (dict(moe_expert_drop_policy="random"), "moe_expert_drop_policy='random' is invalid"),
    (dict(moe_layer_freq=[1, 1]), "moe_layer_freq=[1, 1] is invalid: expected one 0 (dense) or 1 (MoE) per layer, 4"),
    (dict(moe_layer_freq=[0, 0, 0, 0]), "makes no layer a MoE layer"),
    (dict(moe_layer_freq=0), "moe_layer_freq=0 is invalid"),
    (dict(num_moe_experts=0), "num_moe_experts=0 is invalid"),
    (dict(moe_aux_loss_coeff=-0.1), "moe_aux_loss_coeff=-0.1 is invalid"),
    (dict(moe_pad_expert_input_to_capacity=True), "needs moe_expert_capacity_factor"),
    (dict(num_moe_experts=None, moe_ffn_hidden_size=None, moe_shared_expert_intermediate_size=16),
     "needs a mixture-of-experts model: set num_moe_experts"),
])
def test_bad_moe_keys_raise_typed_errors(keys, fragment):
    with pytest.raises(ModelError) as err:
        tiny(**keys)
    assert fragment in str(err.value)
    with pytest.raises(ModelError):  # the same checks in TransformerConfig (before any collective)
        TransformerConfig.from_model_spec("tiny-moe", **keys)


def test_training_moe_imbalance_is_validated():
    with pytest.raises(ModelError, match=r"moe_imbalance=0.5 is invalid: expected a number >= 1"):
        TrainingSpec(moe_imbalance=0.5)


@pytest.mark.parametrize("ep,etp,constraint,fragment", [
    (3, 1, "num_moe_experts % ep", "num_moe_experts=8 is not divisible by ep=3"),
    (2, 3, "moe_ffn_hidden_size % etp", "moe_ffn_hidden_size=64 is not divisible by etp=3"),
])
def test_check_layout_names_the_expert_constraint(ep, etp, constraint, fragment):
    cfg = TransformerConfig.from_model_spec("tiny-moe")
    with pytest.raises(ModelConstraintError) as err:
        cfg.check_layout(tp=1, ep=ep, etp=etp)
    assert err.value.constraint == constraint and fragment in str(err.value)
    assert cfg.check_layout(tp=2, ep=4) == [4] and cfg.check_layout(tp=2, ep=8, etp=1) == [4]
    with pytest.raises(ModelConstraintError, match="the model is dense"):
        TransformerConfig.from_model_spec("tiny-llama").check_layout(ep=2)


def test_violations_list_the_expert_rules():
    m = tiny(moe_shared_expert_intermediate_size=5)
    names = [n for n, _ in violations(m, TrainingSpec(), 2, 1, 1, 2, ep=3, etp=5)]
    assert names == ["num_moe_experts % ep", "moe_ffn_hidden_size % etp",
                     "moe_shared_expert_intermediate_size % tp", "world % (etp*ep*pp)"]
    assert violations(tiny(), TrainingSpec(), 2, 1, 1, 4, ep=4, etp=1) == []


def test_model_file_errors_exit_2_with_the_key(tmp_path):
    text = (bundled_models()["tiny-moe"].read_text().replace("moe_router_topk: 2", "moe_router_topk: 16"))
    path = write(tmp_path, text, "moe.yaml")
    assert_bad_input(invoke("plan", "cpu-4", "--model", path), path, "model.moe_router_topk=16 is invalid")
    text = bundled_models()["tiny-moe"].read_text().replace("moe_layer_freq: 1", "moe_layer_freq: every")
    path = write(tmp_path, text, "moe2.yaml")
    assert_bad_input(invoke("suggest", "--model", path, "--world", 8), "key 'model.moe_layer_freq'",
                     "list of 0/1 per layer")


# ------------------------------------------------------------------ memory, traffic, FLOPs
def test_memory_per_rank_experts_sharded_over_ep_etp_and_edp():
    # tiny-moe, fp32, tp2 x dp4 (8 ranks) with ep4 etp1: edp = 8/4 = 2; each rank holds 2 experts
    # per layer: 4 layers x 2 x (64*128 + 64*64) = 98,304 expert parameters.
    w = preset("tiny-moe")
    t1 = replace(w.training, zero_stage=1)
    rows = stage_rows(w.model, t1, 2, 1, 1, 4, 0, None, ep=4, etp=1)
    row = rows[0]
    assert row["expert_parameters"] == 98_304 and row["moe_layers"] == 4
    # Stage 1: weights 4 B and gradients 4 B whole, optimizer / edp = 2: Adam 8, no fp32 main copy of fp32
    # weights (optimizer.overlap_rules.main_weight_bytes; 4 more without that rule).
    main = main_weight_bytes(4, 1)
    assert main in (0, 4) and row["expert_bytes"] == 98_304 * (4 + 4 + (8 + main) / 2)
    dense = stage_rows(w.model, t1, 2, 1, 1, 4, 0, None, ep=1, etp=2)[0]
    # Same dense part; ep1 etp2: 8 experts of width 32 on every rank, optimizer over edp 4.
    assert dense["expert_parameters"] == 4 * 8 * (64 * 64 + 32 * 64)
    assert dense["expert_bytes"] == dense["expert_parameters"] * (4 + 4 + (8 + main) / 4)
    assert row["parameters"] - row["expert_parameters"] == dense["parameters"] - dense["expert_parameters"]
    # Adding experts to a rank's weights/grads/optimizer: the dense rows plus expert_bytes.
    assert row["weights_bytes"] + row["gradients_bytes"] + row["optimizer_bytes"] == (
        dense["weights_bytes"] + dense["gradients_bytes"] + dense["optimizer_bytes"]
        - dense["expert_bytes"] + row["expert_bytes"])


def test_dispatched_token_activations_and_imbalance():
    w = preset("tiny-moe")
    base = stage_rows(w.model, w.training, 1, 1, 1, 1, 0, None, ep=1, etp=1)[0]
    busy = stage_rows(w.model, replace(w.training, moe_imbalance=1.5), 1, 1, 1, 1, 0, None)[0]
    # Per MoE layer and micro-batch the experts keep R (2h + F_e + f_e) fp32 values, R = s*b*topk:
    # 64*2*2 = 256 rows of 2*64 + 128 + 64 = 320 values; x1.5 more on the busiest rank, 4 layers.
    assert busy["activations_bytes"] - base["activations_bytes"] == 4 * 0.5 * 256 * 320 * 4


def test_all_to_all_bytes_and_etp_rows():
    w = preset("tiny-moe")
    rows = traffic(w.model, w.training, 2, 1, 1, 4, ep=4, etp=1)
    a2a = [r for r in rows if r["group"] == "ep"]
    # tokens*topk*hidden*bytes: (64 * 2 / tp 2) * 2 * 64 * 4 = 32 KiB; 4 per MoE layer, 4 layers,
    # 1 micro-batch (8 samples / (2 x dp 4)); sent (ep-1)/ep of it.
    assert [(r["op"], r["group_size"], r["count"], r["message_bytes"]) for r in a2a] == [
        ("all_to_all", 4, 16, 32_768)]
    assert a2a[0]["bytes"] == 16 * 32_768 * send_factor("all_to_all", 4) == 393_216
    edp = [r for r in rows if r["group"] == "edp"]
    assert [(r["op"], r["group_size"], r["message_bytes"]) for r in edp] == [("all_reduce", 2, 98_304 * 4)]
    rows = traffic(w.model, w.training, 2, 1, 1, 4, ep=2, etp=2)
    etp = {r["op"]: r for r in rows if r["group"] == "etp"}
    assert set(etp) == {"all_gather", "reduce_scatter"}
    assert etp["all_gather"]["count"] == 8 and etp["all_gather"]["message_bytes"] == 2 * 32_768
    assert [r["count"] for r in rows if r["group"] == "ep"] == [16]
    assert not [r for r in traffic(w.model, w.training, 1, 1, 1, 8, ep=1, etp=1) if r["group"] in ("ep", "etp")]


def test_all_to_all_across_nodes_is_priced_on_the_inter_node_link():
    w = preset("tiny-moe")
    inside = estimate(Layout(world_size=8, tp=2, ep=4, etp=1, devices_per_node=4), w)
    across = estimate(Layout(world_size=8, tp=2, ep=8, etp=1, devices_per_node=4), w)
    assert [r["crosses_nodes"] for r in inside["communication"]["per_step"] if r["group"] == "ep"] == [False]
    assert [r["crosses_nodes"] for r in across["communication"]["per_step"] if r["group"] == "ep"] == [True]
    row = [r for r in across["communication"]["per_step"] if r["group"] == "ep"][0]
    assert row["est_time_s"] == pytest.approx(row["bytes"] / (w.cluster.inter_node_gbps * 1e9))
    assert across["time"]["breakdown"]["ep_s"] > inside["time"]["breakdown"]["ep_s"]


def test_flops_count_topk_routed_and_shared_experts():
    m = tiny(moe_shared_expert_intermediate_size=32)
    s, h = 64, 64
    attention_linear = 2 * s * h * (h + 2 * 2 * 16) + 2 * s * h * h
    layer = attention_linear + 2 * s * h * 8 + 2 * s * h * (64 + 32) + 2 * 2 * s * h * (128 + 64)
    assert model_flops_per_sample(m) == 3 * (4 * (layer + 4 * s * s * h) + 2 * s * h * 256)
    training = TrainingSpec(micro_batch_size=1, precision="fp32")
    even = stage_slot_flops(m, training, 1, 1, 1)["forward"]
    busy = stage_slot_flops(m, replace(training, moe_imbalance=2.0), 1, 1, 1)["forward"]
    assert busy - even == 4 * 2 * 2 * s * h * (128 + 64)  # one more top-2 of expert work per layer


# ------------------------------------------------------------------ suggest and plan
def test_expert_choices_respect_divisors_world_and_fix():
    m = tiny()
    assert expert_choices(m, 2, 2, 8, {}) == [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1)]
    assert expert_choices(m, 2, 1, 8, {"ep": 8}) == [(8, 1)]
    assert expert_choices(m, 2, 1, 8, {"etp": 2}) == [(1, 2), (2, 2), (4, 2)]
    assert expert_choices(preset("tiny-llama").model, 2, 1, 8, {}) == [(1, 2)]


def test_suggest_searches_ep_and_etp_and_agrees_with_plan():
    w = preset("mixtral-8x7b")
    data = suggest(w, 64, 8, top=1000)
    assert data["moe"] is True and data["candidates"]
    seen = {(c["ep"], c["etp"]) for c in data["candidates"]}
    assert {(1, 1), (8, 1)} <= seen and any(etp > 1 for _, etp in seen)  # the search tries them all
    for c in data["candidates"][:4]:
        assert c["edp"] == 64 // (c["etp"] * c["ep"] * c["pp"])
        layout = Layout(world_size=64, tp=c["tp"], cp=c["cp"], pp=c["pp"], order=c["order"], devices_per_node=8,
                        ep=c["ep"], etp=c["etp"])
        same = estimate(layout, w)
        assert c["peak_bytes"] == same["memory"]["peak_bytes"]
        assert c["step_time_s"] == pytest.approx(same["time"]["step_time_s"])
        assert c["breakdown"] == pytest.approx(same["time"]["breakdown"])
        assert sum(c["breakdown"].values()) == pytest.approx(c["step_time_s"])
        # Each size keeps its fastest (ep, etp).
        others = [estimate(Layout(world_size=64, tp=c["tp"], cp=c["cp"], pp=c["pp"], order=c["order"],
                                  devices_per_node=8, ep=ep, etp=etp), w)["time"]["step_time_s"]
                  for ep, etp in expert_choices(w.model, c["tp"], c["pp"], 64, {})
                  if not violations(w.model, w.training, c["tp"], c["cp"], c["pp"], c["dp"], ep, etp)]
        assert c["step_time_s"] == pytest.approx(min(others))


def test_suggest_cli_fix_ep_columns_json_and_write(tmp_path):
    result = invoke("suggest", "-m", "tiny-moe", "-w", 8, "--fix", "ep=8", "--top", 100, "--format", "json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["candidates"] and {c["ep"] for c in data["candidates"]} == {8}
    assert all({"ep", "etp", "edp"} <= set(c) for c in data["candidates"])
    table = invoke("suggest", "-m", "tiny-moe", "-w", 8, "--fix", "ep=4,etp=1")
    assert table.exit_code == 0 and " ep " in table.stdout.splitlines()[1] and "etp" in table.stdout
    dense = json.loads(invoke("suggest", "-m", "tiny-llama", "-w", 8, "--format", "json").stdout)
    assert dense["moe"] is False and all(c["ep"] == 1 and c["etp"] == c["tp"] for c in dense["candidates"])
    target = tmp_path / "best.yaml"
    result = invoke("suggest", "-m", "tiny-moe", "-w", 8, "--fix", "ep=4", "--write", target, "--format", "json")
    best = json.loads(result.stdout)["candidates"][0]
    layout = load_layout(target)
    assert (layout.ep, layout.etp, layout.tp, layout.dp, layout.pp) == (4, best["etp"], best["tp"], best["dp"],
                                                                       best["pp"])
    planned = json.loads(invoke("plan", target, "--format", "json").stdout)
    assert planned["memory"]["peak_bytes"] == best["peak_bytes"]
    assert planned["time"]["step_time_s"] == pytest.approx(best["step_time_s"])


@pytest.mark.parametrize("args,fragments", [
    (["-m", "tiny-llama", "--fix", "ep=2"], ["--fix ep=2 is invalid", "dense"]),
    (["-m", "tiny-moe", "--fix", "ep=3"], ["--fix ep=3 is invalid", "does not divide --world 8"]),
    (["-m", "tiny-moe", "--fix", "xp=2"], ["--fix xp=2 is invalid", "ep, etp"]),
])
def test_suggest_fix_errors(args, fragments):
    assert_bad_input(invoke("suggest", "-w", 8, *args), *fragments)


def test_plan_model_moe_rows_and_json(tmp_path):
    path = write(tmp_path, "world_size: 8\ntp: 2\nep: 4\netp: 1\ndevices_per_node: 4\n", "ep4.yaml")
    data = json.loads(invoke("plan", path, "--model", "tiny-moe", "--format", "json").stdout)
    moe = data["model"]["moe"]
    assert (moe["ep"], moe["etp"], moe["edp"], moe["local_experts"]) == (4, 1, 2, 2)
    assert moe["expert_parameters_per_rank"] == 98_304 and moe["expert_bytes"] == 98_304 * 16
    assert (moe["all_to_all_calls"], moe["all_to_all_bytes"]) == (16, 393_216)
    assert moe["dispatch_s"] == data["time"]["breakdown"]["ep_s"] > 0
    assert moe["active_parameters"] == 182_848 and data["model"]["parameters"] == 477_760
    assert {"ep", "edp"} <= {r["group"] for r in data["communication"]["per_step"]}
    text = invoke("plan", path, "--model", "tiny-moe").stdout
    assert "mixture of experts" in text and "ep=4 etp=1 edp=2: 2 expert(s) per rank" in text
    assert "ep dispatch (all-to-all, etp)" in text and "of which experts" in text
    dense = json.loads(invoke("plan", "cpu-4", "--model", "tiny-llama", "--format", "json").stdout)
    assert "moe" not in dense["model"] and "ep_s" not in dense["time"]["breakdown"]


def test_plan_model_errors_when_experts_do_not_divide_over_ep(tmp_path):
    path = write(tmp_path, "world_size: 6\nep: 3\netp: 1\n", "ep3.yaml")
    model = write(tmp_path, bundled_models()["tiny-moe"].read_text().replace("global_batch_size: 8",
                                                                             "global_batch_size: 12"), "m.yaml")
    assert_bad_input(invoke("plan", path, "--model", model), "num_moe_experts % ep fails",
                     "num_moe_experts=8 is not divisible by ep=3")
    path = write(tmp_path, "world_size: 4\nep: 2\n", "ep2.yaml")
    assert_bad_input(invoke("plan", path, "--model", "tiny-llama", "--format", "json"), "the model is dense")


def test_deepseek_v3_at_the_reports_layout():
    # 2048 GPUs, 8 per node, pp 16 x ep 64 (etp 1, so dp 128, edp 2), ZeRO-1: what the docs compare.
    w = preset("deepseek-v3")
    w = replace(w, training=replace(w.training, last_stage_layers=1, recompute="selective"))
    report = estimate(Layout(world_size=2048, pp=16, ep=64, etp=1, devices_per_node=8), w)
    moe = report["model"]["moe"]
    assert (moe["local_experts"], moe["edp"]) == (4, 2)
    # 4 MoE layers x 4 experts x 3 * 7168 * 2048 on a middle stage.
    assert moe["expert_parameters_per_rank"] == 4 * 4 * 3 * 7168 * 2048
    a2a = [r for r in report["communication"]["per_step"] if r["group"] == "ep"][0]
    assert a2a["crosses_nodes"] is True and a2a["message_bytes"] == 4096 * 8 * 7168 * 2
    assert a2a["count"] == 4 * 4 * 120  # 4 per MoE layer, 4 layers, 15,360 / 128 micro-batches


def test_moe_imbalance_option_scales_the_busiest_ranks_dispatch(tmp_path):
    path = write(tmp_path, "world_size: 8\ntp: 2\nep: 4\netp: 1\ndevices_per_node: 4\n", "ep4.yaml")
    even = json.loads(invoke("plan", path, "--model", "tiny-moe", "--format", "json").stdout)
    busy = json.loads(invoke("plan", path, "--model", "tiny-moe", "--moe-imbalance", 1.5, "--format", "json").stdout)
    assert busy["model"]["moe"]["imbalance"] == 1.5
    assert busy["model"]["moe"]["all_to_all_bytes"] == 1.5 * even["model"]["moe"]["all_to_all_bytes"]
    assert busy["time"]["breakdown"]["compute_s"] > even["time"]["breakdown"]["compute_s"]
    ranked = json.loads(invoke("suggest", "-m", "tiny-moe", "-w", 8, "--moe-imbalance", 2, "--format", "json").stdout)
    assert ranked["candidates"]
    assert_bad_input(invoke("plan", path, "--model", "tiny-moe", "--moe-imbalance", 0.5), "--moe-imbalance 0.5 is invalid")
    assert_bad_input(invoke("suggest", "-m", "tiny-llama", "-w", 8, "--moe-imbalance", 1.2),
                     "--moe-imbalance needs a mixture-of-experts model")


def test_zero_stage_3_runs_the_experts_as_stage_2():
    # DistributedOptimizer keeps the experts in a second optimizer over edp (stage 3 as stage 2);
    # fully_shard leaves them whole: weights whole, gradients and state / edp, one RS + AG per step.
    w = preset("tiny-moe")
    t3 = replace(w.training, zero_stage=3)
    row = stage_rows(w.model, t3, 2, 1, 1, 4, 0, None, ep=4, etp=1)[0]
    assert row["expert_bytes"] == 98_304 * (4 + 4 / 2 + (8 + main_weight_bytes(4, 3)) / 2)
    dense_params = row["parameters"] - row["expert_parameters"]
    assert row["gathered_bytes"] == 4 * dense_params  # only the dense weights are gathered
    edp = [(r["op"], r["count"]) for r in traffic(w.model, t3, 2, 1, 1, 4, ep=4, etp=1) if r["group"] == "edp"]
    assert edp == [("reduce_scatter", 1), ("all_gather", 1)]
