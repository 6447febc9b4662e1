"""The cost model against published mixture-of-experts training runs (issue 36; docs/COST_MODEL.md).

Pure Python, no device. For each run whose source gives the model, the layout, the batch and the
hardware, it prices exactly that configuration with the bundled preset (or the model shape written
below) and prints the published figure beside the predicted one: nothing is fitted to these runs.

Run:  python bench/validate_moe.py
"""

from __future__ import annotations

from dataclasses import replace

from mindscience.distributed.costmodel import ModelSpec, TrainingSpec, Workload, estimate, load_workload
from mindscience.distributed.costmodel.spec import ClusterSpec
from mindscience.distributed.costmodel.steptime import model_flops_per_sample
from mindscience.distributed.models.config import resolve_model_file
from mindscience.distributed.topology import Layout

GIB = 1024**3

# Qwen3-235B-A22B as Megatron-core recipes pass it (94 layers, hidden 4096, 64 heads in 4 groups,
# 128 experts of 1536, top-8, vocabulary 151,936, untied); the 128-channel heads are 64 here.
QWEN3_235B = ModelSpec(
    name="qwen3-235b-a22b", num_layers=94, hidden_size=4096, num_attention_heads=64, num_query_groups=4,
    ffn_hidden_size=12288, seq_length=4096, vocab_size=151936, normalization="rmsnorm", activation="swiglu",
    position_embedding="rope", tie_embeddings=False, bias=False, num_moe_experts=128, moe_router_topk=8,
    moe_ffn_hidden_size=1536)


def deepseek_v3() -> list[str]:
    """DeepSeek-V3 technical report: 2048 H800, pp16 x ep64, ZeRO-1, 180K GPU hours per trillion tokens."""
    w = load_workload(resolve_model_file("deepseek-v3"))
    # 61 layers on 16 stages: the last stage (which also holds the MTP module and the head) one layer.
    w = replace(w, training=replace(w.training, last_stage_layers=1, recompute="selective"))
    layout = Layout(world_size=2048, pp=16, ep=64, etp=1, devices_per_node=8)
    r = estimate(layout, w)
    t, b = r["time"], r["time"]["breakdown"]
    hours = 1e12 / t["tokens_per_s"] / 3600 * 2048
    hidden = t["step_time_s"] - b["ep_s"]  # DualPipe overlaps the all-to-all with compute
    hours_hidden = hours * hidden / t["step_time_s"]
    return [
        f"| DeepSeek-V3, 2048 H800, pp16 x ep64, ZeRO-1 | 180K GPU-h / 1T tokens | {hours / 1e3:.0f}K "
        f"(all-to-all exposed {b['ep_s']:.1f} s of {t['step_time_s']:.1f} s); {hours_hidden / 1e3:.0f}K with it "
        f"hidden | {hours / 180e3:.2f} / {hours_hidden / 180e3:.2f} | peak {r['memory']['peak_bytes'] / GIB:.0f} GiB "
        "per rank (the run fits 80 GB) |"]


def qwen3_235b() -> list[str]:
    """Megatron-MoE-ModelZoo, Qwen3 best practice: 256 H100, tp2 ep8 pp1 dp128 (FSDP), mbs4, full recompute."""
    training = TrainingSpec(micro_batch_size=4, global_batch_size=2048, precision="bf16", zero_stage=3,
                            recompute="full", sequence_parallel=True)
    w = Workload(model=QWEN3_235B, training=training, cluster=ClusterSpec(device="h100-80gb", inter_node_gbps=50))
    r = estimate(Layout(world_size=256, tp=2, ep=8, etp=1, devices_per_node=8), w)
    t = r["time"]
    # Megatron's TFLOP/s count the recomputed forward (full recomputation: 4 passes instead of 3).
    tflops = model_flops_per_sample(QWEN3_235B) * 4 / 3 * 2048 / t["step_time_s"] / 256 / 1e12
    return [f"| Qwen3-235B-A22B, 256 H100, tp2 x ep8 x dp128 (FSDP), mbs 4, full recompute | 17.6 s, 276 TFLOP/s "
            f"| {t['step_time_s']:.1f} s, {tflops:.0f} TFLOP/s | {17.6 / t['step_time_s']:.2f} (speed) | "
            f"peak {r['memory']['peak_bytes'] / GIB:.0f} GiB |"]


def main() -> None:
    print("| run | published | predicted | predicted / published | note |")
    print("|---|---|---|---|---|")
    for line in deepseek_v3() + qwen3_235b():
        print(line)


if __name__ == "__main__":
    main()
