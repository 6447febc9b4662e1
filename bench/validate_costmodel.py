"""The step-time model against published training runs (docs/COST_MODEL.md, "Validation").

For each run whose paper gives the model, the layout, the batch, the hardware and the
measured throughput, this prints the throughput the cost model predicts for exactly that
configuration (the device preset, its default ``compute_efficiency`` of 0.5, nothing
fitted) with the published system's schedule (the pure ``step_time``: its overlap, no
pipeline re-run), the same priced as this library runs it (``what_runs``: its PyNative
runtime's overlap, FSDP units and pipeline, as ``plan --model`` prices it), and where the
published layout ranks among the layouts ``msdist suggest`` tries for the same world,
model, batch and micro-batch size.

Run:  python bench/validate_costmodel.py        (pure Python, about a minute; no MindSpore)

Published figures: Korthikanti et al. 2022 (arXiv 2205.05198) Tables 3 and 5 (MFU,
A100 80GB, d = 1 and the 530B d = 8 run); Narayanan et al. 2021 (arXiv 2104.04473)
Table 1 (TFLOP/s per GPU counted with Eq. 3, i.e. including the recomputed forward;
micro-batch and interleaving from its run script); Llama 3 (arXiv 2407.21783) Table 4
(TFLOP/s per H100, BF16 MFU).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mindscience.distributed.costmodel import suggest  # noqa: E402
from mindscience.distributed.costmodel.comm import crossing_flags  # noqa: E402
from mindscience.distributed.costmodel.runtime import what_runs  # noqa: E402
from mindscience.distributed.costmodel.spec import ClusterSpec, ModelSpec, TrainingSpec, Workload  # noqa: E402
from mindscience.distributed.costmodel.steptime import step_time  # noqa: E402
from mindscience.distributed.topology import Layout  # noqa: E402


def gpt(layers, hidden, heads, seq=2048, vocab=51200, **kw):
    return ModelSpec(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=seq,
                     vocab_size=vocab, **kw)


# (label, model, (tp, cp, pp, dp), training, device, published value, metric, source)
# metric "mfu": model FLOPs utilisation; "tflops_hw": Narayanan's Eq. 3 FLOPs (with the
# recomputed forward) per second and GPU; "tflops": model FLOPs per second and GPU.
KORTHIKANTI = dict(sequence_parallel=True, recompute="selective")
LLAMA3 = gpt(126, 16384, 128, seq=8192, vocab=128256, num_query_groups=8, ffn_hidden_size=53248,
             normalization="rmsnorm", activation="swiglu", position_embedding="rope", tie_embeddings=False,
             bias=False)
LLAMA3_TRAINING = dict(sequence_parallel=True, recompute="none", zero_stage=3,
                       account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
BLOOM = gpt(70, 14336, 112, vocab=250880, position_embedding="rope")  # ALiBi: no position parameters
NARAYANAN = dict(sequence_parallel=False, recompute="full")
RUNS = [
    ("22B, 8 A100", gpt(48, 6144, 64), (8, 1, 1, 1), dict(micro_batch_size=4, global_batch_size=4, **KORTHIKANTI),
     "a100-80gb", 0.415, "mfu", "K22 Table 5"),
    ("175B, 64 A100", gpt(96, 12288, 96), (8, 1, 8, 1),
     dict(global_batch_size=64, virtual_pipeline_stages=3, **KORTHIKANTI), "a100-80gb", 0.514, "mfu", "K22 Table 5"),
    ("530B, 280 A100", gpt(105, 20480, 128), (8, 1, 35, 1),
     dict(global_batch_size=280, virtual_pipeline_stages=3, **KORTHIKANTI), "a100-80gb", 0.560, "mfu", "K22 Table 5"),
    ("1T, 512 A100", gpt(128, 25600, 160), (8, 1, 64, 1), dict(global_batch_size=512, **KORTHIKANTI),
     "a100-80gb", 0.563, "mfu", "K22 Table 5"),
    ("530B, 2240 A100 (d=8)", gpt(105, 20480, 128), (8, 1, 35, 8),
     dict(global_batch_size=2240, virtual_pipeline_stages=3, **KORTHIKANTI), "a100-80gb", 0.542, "mfu",
     "K22 sec. 6"),
    ("1.7B, 32 A100", gpt(24, 2304, 24), (1, 1, 1, 32), dict(micro_batch_size=16, global_batch_size=512, **NARAYANAN),
     "a100-80gb", 137, "tflops_hw", "N21 Table 1"),
    ("18.4B, 256 A100", gpt(40, 6144, 48), (8, 1, 1, 32), dict(micro_batch_size=8, global_batch_size=1024, **NARAYANAN),
     "a100-80gb", 135, "tflops_hw", "N21 Table 1"),
    ("39.1B, 512 A100", gpt(48, 8192, 64), (8, 1, 2, 32), dict(micro_batch_size=4, global_batch_size=1536, **NARAYANAN),
     "a100-80gb", 138, "tflops_hw", "N21 Table 1"),
    ("145.6B, 1536 A100", gpt(80, 12288, 96), (8, 1, 8, 24),
     dict(micro_batch_size=2, global_batch_size=2304, virtual_pipeline_stages=2, **NARAYANAN), "a100-80gb", 148,
     "tflops_hw", "N21 Table 1"),
    ("310.1B, 1920 A100", gpt(96, 16384, 128), (8, 1, 16, 15),
     dict(global_batch_size=2160, virtual_pipeline_stages=2, **NARAYANAN), "a100-80gb", 155, "tflops_hw",
     "N21 Table 1"),
    ("1T, 3072 A100", gpt(128, 25600, 160), (8, 1, 64, 6), dict(global_batch_size=3072, **NARAYANAN),
     "a100-80gb", 163, "tflops_hw", "N21 Table 1"),
    # Llama 3 405B: GQA (8 k/v heads), RMSNorm, SwiGLU 53,248 wide, RoPE, untied, no biases; 126 layers on
    # 16 stages with the embedding and the loss counted as layers (7, 8 x 14, 7); FSDP-style sharding of
    # weights, gradients and optimizer state over dp (zero_stage 3).
    ("Llama 3 405B, 8192 H100", LLAMA3, (8, 1, 16, 64), dict(global_batch_size=2048, **LLAMA3_TRAINING),
     "h100-80gb", 430, "tflops", "Llama 3 Table 4"),
    ("Llama 3 405B, 16384 H100", LLAMA3, (8, 1, 16, 128), dict(global_batch_size=2048, **LLAMA3_TRAINING),
     "h100-80gb", 400, "tflops", "Llama 3 Table 4"),
    # BLOOM 176B: 70 layers on 12 stages, embedding and loss counted (5, 6 x 10, 5); ALiBi (no position
    # parameters), GeLU, tied; ZeRO-1; micro-batch 2 of 2,048 sequences; ~150 TFLOP/s per A100.
    ("BLOOM 176B, 384 A100", BLOOM, (4, 1, 12, 8),
     dict(micro_batch_size=2, global_batch_size=2048, sequence_parallel=False, recompute="full", zero_stage=1,
          account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True),
     "a100-80gb", 150, "tflops_hw", "BigScience model card"),
]


def hardware_flops_eq3(model: ModelSpec, samples: int) -> float:
    """Narayanan et al. 2021, Eq. 3: ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` per step."""
    s, l, h, v = model.seq_length, model.num_layers, model.hidden_size, model.vocab_size
    return 96 * samples * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def predict(model, sizes, training, device, library: bool = False):
    """The step time of the published configuration: as published (``library`` False) or as this library runs it."""
    tp, cp, pp, dp = sizes
    layout = Layout(world_size=tp * cp * pp * dp, tp=tp, cp=cp, pp=pp, devices_per_node=8)
    cluster = ClusterSpec(device=device)
    runtime = None
    if library:
        training, runtime, _ = what_runs(training, tp, cp, pp, dp)
    return step_time(model, training, cluster, tp, cp, pp, dp, crossing=crossing_flags(layout),
                     runtime=runtime, ranks_per_node=8), cluster


def metric_value(metric, model, training, timing, world):
    if metric == "mfu":
        return timing["mfu"]
    if metric == "tflops_hw":
        return hardware_flops_eq3(model, training.global_batch_size) / timing["step_time_s"] / world / 1e12
    return timing["model_flops_per_step"] / timing["step_time_s"] / world / 1e12


def rank_of(model, sizes, training, device) -> tuple[int, int, dict]:
    """(1-based rank of the published sizes, candidates that fit, the best) in ``suggest`` at the same batch.

    Rank 0: the cost model's memory estimate says the published layout does not fit.
    """
    tp, cp, pp, dp = sizes
    world = tp * cp * pp * dp
    cluster = ClusterSpec(device=device)
    result = suggest(Workload(model=model, training=training, cluster=cluster), world, devices_per_node=8)
    ranked = [(c["tp"], c["cp"], c["pp"], c["dp"]) for c in result["candidates"]]
    best = result["candidates"][0] if ranked else None
    return (ranked.index(sizes) + 1 if sizes in ranked else 0), len(ranked), best


def main() -> int:
    print("| run | layout tp·cp·pp·dp (v) | published | predicted | predicted / published | "
          "as this library runs it | / published | published layout's rank in suggest | suggest's first |")
    print("|---|---|---|---|---|---|---|---|---|")
    ratios, library_ratios = [], []
    for label, model, sizes, train_kw, device, published, metric, source in RUNS:
        training = TrainingSpec(**train_kw)
        world = sizes[0] * sizes[1] * sizes[2] * sizes[3]
        timing, _ = predict(model, sizes, training, device)
        value = metric_value(metric, model, training, timing, world)
        library, _ = predict(model, sizes, training, device, library=True)
        here = metric_value(metric, model, training, library, world)
        if metric == "mfu":
            shown = (f"MFU {published:.1%}", f"MFU {value:.1%}", f"MFU {here:.1%}")
        else:
            shown = (f"{published:g} TFLOP/s", f"{value:.0f} TFLOP/s", f"{here:.0f} TFLOP/s")
        ratios.append(value / published)
        library_ratios.append(here / published)
        rank, total, best = rank_of(model, sizes, training, device)
        v = training.virtual_pipeline_stages
        tp, cp, pp, dp = sizes
        first = f"{best['tp']}·{best['cp']}·{best['pp']}·{best['dp']}" if best else "none fits (memory model)"
        print(f"| {label} ({source}) | {tp}·{cp}·{pp}·{dp}" + (f" (v={v})" if v > 1 else "")
              + f" | {shown[0]} | {shown[1]} | {ratios[-1]:.2f} | {shown[2]} | {library_ratios[-1]:.2f} | "
              f"{rank or '-'} of {total} | {first} |")
    for name, values in (("predicted", ratios), ("as this library runs it", library_ratios)):
        mean = sum(values) / len(values)
        print(f"\nmean {name} / published: {mean:.2f} (min {min(values):.2f}, max {max(values):.2f})", end="")
    print("; device presets with compute_efficiency 0.5, nothing fitted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
