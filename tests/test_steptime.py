"""The step-time model (costmodel/steptime.py), device presets and calibration, against hand-computed values.

The toy model: 2 layers, h = 4, one head (k = 4, g = 1), s = 8, f = 16, no vocabulary.
One layer's forward: q/k/v 2*8*4*(4 + 8) = 768, output projection 2*8*4*4 = 256, MLP
4*8*4*16 = 2048, attention scores 4*8*8*4 = 1024: 4,096 FLOPs (= 24 s h^2 + 4 s^2 h).
"""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from mindscience.distributed.costmodel import ModelError, estimate, suggest
from mindscience.distributed.costmodel.calibrate import calibrate, cluster_sources
from mindscience.distributed.costmodel.devices import DEVICE_PRESETS
from mindscience.distributed.costmodel.spec import ClusterSpec, ModelSpec, TrainingSpec, Workload
from mindscience.distributed.costmodel.steptime import (
    layer_forward_flops,
    model_flops_per_sample,
    stage_slot_flops,
    step_time,
)
from mindscience.distributed.topology import Layout
from mscli.main import app

TOY = ModelSpec(num_layers=2, hidden_size=4, num_attention_heads=1, seq_length=8, vocab_size=0)
# 1 TFLOP/s reached exactly, 1 GB/s links of 10 us (inside a node) / 4 GB/s... set per test.
UNIT = dict(peak_tflops=1, compute_efficiency=1, intra_node_gbps=1, inter_node_gbps=0.5,
            intra_node_latency_us=10, inter_node_latency_us=100)
LAYER = 4096  # forward FLOPs of one toy layer


def cluster(**kw):
    return ClusterSpec(**{**UNIT, **kw})


def test_layer_flops_by_hand():
    assert layer_forward_flops(TOY, 8, 8) == {"linear": 768 + 256 + 2048, "attention": 1024}
    # Grouped-query attention: 2 query heads of k = 2 sharing one k/v group -> q/k/v 2*8*4*(4 + 4).
    gqa = ModelSpec(num_layers=1, hidden_size=4, num_attention_heads=2, num_query_groups=1, seq_length=8,
                    vocab_size=0)
    assert layer_forward_flops(gqa, 8, 8)["linear"] == 2 * 8 * 4 * 8 + 256 + 2048
    # With a vocabulary the logits add 2 s h v forward: 3 * (2 layers + 2*8*4*10) per sample.
    with_vocab = ModelSpec(num_layers=2, hidden_size=4, num_attention_heads=1, seq_length=8, vocab_size=10)
    assert model_flops_per_sample(with_vocab) == 3 * (2 * LAYER + 640)
    # Narayanan's 72 s l h^2 (1 + s/(6h) + v/(12 l h)) for GPT-3 175B, per sample.
    gpt3 = ModelSpec(num_layers=96, hidden_size=12288, num_attention_heads=96, seq_length=2048, vocab_size=51200)
    s, l, h, v = 2048, 96, 12288, 51200
    assert model_flops_per_sample(gpt3) == pytest.approx(72 * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)))


def test_two_layer_toy_compute_mfu_and_tokens():
    one = TrainingSpec(global_batch_size=1)
    t = step_time(TOY, one, cluster(), tp=1, cp=1, pp=1, dp=1)
    # forward + backward = 3 x 2 layers x 4096 FLOPs at 1e12 FLOP/s.
    assert t["breakdown"]["compute_s"] == pytest.approx(3 * 2 * LAYER / 1e12)
    assert t["step_time_s"] == pytest.approx(24576e-12)
    assert t["tokens_per_s"] == pytest.approx(8 / 24576e-12)
    assert t["mfu"] == pytest.approx(1.0)
    # Half the efficiency: twice the time, half the MFU (the peak stays the denominator).
    slow = step_time(TOY, one, cluster(compute_efficiency=0.5), tp=1, cp=1, pp=1, dp=1)
    assert slow["step_time_s"] == pytest.approx(2 * 24576e-12) and slow["mfu"] == pytest.approx(0.5)


def test_recomputation_adds_forward_work_but_not_model_flops():
    full = step_time(TOY, TrainingSpec(global_batch_size=1, recompute="full"), cluster(), 1, 1, 1, 1)
    assert full["breakdown"]["compute_s"] == pytest.approx(4 * 2 * LAYER / 1e12)
    assert full["mfu"] == pytest.approx(0.75)  # model FLOPs are 3 passes of 4
    selective = stage_slot_flops(TOY, TrainingSpec(recompute="selective"), tp=1, cp=1, pp=1)
    assert selective["total"] == 3 * 2 * LAYER + 2 * 1024  # the attention-score matmuls again


def test_1f1b_bubble_and_sends():
    # pp = 2: one layer per stage; m = 4 micro-batches; slot = 3 x 4096 FLOPs.
    four = TrainingSpec(global_batch_size=4, sequence_parallel=False)
    t = step_time(TOY, four, cluster(), tp=1, cp=1, pp=2, dp=1)
    slot = 3 * LAYER / 1e12
    assert t["breakdown"]["compute_s"] == pytest.approx(4 * slot)
    assert t["breakdown"]["bubble_s"] == pytest.approx(4 * slot * (2 - 1) / 4)  # (m + p - 1) slots in all
    # (m + p - 1) = 5 slots, each one activation forward and one gradient back of s*b*h*2 = 64 bytes.
    assert t["breakdown"]["pp_s"] == pytest.approx(2 * 5 * (10e-6 + 64 / 1e9))
    assert t["pipeline_bubble"] == pytest.approx(0.25)
    assert t["step_time_s"] == pytest.approx(sum(t["breakdown"].values()))


def test_interleaved_bubble_is_divided_by_the_chunks():
    model = ModelSpec(num_layers=8, hidden_size=4, num_attention_heads=1, seq_length=8, vocab_size=0)
    plain = TrainingSpec(global_batch_size=4, sequence_parallel=False)
    inter = TrainingSpec(global_batch_size=4, sequence_parallel=False, virtual_pipeline_stages=2)
    a = step_time(model, plain, cluster(), tp=1, cp=1, pp=2, dp=1)
    b = step_time(model, inter, cluster(), tp=1, cp=1, pp=2, dp=1)
    assert a["breakdown"]["compute_s"] == pytest.approx(b["breakdown"]["compute_s"])
    assert b["breakdown"]["bubble_s"] == pytest.approx(b["breakdown"]["compute_s"] * 1 / (2 * 4))
    assert b["breakdown"]["bubble_s"] == pytest.approx(a["breakdown"]["bubble_s"] / 2)
    # v times the transfers of 1F1B: 2 * v * (m + p - 1) = 2 * 2 * 5 = 20 (1F1B: 10).
    assert a["breakdown"]["pp_s"] == pytest.approx(10 * (10e-6 + 64 / 1e9))
    assert b["breakdown"]["pp_s"] == pytest.approx(20 * (10e-6 + 64 / 1e9))


def test_tp_latency_and_bandwidth_terms():
    one = TrainingSpec(global_batch_size=1, sequence_parallel=False)
    t = step_time(TOY, one, cluster(), tp=2, cp=1, pp=1, dp=1)
    # 4 all-reduces per layer x 2 layers of s*b*h*2 = 64 bytes, each sending 64 * 2(2-1)/2 bytes.
    assert t["breakdown"]["tp_s"] == pytest.approx(8 * 10e-6 + 8 * 64 / 1e9)
    assert t["breakdown"]["compute_s"] == pytest.approx(3 * 2 * LAYER / 2 / 1e12)
    # Across nodes the same calls pay the inter-node latency and bandwidth.
    far = step_time(TOY, one, cluster(), tp=2, cp=1, pp=1, dp=1, crossing={"tp": True})
    assert far["breakdown"]["tp_s"] == pytest.approx(8 * 100e-6 + 8 * 64 / 0.5e9)


def test_gradient_reduction_overlap_on_and_off():
    # dp = 2, one micro-batch each: an all-reduce of the 2-layer model's fp32 gradients.
    # 2 layers x (qkv 4*12 + 12, out 16, MLP 2*4*16 + 16, biases and layernorms 6*4), positions 8*4, final norm 2*4.
    params = 2 * (4 * (4 + 8) + (4 + 8) + 16 + 2 * 4 * 16 + 16 + 6 * 4) + 8 * 4 + 2 * 4
    reduce = 10e-6 + params * 4 * 2 * (2 - 1) / 2 / 1e9
    backward = 2 * 2 * LAYER / 1e12
    on = step_time(TOY, TrainingSpec(global_batch_size=2), cluster(), tp=1, cp=1, pp=1, dp=2)
    off = step_time(TOY, TrainingSpec(global_batch_size=2, overlap_grad_reduce=False), cluster(), 1, 1, 1, 2)
    assert off["breakdown"]["dp_s"] == pytest.approx(reduce)
    assert on["breakdown"]["dp_s"] == pytest.approx(max(0.0, reduce - backward))
    assert on["dp_reduce_s"] == pytest.approx(reduce)
    # A backward longer than the reduction hides all of it.
    slow = step_time(TOY, TrainingSpec(global_batch_size=2), cluster(peak_tflops=1e-9), 1, 1, 1, 2)
    assert slow["breakdown"]["dp_s"] == 0.0


def test_estimate_time_section_matches_step_time():
    layout = Layout(world_size=4, tp=2, pp=2)
    workload = Workload(model=ModelSpec(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                                        vocab_size=128), cluster=cluster())
    time = estimate(layout, workload)["time"]
    assert set(time["breakdown"]) == {"compute_s", "bubble_s", "tp_s", "cp_s", "pp_s", "dp_s"}
    assert sum(time["breakdown"].values()) == pytest.approx(time["step_time_s"])
    assert 0 < time["mfu"] < 1 and time["tokens_per_s"] > 0


# ------------------------------------------------------------------ presets
def test_every_breakdown_value_is_a_float():
    # tp = cp = 1 have no collectives: their terms are 0.0, not the int 0 an empty sum gives.
    for sizes in ((1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)):
        model = ModelSpec(num_layers=2, hidden_size=4, num_attention_heads=2, seq_length=8, vocab_size=0)
        t = step_time(model, TrainingSpec(global_batch_size=2), cluster(), *sizes)
        assert all(type(v) is float for v in t["breakdown"].values()), (sizes, t["breakdown"])
    plain = step_time(TOY, TrainingSpec(global_batch_size=1), cluster(), 1, 1, 1, 1)["breakdown"]
    assert plain["tp_s"] == 0.0 and plain["cp_s"] == 0.0 and json.dumps(plain["tp_s"]) == "0.0"
    result = invoke("suggest", "-m", "gqa-7b", "-w", 8, "--fix", "tp=1,cp=1", "--format", "json")
    for c in json.loads(result.stdout)["candidates"]:
        assert all(isinstance(v, float) for v in c["breakdown"].values())


def test_device_presets_fill_and_explicit_keys_win():
    for name in ("ascend-910b", "a100-80gb", "h100-80gb", "h200", "cpu"):
        c = ClusterSpec(device=name)
        assert c.peak_tflops == DEVICE_PRESETS[name]["peak_tflops"]
        assert c.intra_node_latency_us == DEVICE_PRESETS[name]["intra_node_latency_us"]
    c = ClusterSpec(device="h100-80gb", peak_tflops=500, compute_efficiency=0.4)
    assert (c.peak_tflops, c.compute_efficiency, c.device_memory_gb) == (500, 0.4, 80)
    assert ClusterSpec().peak_tflops == 300 and ClusterSpec().compute_efficiency == 0.5


@pytest.mark.parametrize("kwargs,fragment", [
    (dict(device="tpu-v9"), "device='tpu-v9' is invalid: expected one of a100-80gb"),
    (dict(compute_efficiency=1.5), "compute_efficiency=1.5 is invalid: expected a fraction"),
    (dict(peak_tflops=0), "peak_tflops=0 is invalid"),
    (dict(inter_node_latency_us=-1), "inter_node_latency_us=-1 is invalid"),
    (dict(peak_tflops=float("inf")), "peak_tflops=inf is invalid: expected a finite number > 0"),
    (dict(intra_node_gbps=float("inf")), "intra_node_gbps=inf is invalid"),
    (dict(device_memory_gb=float("nan")), "device_memory_gb=nan is invalid"),
    (dict(compute_efficiency=float("inf")), "compute_efficiency=inf is invalid"),
])
def test_bad_cluster_values(kwargs, fragment):
    with pytest.raises(ModelError, match=fragment):
        ClusterSpec(**kwargs)


@pytest.mark.parametrize("key,hint", [
    ("compute_efficiency", "a fraction of the peak in (0, 1], e.g. 0.5"),
    ("intra_node_latency_us", "microseconds of one small collective inside a node, e.g. 10"),
    ("inter_node_latency_us", "microseconds of one small collective across nodes, e.g. 20"),
    ("peak_tflops", "dense bf16/fp16 TFLOP/s per device, e.g. 300"),
    ("device_memory_gb", "GiB of memory per device, e.g. 64"),
    ("intra_node_gbps", "GB/s per device between devices of one node, e.g. 90"),
    ("inter_node_gbps", "GB/s per device between nodes, e.g. 25"),
])
def test_each_cluster_key_has_its_own_example(key, hint):
    with pytest.raises(ModelError) as err:
        ClusterSpec(**{key: -1})
    assert str(err.value) == f"{key}=-1 is invalid: expected a finite number > 0. Set {key} to {hint}."


def test_infinite_value_in_a_cluster_section_is_one_line(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("model:\n  num_layers: 2\n  hidden_size: 8\n  num_attention_heads: 2\n  seq_length: 8\n"
                    "  vocab_size: 0\ncluster:\n  peak_tflops: .inf\n")
    result = invoke("suggest", "-m", path, "-w", 4)
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert f"{path}: cluster.peak_tflops=inf is invalid: expected a finite number > 0" in result.stderr
    assert "e.g. 300" in result.stderr
    result = invoke("suggest", "-m", path, "-w", 4, "--device-memory-gb", "inf")
    assert result.exit_code == 2


# ------------------------------------------------------------------ calibration
REPORT = {
    "compute": {"tflops": 0.05, "dtype": "float32", "shape": [1024, 1024, 1024]},
    "bandwidth": [
        {"op": "all_reduce", "group": "tp", "bytes": 1024, "busbw_gbps": 0.001, "latency_us": 800.0,
         "crosses_nodes": False},
        {"op": "all_reduce", "group": "tp", "bytes": 262144, "busbw_gbps": 0.2, "latency_us": 800.0,
         "crosses_nodes": False},
        {"op": "all_gather", "group": "cp", "bytes": 262144, "busbw_gbps": 0.4, "latency_us": 1000.0,
         "crosses_nodes": False},
        {"op": "all_gather", "group": "dp", "bytes": 262144, "busbw_gbps": 0.6, "latency_us": 1200.0,
         "crosses_nodes": False},
    ],
}


def test_calibrate_takes_compute_bandwidth_and_latency_from_the_report():
    base = ClusterSpec(device="cpu", inter_node_gbps=0.05)
    sources = cluster_sources(base, explicit=("inter_node_gbps",))
    got, where = calibrate(base, REPORT, "r.json", sources)
    assert got.compute_efficiency == pytest.approx(0.05 / 0.1) and got.peak_tflops == 0.1
    assert got.intra_node_gbps == pytest.approx(0.4)  # the median of the largest rows 0.2, 0.4, 0.6
    assert got.intra_node_latency_us == pytest.approx(1000.0)
    assert got.inter_node_gbps == 0.05 and where["inter_node_gbps"] == "cluster section"  # no cross-node row
    assert where["intra_node_gbps"] == "r.json: median busbw of 3 intra-node row(s)"
    assert where["compute_efficiency"].startswith("r.json: compute.matmul 0.05 TFLOP/s")
    assert where["device_memory_gb"] == "preset cpu"


ROW = {"op": "all_reduce", "group": "tp", "bytes": 1024, "busbw_gbps": 1.0, "latency_us": 10.0, "crosses_nodes": False}


@pytest.mark.parametrize("report,field,expected", [
    ({"compute": 5}, "compute is 5 (int)", "expected an object"),
    ({"bandwidth": [5]}, "bandwidth[0] is 5 (int)", "expected an object"),
    ({"compute": {"tflops": 1}, "bandwidth": {"a": 1}}, "bandwidth is {'a': 1} (dict)", "expected a list"),
    ({"compute": {"tflops": "x"}, "bandwidth": [{"busbw_gbps": "fast"}]}, "compute.tflops is 'x' (str)",
     "TFLOP/s > 0"),
    ({"compute": {"tflops": 1.0}, "bandwidth": [{"busbw_gbps": "fast"}]}, "bandwidth[0].op is missing", "a string"),
    ({"bandwidth": [{**ROW, "busbw_gbps": "fast"}]}, "bandwidth[0].busbw_gbps is 'fast' (str)", "GB/s >= 0"),
    ({"bandwidth": [{**ROW, "latency_us": -5}]}, "bandwidth[0].latency_us is -5 (int)", "microseconds >= 0"),
    ({"bandwidth": [ROW, {**ROW, "bytes": 0}]}, "bandwidth[1].bytes is 0 (int)", "bytes > 0"),
    ({"bandwidth": [{**ROW, "crosses_nodes": "no"}]}, "bandwidth[0].crosses_nodes is 'no' (str)", "true or false"),
    ({"compute": {"tflops": float("inf")}}, "compute.tflops is inf (float)", "a finite number"),
    ({"compute": {"dtype": "float32"}}, "compute.tflops is missing", "TFLOP/s > 0"),
])
def test_malformed_calibration_report_is_one_line_naming_file_and_field(tmp_path, report, field, expected):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(report))
    with pytest.raises(ModelError, match=re.escape(f"bad.json: {field}: expected")):
        calibrate(ClusterSpec(), report, "bad.json")
    for command in (("suggest", "-m", "sci-transformer-s", "-w", 8), ("plan", "cpu-4", "-m", "sci-transformer-s")):
        result = invoke(*command, "--calibrate", path)
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in result.stderr
        assert lines[0].startswith(f"msdist: error: {path}: {field}: expected") and expected in lines[0]


# ------------------------------------------------------------------ suggest
def test_suggest_orders_by_step_time_and_first_sci_layout_has_a_small_bubble():
    from mindscience.distributed.costmodel import load_workload
    from mscli.layouts import bundled_models

    result = suggest(load_workload(bundled_models()["sci-transformer-s"]), world_size=64)
    times = [c["step_time_s"] for c in result["candidates"]]
    assert times == sorted(times)
    best = result["candidates"][0]
    assert best["pipeline_bubble"] <= 0.1 and best["breakdown"]["bubble_s"] <= 0.1 * best["step_time_s"]
    # The old first choice, tp1 dp8 pp8 with an 87.5 % bubble, is far down: its bubble costs 0.875 of its compute.
    ranked = [(c["tp"], c["cp"], c["dp"], c["pp"]) for c in result["candidates"]]
    old = result["candidates"][ranked.index((1, 1, 8, 8))]
    assert old["breakdown"]["bubble_s"] == pytest.approx(0.875 * old["breakdown"]["compute_s"])
    # 1.44x since the pipeline keeps its stage forwards (above 1.5x while it re-ran them).
    assert ranked.index((1, 1, 8, 8)) > 20 and old["step_time_s"] > 1.4 * best["step_time_s"]


def test_suggest_fix_micro_batches_and_virtual_stages():
    model = ModelSpec(num_layers=16, hidden_size=256, num_attention_heads=8, seq_length=512, vocab_size=1024)
    workload = Workload(model=model, training=TrainingSpec(global_batch_size=64))
    fixed = suggest(workload, 16, fix={"tp": 2, "cp": 1})["candidates"]
    assert fixed and all(c["tp"] == 2 and c["cp"] == 1 for c in fixed)
    searched = suggest(workload, 16, micro_batch_sizes=[1, 2, 4])["candidates"]
    for c in searched[:5]:
        times = []
        for b in (1, 2, 4):
            train = TrainingSpec(global_batch_size=64, micro_batch_size=b)
            layout = Layout(world_size=16, tp=c["tp"], cp=c["cp"], pp=c["pp"], order=c["order"], devices_per_node=8)
            times.append(estimate(layout, Workload(model=model, training=train))["time"]["step_time_s"])
        assert c["step_time_s"] == pytest.approx(min(times)) and c["micro_batch_size"] in (1, 2, 4)
    interleaved = suggest(workload, 16, fix={"pp": 4, "tp": 1, "cp": 1}, virtual_stages=2)["candidates"][0]
    plain = suggest(workload, 16, fix={"pp": 4, "tp": 1, "cp": 1})["candidates"][0]
    assert interleaved["virtual_stages"] == 2
    assert interleaved["pipeline_bubble"] == pytest.approx(plain["pipeline_bubble"] / 2)
    with pytest.raises(ModelError, match="--fix tp=3 is invalid"):
        suggest(workload, 16, fix={"tp": 3})
    with pytest.raises(ModelError, match="--fix zp=2"):
        suggest(workload, 16, fix={"zp": 2})


def test_a_tie_in_step_time_goes_to_the_lower_peak_memory(monkeypatch):
    import mindscience.distributed.costmodel.runtime as rt

    monkeypatch.setattr(rt, "_rule", lambda module, name: None)  # a library that reduces after the backward
    # tp=2 (no sequence parallelism) and cp=2 on 2 devices, 2 layers, s = 4096, h = 64, one micro-batch.
    # Compute is the same: each rank runs half of every matmul. Latency 2^-12 s per call and 2^30 B/s
    # make every term a power of two, so the sums are exact:
    #   tp: 4 all-reduces x 2 layers of s*h*2 B = 2^19 B, each sending 2^19 * 2(2-1)/2 B:
    #       8 * 2^-12 + 8 * 2^19 / 2^30 = 8 * 2^-12 + 16 * 2^-12 = 24 * 2^-12 s
    #   cp: 8 all-to-alls x 2 layers; a layer's forward or backward moves q, k, v, out of (s/2)*h*2 B,
    #       2^20 B, so 4 passes 2^22 B, of which a rank sends (2-1)/2:
    #       16 * 2^-12 + 2^21 / 2^30 = 16 * 2^-12 + 8 * 2^-12 = 24 * 2^-12 s
    # and the cp layout's gradient all-reduce would hide behind its backward with overlap_grad_reduce,
    # which the pure step_time prices as configured. cp=2 halves every activation (tp without
    # sequence parallelism only some), so it has the lower peak: it must come first, although the
    # later keys (pp, cp, tp) would put tp=2 first.
    model = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=2, seq_length=4096, vocab_size=0)
    training = TrainingSpec(sequence_parallel=False, global_batch_size=1, context_parallel_method="ulysses")
    link = dict(intra_node_gbps=2**30 / 1e9, inter_node_gbps=2**30 / 1e9,
                intra_node_latency_us=2**-12 * 1e6, inter_node_latency_us=2**-12 * 1e6)
    unit = ClusterSpec(peak_tflops=1, compute_efficiency=1, **link)
    by_size = {sizes: step_time(model, training, unit, *sizes) for sizes in ((2, 1, 1, 1), (1, 2, 1, 1))}
    tp, cp = by_size[(2, 1, 1, 1)], by_size[(1, 2, 1, 1)]
    assert tp["breakdown"]["tp_s"] == cp["breakdown"]["cp_s"] == 24 * 2**-12
    assert tp["breakdown"]["compute_s"] == cp["breakdown"]["compute_s"] and cp["breakdown"]["dp_s"] == 0.0
    assert tp["step_time_s"] == cp["step_time_s"]  # a real tie, to the last bit
    # suggest prices what the library runs: the gradient all-reduce after the backward (exposed),
    # so the cp layout is slower by exactly its dp-cp time, and tp=2 ranks first.
    ranked = suggest(Workload(model=model, training=training, cluster=unit), 2, fix={"dp": 1})["candidates"]
    by_size = {(c["tp"], c["cp"], c["pp"]): c for c in ranked}
    tp, cp = by_size[(2, 1, 1)], by_size[(1, 2, 1)]
    assert cp["breakdown"]["dp_s"] > 0
    assert cp["step_time_s"] == pytest.approx(tp["step_time_s"] + cp["breakdown"]["dp_s"])
    assert ranked.index(tp) < ranked.index(cp)


def test_a_tie_in_step_time_between_zero_stages_goes_to_the_lower_peak_memory():
    # ZeRO-1 and ZeRO-2 send the same bytes (reduce-scatter + all-gather), so on dp = 4 they tie to the
    # last bit; stage 2 keeps 1/4 of the fp32 gradients, so it is the one kept, and its peak is lower by
    # 3/4 x 4 bytes per parameter (d = 4 divides every dim 0 of this model: no padding).
    model = ModelSpec(num_layers=2, hidden_size=64, num_attention_heads=2, seq_length=64, vocab_size=0)
    training = TrainingSpec(global_batch_size=4, precision="fp32")
    workload = Workload(model=model, training=training)
    one = {z: suggest(workload, 4, fix={"dp": 4}, zero_stages=[z])["candidates"][0] for z in (1, 2)}
    assert one[1]["step_time_s"] == one[2]["step_time_s"]
    params = 2 * (12 * 64 * 64 + 13 * 64) + 64 * 64 + 2 * 64  # layers, learned positions, final norm
    assert one[1]["peak_bytes"] - one[2]["peak_bytes"] == 4 * params * 3 // 4
    both = suggest(workload, 4, fix={"dp": 4}, zero_stages=[1, 2])["candidates"][0]
    assert both["zero_stage"] == 2 and both["peak_bytes"] == one[2]["peak_bytes"]


def test_virtual_stages_that_rule_out_every_pipeline_say_why():
    model = ModelSpec(num_layers=16, hidden_size=1024, num_attention_heads=16, seq_length=2048, vocab_size=32000)
    result = suggest(Workload(model=model), 64, virtual_stages=3)
    assert result["candidates"] and all(c["pp"] == 1 for c in result["candidates"])  # pp = 1 layouts stay valid
    def interleaving(notes):  # the other notes say how the library runs the ranked layouts
        return [n for n in notes if n.startswith("virtual stages")]

    assert len(interleaving(result["notes"])) == 1
    note = interleaving(result["notes"])[0]
    assert note.startswith("virtual stages v=3: no layout with pp > 1 was priced (num_layers % "
                           "(pp*virtual_pipeline_stages): ")
    assert "num_layers=16 % (pp*v) == 0 holds for v = 2, 4, 8" in note
    assert interleaving(suggest(Workload(model=model), 64, virtual_stages=2)["notes"]) == []
    assert interleaving(suggest(Workload(model=model), 64)["notes"]) == []
    # The CLI: the note is one stderr line, in the human view and beside JSON (which carries it as "notes").
    path_args = ("-w", 64, "--virtual-stages", 3, "-k", 3)
    human = invoke("suggest", "-m", "sci-transformer-s", *path_args)
    assert human.exit_code == 0, human.output
    data = invoke("suggest", "-m", "sci-transformer-s", *path_args, "--format", "json")
    assert data.exit_code == 0
    notes = json.loads(data.stdout)["notes"]
    for result in (human, data):
        lines = result.stderr.strip().splitlines()
        assert lines == [f"msdist: note: {n}" for n in notes]
    assert bool(interleaving(notes)) == all(c["pp"] == 1 for c in json.loads(data.stdout)["candidates"])


# ------------------------------------------------------------------ CLI
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_cli_suggest_json_has_the_step_time_and_sources(tmp_path):
    result = invoke("suggest", "-m", "gqa-7b", "-w", 64, "--device", "h100-80gb", "--micro-batch-sizes", "1,2",
                    "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    c = data["candidates"][0]
    assert {"step_time_s", "breakdown", "tokens_per_s", "mfu", "micro_batch_size", "est_time_s", "bottleneck"} <= set(c)
    assert data["cluster"]["peak_tflops"] == 989.0 and data["cluster_sources"]["peak_tflops"] == "preset h100-80gb"
    human = invoke("suggest", "-m", "gqa-7b", "-w", 64, "--fix", "tp=2")
    assert human.exit_code == 0, human.output
    assert "step time" in human.stdout and "MFU" in human.stdout and "tokens/s" in human.stdout


def test_cli_calibrate_plan_and_suggest(tmp_path):
    report = tmp_path / "report.json"
    report.write_text(json.dumps(REPORT))
    plan = invoke("plan", "cpu-4", "-m", "sci-transformer-s", "--calibrate", report, "--format", "json")
    assert plan.exit_code == 0, plan.output
    data = json.loads(plan.stdout)
    assert data["model"]["cluster"]["intra_node_gbps"] == pytest.approx(0.4)
    assert data["model"]["cluster_sources"]["intra_node_gbps"].startswith(str(report))
    human = invoke("plan", "cpu-4", "-m", "sci-transformer-s", "--calibrate", report)
    assert "step time" in human.stdout and "sources:" in human.stdout and str(report) in human.stdout
    result = invoke("suggest", "-m", "sci-transformer-s", "-w", 8, "--calibrate", report, "--format", "json")
    assert result.exit_code == 0 and json.loads(result.stdout)["cluster"]["intra_node_latency_us"] == 1000.0


@pytest.mark.parametrize("args,fragment", [
    (("suggest", "-m", "gqa-7b", "-w", 64, "--fix", "tp=two"), "--fix 'tp=two' is invalid"),
    (("suggest", "-m", "gqa-7b", "-w", 64, "--fix", "tp=2,tp=4"),
     "--fix 'tp=2,tp=4' is invalid: tp is pinned twice (tp=2 and tp=4)"),
    (("suggest", "-m", "gqa-7b", "-w", 64, "--fix", ","), "--fix ',' is invalid: it holds an empty pair"),
    (("suggest", "-m", "gqa-7b", "-w", 64, "--fix", ""), "--fix '' is invalid: it holds an empty pair"),
    (("suggest", "-m", "gqa-7b", "-w", 64, "--fix", "tp"), "--fix 'tp' is invalid: 'tp' is not AXIS=SIZE"),
    (("suggest", "-m", "gqa-7b", "-w", 64, "--micro-batch-sizes", "0,2"), "--micro-batch-sizes '0,2' is invalid"),
    (("suggest", "-m", "gqa-7b", "-w", 64, "--virtual-stages", 0), "--virtual-stages 0 is invalid"),
    (("suggest", "-m", "gqa-7b", "-w", 64, "--device", "tpu"), "device='tpu' is invalid"),
    (("suggest", "-m", "gqa-7b", "-w", 64, "--calibrate", "/nonexistent.json"), "no such file"),
    (("plan", "cpu-4", "--calibrate", "x.json"), "--calibrate needs a model"),
])
def test_cli_bad_options_are_one_line(args, fragment):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert fragment in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_cli_bad_cluster_key_in_a_model_file(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text("model:\n  num_layers: 2\n  hidden_size: 8\n  num_attention_heads: 2\n  seq_length: 8\n"
                    "  vocab_size: 0\ncluster:\n  device: h100\n")
    result = invoke("suggest", "-m", path, "-w", 4)
    assert result.exit_code == 2 and "cluster.device='h100' is invalid" in result.stderr
    path.write_text(path.read_text().replace("device: h100", "compute_efficiency: 2"))
    result = invoke("suggest", "-m", path, "-w", 4)
    assert result.exit_code == 2 and "cluster.compute_efficiency=2 is invalid" in result.stderr


# ------------------------------------------------------------------ the verify report feeds calibration
def test_verify_report_keeps_compute_latency_and_node_crossing():
    from mscli import verify_report as vr

    def bw(op, group, n, nbytes, us):
        return {"check": "bandwidth", "op": op, "group": group, "group_size": n, "bytes": nbytes,
                "dtype": "float32", "time_us": us, "wrong": 0, "composed": False, "passed": True}

    ranks = {}
    for rank, (rate, slow) in enumerate([(0.2, 1.0), (0.1, 1.5)]):
        ranks[rank] = {"status": "done", "records": [
            {"check": "compute.matmul", "group": "world", "passed": True, "max_error": 0.0, "tflops": rate,
             "dtype": "float32", "shape": [64, 64, 64], "time_us": 5.0},
            bw("all_reduce", "tp", 2, 1024, 100 * slow), bw("all_reduce", "tp", 2, 262144, 400 * slow),
            bw("all_gather", "world", 2, 1024, 300 * slow), bw("all_gather", "world", 2, 262144, 900 * slow)]}
    layout = Layout(world_size=2, tp=2, devices_per_node=1)  # two nodes of one device: everything crosses
    report = vr.build_report(layout, ranks, [])
    assert report["compute"] == {"tflops": 0.1, "tflops_per_rank": {"0": 0.2, "1": 0.1}, "dtype": "float32",
                                 "shape": [64, 64, 64]}
    rows = {(r["op"], r["bytes"]): r for r in report["bandwidth"]}
    assert rows[("all_reduce", 262144)]["latency_us"] == 150.0  # the slowest rank's smallest size
    assert rows[("all_gather", 262144)]["latency_us"] == 450.0
    assert all(r["crosses_nodes"] for r in report["bandwidth"])
    one_node = vr.build_report(Layout(world_size=2, tp=2), ranks, [])
    assert not any(r["crosses_nodes"] for r in one_node["bandwidth"])
    assert ("compute.matmul", "world") in {(r["check"], r["group"]) for r in report["correctness"]}
    cluster, sources = calibrate(ClusterSpec(), report, "r.json")
    assert cluster.compute_efficiency == pytest.approx(0.1 / 300)
    # Both rows cross nodes: they calibrate the inter-node link, the intra-node one stays as configured.
    # Alpha-beta: the bytes beyond the smallest size over the time they add, with the op's bus factor.
    # all_reduce on 2 ranks (factor 1): 261,120 B in 600 - 150 us = 0.58027 GB/s; all_gather on 2
    # (factor 1/2): 0.5 x 261,120 B in 1350 - 450 us = 0.14507 GB/s; the median of the two:
    assert cluster.inter_node_gbps == pytest.approx((261120 / 450e-6 + 0.5 * 261120 / 900e-6) / 2 / 1e9)
    assert sources["inter_node_gbps"] == "r.json: median busbw of 2 inter-node row(s) above the smallest size (alpha-beta)"
    assert cluster.inter_node_latency_us == pytest.approx(300.0) and sources["intra_node_gbps"] == "default"
    # Per-op latencies describe calls inside a node only: none here.
    assert cluster.collective_latency_us is None
    inside, where = calibrate(ClusterSpec(), one_node, "r.json")
    assert inside.collective_latency_us == (("all_gather", 2, 450.0), ("all_reduce", 2, 150.0))
    assert where["collective_latency_us"] == "r.json: median latency per op and group size of 2 intra-node row(s)"


def test_compute_probe_size_follows_the_backend():
    from mindscience.distributed.harness.checks.compute import probe_settings

    cpu = probe_settings("CPU")
    assert (cpu["size"], cpu["warmup"], cpu["iters"], cpu["min_seconds"]) == (1024, 1, 3, 0.0)  # as before
    for target in ("Ascend", "GPU"):
        # 2 * 8192^3 = 1.1 TFLOP a product: milliseconds on an accelerator, so a ~10 us launch is noise.
        got = probe_settings(target)
        assert got["size"] == 8192 and got["warmup"] >= 1 and got["iters"] >= 10 and got["min_seconds"] > 0
    assert probe_settings("Ascend", 4096)["size"] == 4096
    with pytest.raises(ValueError, match="matmul size 0 is invalid"):
        probe_settings("GPU", 0)


def test_compute_probe_operands_and_timing_loop_without_a_device():
    import time

    import numpy as np

    from mindscience.distributed.harness.checks import compute

    n = 48
    a, b = compute._operands(n)
    i = np.arange(n * n).reshape(n, n)
    assert (a == (7 * i) % 5 - 2).all() and (b == (3 * i + 1) % 5 - 2).all()  # built without the n^2 indices
    assert a.dtype == np.float32 and np.abs(a.astype(np.int64) @ b.astype(np.int64)).max() <= 4 * n
    # The loop runs at least `iters` products, synchronizing before each reading of the clock, and keeps
    # going until min_seconds have passed.
    calls, syncs = [], []
    count, elapsed, out = compute._timed(lambda: calls.append(1) or len(calls), lambda: syncs.append(len(calls)),
                                         iters=3, min_seconds=0.0)
    assert (count, len(calls), syncs, out) == (3, 3, [3], 3)
    calls.clear()
    count, elapsed, _ = compute._timed(lambda: (calls.append(1), time.sleep(0.002)), lambda: None, iters=2,
                                       min_seconds=0.05)
    assert count == len(calls) and count > 2 and elapsed >= 0.05


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (8, 16)])
def test_1f1b_bubble_matches_the_simulated_schedule(p, m):
    # The cost model's (p - 1)/m is the idle time of the schedule msdist plan prints and the runtime runs.
    from mindscience.distributed.costmodel.memory import pipeline_bubble
    from mindscience.distributed.pipeline.plan import schedule_data

    data = schedule_data(p, "1f1b", m)
    work = 3 * m  # a forward lasts 1 unit, a backward 2, per micro-batch
    assert (data["makespan"] - work) / work == pytest.approx(pipeline_bubble(p, m))


# ------------------------------------------------------------------ per-op latencies (calibrated)
def test_collective_latency_table_interpolates_in_log2_of_the_group_size():
    c = cluster(collective_latency_us=[["all_reduce", 8, 400], ["all_reduce", 2, 100.0], ["all_gather", 4, 50]])
    assert c.collective_latency_us == (("all_gather", 4, 50.0), ("all_reduce", 2, 100.0), ("all_reduce", 8, 400.0))
    us = {n: c.collective_latency_s("all_reduce", n) * 1e6 for n in (2, 4, 8, 16)}
    assert us == pytest.approx({2: 100.0, 4: 250.0, 8: 400.0, 16: 400.0})  # log2 4 = 2: halfway 100 .. 400
    assert c.collective_latency_s("all_gather", 2) * 1e6 == pytest.approx(50.0)  # the nearest listed size
    assert c.collective_latency_s("reduce_scatter", 4) * 1e6 == pytest.approx(10.0)  # not listed: the link's
    assert c.collective_latency_s("all_reduce", 2, crosses=True) * 1e6 == pytest.approx(100.0)  # inter-node
    # A calibrated cluster written to a model file (suggest --write) reads back the same.
    import yaml

    from mindscience.distributed.costmodel.spec import workload_from_mapping, workload_sections

    text = yaml.safe_dump(workload_sections(Workload(model=TOY, cluster=c)))
    assert workload_from_mapping(yaml.safe_load(text), "m.yaml").cluster == c
    for bad, fragment in ((["all_reduce", 2, 1.0], "entry 'all_reduce'"), ([["bcast", 2, 1.0]], "entry ['bcast'"),
                          ([["all_reduce", 1, 1.0]], "group_size an integer >= 2"),
                          ([["all_reduce", 2, float("nan")]], "microseconds a finite number > 0"),
                          ([["all_reduce", 2, 1.0], ("all_reduce", 2, 3.0)], "(all_reduce, 2) is listed twice")):
        with pytest.raises(ModelError, match=re.escape(fragment)):
            cluster(collective_latency_us=bad)


def test_step_time_charges_each_call_the_latency_of_its_op_and_group_size():
    model = ModelSpec(num_layers=2, hidden_size=4, num_attention_heads=2, seq_length=8, vocab_size=0)
    train = TrainingSpec(global_batch_size=4, sequence_parallel=False)
    table = [["all_reduce", 2, 100.0], ["all_reduce", 8, 400.0], ["send_recv", 2, 70.0]]
    plain = step_time(model, train, cluster(), tp=2, cp=1, pp=1, dp=4)["breakdown"]
    timed = step_time(model, train, cluster(collective_latency_us=table), tp=2, cp=1, pp=1, dp=4)["breakdown"]
    # tp: 8 all-reduces (4 per layer pass, 2 layers) on 2 ranks, 100 us instead of 10 each;
    # dp-cp: 1 all-reduce on 4 ranks, 250 us (log2-halfway between 2 and 8) instead of 10.
    assert timed["tp_s"] - plain["tp_s"] == pytest.approx(8 * 90e-6)
    assert timed["dp_s"] - plain["dp_s"] == pytest.approx(240e-6)
    assert timed["compute_s"] == plain["compute_s"]
    # pp: 2 (m + p - 1) = 2 x (1 + 2 - 1) = 4 transfers on the critical path, each a send_recv of 2 ranks.
    one = TrainingSpec(global_batch_size=4, sequence_parallel=False)
    plain = step_time(model, one, cluster(), tp=1, cp=1, pp=2, dp=4)["breakdown"]
    timed = step_time(model, one, cluster(collective_latency_us=table), tp=1, cp=1, pp=2, dp=4)["breakdown"]
    assert timed["pp_s"] - plain["pp_s"] == pytest.approx(4 * 60e-6)
    assert timed["dp_s"] - plain["dp_s"] == pytest.approx(240e-6)


def test_calibrate_per_op_latency_and_alpha_beta_bandwidth_by_hand():
    def row(op, group, n, nbytes, us, busbw):
        return {"op": op, "group": group, "group_size": n, "bytes": nbytes, "time_us": us, "busbw_gbps": busbw,
                "latency_us": None, "crosses_nodes": False}

    rows = [row("all_reduce", "tp", 2, 1024, 100.0, 0.01), row("all_reduce", "tp", 2, 201024, 200.0, 1.00512),
            row("all_reduce", "dp", 2, 1024, 140.0, 0.01), row("all_reduce", "dp", 2, 201024, 240.0, 0.8376),
            row("all_reduce", "world", 8, 1024, 900.0, 0.01), row("all_reduce", "world", 8, 201024, 800.0, 0.4),
            row("sendrecv", "pp:0-1", 2, 1024, 50.0, 0.01), row("sendrecv", "pp:0-1", 2, 201024, 150.0, 1.34016)]
    for r in rows:  # the report keeps the smallest size's time in every row of the (op, group)
        r["latency_us"] = next(x["time_us"] for x in rows if (x["op"], x["group"], x["bytes"]) ==
                               (r["op"], r["group"], 1024))
    got, where = calibrate(ClusterSpec(device="cpu"), {"bandwidth": rows}, "r.json")
    # Latencies per op and size: tp and dp median (100 + 140) / 2 = 120; the world 900; sendrecv 50.
    assert got.collective_latency_us == (("all_reduce", 2, 120.0), ("all_reduce", 8, 900.0), ("send_recv", 2, 50.0))
    # Bandwidth: 200,000 B beyond the smallest in 100 us (tp: factor 1, 2 GB/s), in 100 us (dp: 2 GB/s)
    # and in 100 us (sendrecv, factor 1: 2 GB/s); the world's largest size was faster than its smallest
    # (a latency-bound sweep): it says nothing about bandwidth and is left out.
    assert got.intra_node_gbps == pytest.approx(2.0)
    assert where["intra_node_gbps"] == "r.json: median busbw of 3 intra-node row(s) above the smallest size (alpha-beta)"
    assert got.intra_node_latency_us == pytest.approx(120.0)  # the median of 100, 140, 900, 50


def test_a_ring_shift_over_more_than_two_ranks_is_two_pair_transfers_on_the_cpu_device():
    model = ModelSpec(num_layers=2, hidden_size=4, num_attention_heads=2, seq_length=8, vocab_size=0)
    train = TrainingSpec(global_batch_size=1, sequence_parallel=False)  # ring attention (the default)
    composed, native = cluster(device="cpu", cores_per_node=4), cluster()  # a core per rank: not slowed
    # cp = 4, one micro-batch of 2 layers: (cp - 1) shifts forward and cp backward per layer, 14 in all;
    # on the cpu device each is two 2-rank transfers in turn: 14 more latencies of 10 us.
    four = [step_time(model, train, c, tp=1, cp=4, pp=1, dp=1)["breakdown"]["cp_s"] for c in (composed, native)]
    assert four[0] - four[1] == pytest.approx(14 * 10e-6)
    # cp = 2: one exchange with the one neighbour, the same on both.
    two = [step_time(model, train, c, tp=1, cp=2, pp=1, dp=1)["breakdown"]["cp_s"] for c in (composed, native)]
    assert two[0] == pytest.approx(two[1])


# ------------------------------------------------------------------ ranks sharing cores (the cpu preset)
def test_oversubscription_is_ranks_over_cores_and_only_where_cores_are_shared(monkeypatch):
    monkeypatch.setenv("MSDIST_CPU_CORES", "2")
    cpu = ClusterSpec(device="cpu")
    assert cpu.cores_per_node == 2 and cpu.op_overhead_us == DEVICE_PRESETS["cpu"]["op_overhead_us"]
    assert [cpu.oversubscription(n) for n in (1, 2, 3, 4, 8)] == [1.0, 1.0, 1.5, 2.0, 4.0]
    assert ClusterSpec(device="cpu", cores_per_node=8).oversubscription(8) == 1.0
    # Accelerators: a device per rank, never slowed, no launch cost.
    gpu = ClusterSpec(device="h100-80gb")
    assert (gpu.cores_per_node, gpu.op_overhead_us, gpu.oversubscription(1024)) == (None, 0.0, 1.0)
    monkeypatch.setenv("MSDIST_CPU_CORES", "two")
    with pytest.raises(ModelError, match="MSDIST_CPU_CORES='two' is invalid: expected a whole number of cores"):
        ClusterSpec(device="cpu")
    monkeypatch.delenv("MSDIST_CPU_CORES")
    import os

    assert ClusterSpec(device="cpu").cores_per_node == len(os.sched_getaffinity(0))
    with pytest.raises(ModelError, match="cores_per_node=0 is invalid"):
        ClusterSpec(cores_per_node=0)
    with pytest.raises(ModelError, match="op_overhead_us=-1 is invalid: expected a finite number >= 0"):
        ClusterSpec(op_overhead_us=-1)


def test_four_ranks_on_two_cores_take_twice_as_long_as_two():
    # TOY at tp2 x dp2 (4 ranks), one micro-batch each: 2 layers x 4,096 FLOPs / 2 (tp) forward, x3 with the
    # backward: 12,288 FLOPs at 1 TFLOP/s; operators (2 x 24 + 2 x 8) forward, twice that backward, and AdamW's
    # 12 per tensor of the rank (2 x 12 + 3: the layers, the positions, the final norm): (64 + 128 + 324) x 100 us.
    training = TrainingSpec(global_batch_size=2, sequence_parallel=False, precision="fp32",
                            overlap_grad_reduce=False)
    host = cluster(cores_per_node=2, op_overhead_us=100)
    alone = step_time(TOY, training, host, tp=2, cp=1, pp=1, dp=2, ranks_per_node=2)
    shared = step_time(TOY, training, host, tp=2, cp=1, pp=1, dp=2, ranks_per_node=4)
    assert alone["operators"] == {"forward": 64, "backward": 128, "optimizer": 324}
    assert alone["oversubscription"] == 1.0 and shared["oversubscription"] == 2.0
    assert alone["breakdown"]["compute_s"] == pytest.approx(12_288 / 1e12 + (64 + 128 + 324) * 100e-6)
    # tp: 4 all-reduces x 2 layers of s*b*h*4 = 128 bytes (x 2(2-1)/2 sent) at 1 GB/s; on a host whose ranks
    # share cores each ring all-reduce is 2(n - 1) = 2 hops of 10 us (steptime.ring_steps).
    assert alone["breakdown"]["tp_s"] == pytest.approx(8 * (2 * 10e-6 + 128 / 1e9))
    # Sharing 2 cores among 4 ranks: the compute, the launches and every collective take twice as long.
    for term in ("compute_s", "tp_s", "dp_s"):
        assert shared["breakdown"][term] == pytest.approx(2 * alone["breakdown"][term]) and alone["breakdown"][term] > 0
    assert shared["step_time_s"] == pytest.approx(2 * alone["step_time_s"])
    # The same world on accelerators (no cores_per_node): nothing slowed, no launches priced.
    device = step_time(TOY, training, cluster(), tp=2, cp=1, pp=1, dp=2, ranks_per_node=4)
    assert device["breakdown"]["compute_s"] == pytest.approx(12_288 / 1e12)


def test_the_cpu_preset_prices_the_ranks_of_one_node(monkeypatch):
    # estimate: the layout's devices_per_node decides how many ranks share a node's cores.
    monkeypatch.setenv("MSDIST_CPU_CORES", "2")
    workload = Workload(model=TOY, training=TrainingSpec(global_batch_size=8), cluster=ClusterSpec(device="cpu"))
    one_node = estimate(Layout(world_size=8, devices_per_node=8), workload)["time"]
    two_nodes = estimate(Layout(world_size=8, devices_per_node=4), workload)["time"]
    assert (one_node["oversubscription"], two_nodes["oversubscription"]) == (4.0, 2.0)
    assert one_node["breakdown"]["compute_s"] == pytest.approx(2 * two_nodes["breakdown"]["compute_s"])


def test_new_training_and_cluster_keys_parse_and_validate(tmp_path):
    from mindscience.distributed.costmodel.errors import ModelFileError
    from mindscience.distributed.costmodel.spec import section_from_mapping

    got = section_from_mapping("training", {"overlap_param_gather": True, "reshard_after_forward": False,
                                            "fsdp_prefetch": False}, "m.yaml")
    assert (got.overlap_param_gather, got.reshard_after_forward, got.fsdp_prefetch) == (True, False, False)
    default = TrainingSpec()
    assert (default.overlap_param_gather, default.reshard_after_forward, default.fsdp_prefetch) == (False, True, True)
    for key in ("overlap_param_gather", "reshard_after_forward", "fsdp_prefetch"):
        with pytest.raises(ModelFileError, match=f"key 'training.{key}' has value 'yes' \\(str\\): expected true or false"):
            section_from_mapping("training", {key: "yes"}, "m.yaml")
        with pytest.raises(ModelError, match=f"{key}=1 is invalid: expected true or false"):
            TrainingSpec(**{key: 1})
    host = section_from_mapping("cluster", {"device": "cpu", "cores_per_node": 16, "op_overhead_us": 250},
                                "m.yaml")
    assert (host.cores_per_node, host.op_overhead_us) == (16, 250)
    with pytest.raises(ModelFileError, match="m.yaml: cluster.cores_per_node=0 is invalid"):
        section_from_mapping("cluster", {"cores_per_node": 0}, "m.yaml")
