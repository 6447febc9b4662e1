"""The report of a training run: its steps, and what it measured beside what the cost model predicted.

Pure Python (no MindSpore): ``msdist train`` builds it in the parent from the ranks'
records and :func:`mindscience.distributed.costmodel.estimate` of the same layout, model
and training options. JSON keys (``msdist train --format json``)::

    {"ok", "layout", "model", "training",
     "steps":     [{"step", "loss", "time_s", "tokens_per_s", "mfu"
                   [, "aux_loss", "max_load", "dropped_tokens": a MoE model's]}, ...],
     "measured":  {"step_time_s", "tokens_per_s", "mfu", "memory": [per stage]},
     "predicted": {"step_time_s", "tokens_per_s", "mfu", "memory": [per stage]},
     "comparison": [{"what", "stage", "measured", "predicted", "ratio"}, ...], ...}

``step`` counts on across resumes. The measured step time is the median of the steps
after the first (the first also compiles); with one step, that step. Memory per pipeline
stage: weights, gradients and optimizer state counted from the Parameters of every rank
of the stage (the largest rank: zero-padded shards differ by a row), the activations as
the cost model estimates them (CPU memory counters read 0, so they are not measured).

Example: two steps of 0.5 s and 0.25 s of 4096 tokens each on 4 ranks of 1 TFLOP/s::

    >>> rows = step_rows([(1, 2.0, 0.5), (2, 1.5, 0.25)], tokens_per_step=4096,
    ...                  flops_per_step=1e12, world_size=4, peak_tflops=1.0)
    >>> [(r["step"], r["tokens_per_s"], r["mfu"]) for r in rows]
    [(1, 8192.0, 0.5), (2, 16384.0, 1.0)]
    >>> steady_step_time([r["time_s"] for r in rows])
    0.25
"""

from __future__ import annotations

from statistics import median

MEMORY_KINDS = ("weights", "gradients", "optimizer")


def steady_step_time(times: list) -> float:
    """The median step time without the first step (which compiles), or the only one."""
    if not times:
        raise ValueError("no step was timed: a run trains at least one step.")
    return float(median(times[1:] if len(times) > 1 else times))


# A MoE model's step statistics (Trainer.moe_step): the aux loss, max/mean tokens per
# expert (the busiest layer) and the assignments dropped by capacity.
MOE_KEYS = ("aux_loss", "max_load", "dropped_tokens")


def step_rows(steps, tokens_per_step: int, flops_per_step: float, world_size: int,
              peak_tflops: float, moe: dict | None = None) -> list:
    """``[(step, loss, seconds)]`` -> the report's ``steps`` rows with tokens/s and MFU
    (and ``moe[step]``'s keys, :func:`moe_by_step`, for a MoE model)."""
    rows = []
    for step, loss, seconds in steps:
        rate = tokens_per_step / seconds if seconds > 0 else 0.0
        mfu = flops_per_step / seconds / (world_size * peak_tflops * 1e12) if seconds > 0 else 0.0
        rows.append({"step": int(step), "loss": float(loss), "time_s": float(seconds), "tokens_per_s": rate,
                     "mfu": mfu, **((moe or {}).get(int(step)) or {})})
    return rows


def moe_by_step(rank_steps: dict) -> dict:
    """``{step: {"aux_loss", "max_load", "dropped_tokens"}}`` from :func:`collect`'s
    ``steps`` (every rank reports the same values; the first rank's are taken); empty
    for a dense model.

        >>> moe_by_step({0: [{"step": 1, "loss": 5.0, "time_s": 0.5, "aux_loss": 0.02,
        ...                   "max_load": 1.5, "dropped_tokens": 0}]})
        {1: {'aux_loss': 0.02, 'max_load': 1.5, 'dropped_tokens': 0}}
    """
    out: dict = {}
    for rank in sorted(rank_steps):
        for row in rank_steps[rank]:
            if row.get("aux_loss") is not None and row["step"] not in out:
                out[row["step"]] = {k: row[k] for k in MOE_KEYS if k in row}
    return out


def merge_rank_steps(rank_steps: dict) -> list:
    """Every rank's ``[{"step", "loss", "time_s"}]`` -> ``[(step, loss, slowest seconds)]``.

    The loss is the one the ranks agree on (each rank reports the global batch's loss);
    a rank that reports None (it holds no loss) is skipped for it.

    Raises:
        ValueError: two ranks report different losses for one step (the run is broken).
    """
    merged: dict = {}
    for rank in sorted(rank_steps):
        for row in rank_steps[rank]:
            entry = merged.setdefault(row["step"], {"loss": None, "time": 0.0, "rank": rank})
            entry["time"] = max(entry["time"], float(row["time_s"]))
            loss = row.get("loss")
            if loss is None:
                continue
            if entry["loss"] is None:
                entry["loss"], entry["rank"] = float(loss), rank
            elif abs(entry["loss"] - loss) > 1e-6 * max(1.0, abs(loss)):
                raise ValueError(f"step {row['step']}: rank {rank} reports loss {loss}, rank {entry['rank']} "
                                 f"{entry['loss']}: the ranks disagree on the global batch's loss.")
    return [(step, entry["loss"], entry["time"]) for step, entry in sorted(merged.items())]


def finished_steps(rank_steps: dict, ranks) -> list:
    """The steps every rank of ``ranks`` has finished, as :func:`merge_rank_steps` gives them.

    ``rank_steps`` is :func:`collect`'s ``steps`` of the records so far (the harness
    snapshot's ranks during a run), so a step's line can be shown as soon as the slowest
    rank has reported it, with the same numbers as the final report.

        >>> finished_steps({0: [{"step": 1, "loss": 5.0, "time_s": 0.5},
        ...                     {"step": 2, "loss": 4.0, "time_s": 0.2}],
        ...                 1: [{"step": 1, "loss": 5.0, "time_s": 0.7}]}, ranks=[0, 1])
        [(1, 5.0, 0.7)]

    Raises:
        ValueError: two ranks report different losses for one step.
    """
    ranks = list(ranks)
    if not ranks or any(not rank_steps.get(r) for r in ranks):
        return []
    common = set.intersection(*({row["step"] for row in rank_steps[r]} for r in ranks))
    return merge_rank_steps({r: [row for row in rank_steps[r] if row["step"] in common] for r in ranks})


def measured_memory(rank_memory: dict) -> list:
    """``{rank: {"stage", "weights", "gradients", "optimizer"}}`` -> one row per stage.

    Each row holds the largest rank of the stage (``*_bytes``) and how many ranks it has.
    """
    stages: dict = {}
    for rank in sorted(rank_memory):
        mem = rank_memory[rank]
        row = stages.setdefault(int(mem["stage"]), {"stage": int(mem["stage"]), "ranks": 0,
                                                    **{f"{k}_bytes": 0 for k in MEMORY_KINDS}})
        row["ranks"] += 1
        for kind in MEMORY_KINDS:
            row[f"{kind}_bytes"] = max(row[f"{kind}_bytes"], int(mem[kind]))
    return [stages[s] for s in sorted(stages)]


def predicted_memory(estimate: dict) -> list:
    """The cost model's per-stage rows, reduced to what the run can be compared with."""
    keys = [f"{k}_bytes" for k in MEMORY_KINDS] + ["activations_bytes"]
    return [{"stage": s["stage"], "layers": s["layers"], **{k: s[k] for k in keys}}
            for s in estimate["memory"]["stages"]]


def ratio(measured, predicted):
    """``measured / predicted``, None when either is missing or the prediction is 0."""
    if measured is None or predicted in (None, 0):
        return None
    return measured / predicted


def comparison_rows(measured: dict, predicted: dict) -> list:
    """Rows of the measured-vs-predicted table: step time, tokens/s, then per stage the bytes."""
    rows = [{"what": "step time (s)", "stage": None, "measured": measured["step_time_s"],
             "predicted": predicted["step_time_s"]},
            {"what": "tokens/s", "stage": None, "measured": measured["tokens_per_s"],
             "predicted": predicted["tokens_per_s"]}]
    got = {row["stage"]: row for row in measured["memory"]}
    for want in predicted["memory"]:
        have = got.get(want["stage"], {})
        for kind in (*MEMORY_KINDS, "activations"):
            key = f"{kind}_bytes"
            rows.append({"what": f"{kind} (bytes)", "stage": want["stage"], "measured": have.get(key),
                         "predicted": want[key]})
    for row in rows:
        row["ratio"] = ratio(row["measured"], row["predicted"])
    return rows


def build_report(*, layout: dict, model: dict, training: dict, steps: list, rank_memory: dict,
                 estimate: dict, tokens_per_step: int, world_size: int, peak_tflops: float,
                 extra: dict | None = None) -> dict:
    """The whole report (see the module docstring) from merged steps and the estimate.

    Args:
        layout, model, training: Echoed as they are (plain dicts).
        steps: :func:`step_rows` output.
        rank_memory: ``{rank: {"stage", "weights", "gradients", "optimizer"}}``.
        estimate: :func:`mindscience.distributed.costmodel.estimate` of the same run.
        tokens_per_step: ``global_batch_size * seq_length``.
        world_size: Ranks of the run.
        peak_tflops: Peak of one device (the MFU denominator).
        extra: More top-level keys (log folder, resume, checkpoints).
    """
    seconds = steady_step_time([s["time_s"] for s in steps])
    flops = estimate["time"].get("model_flops_per_step") or 0.0
    measured = {"step_time_s": seconds, "tokens_per_s": tokens_per_step / seconds if seconds > 0 else 0.0,
                "mfu": flops / seconds / (world_size * peak_tflops * 1e12) if seconds > 0 else 0.0,
                "steps_timed": max(1, len(steps) - 1), "memory": measured_memory(rank_memory)}
    time = estimate["time"]
    predicted = {"step_time_s": time["step_time_s"], "tokens_per_s": time["tokens_per_s"], "mfu": time["mfu"],
                 "breakdown": time["breakdown"], "memory": predicted_memory(estimate)}
    report = {"ok": all(s["loss"] == s["loss"] for s in steps), "layout": layout, "model": model,
              "training": training, "steps": steps, "measured": measured, "predicted": predicted,
              "comparison": comparison_rows(measured, predicted)}
    report.update(extra or {})
    return report


def collect(ranks: dict) -> dict:
    """The training records of every rank's result (the harness's ``rank_<r>.json``).

    Returns:
        ``{"steps": {rank: [{"step", "loss", "time_s"}]}, "memory": {rank: {...}},
        "setup": {rank: record}, "saved": [directories]}``.
    """
    out = {"steps": {}, "memory": {}, "setup": {}, "saved": []}
    for rank, state in sorted(ranks.items()):
        for record in (state or {}).get("records", []):
            name = record.get("check")
            if name == "train.step" and not record.get("skipped"):
                out["steps"].setdefault(int(rank), []).append(
                    {"step": record["train_step"], "loss": record["loss"], "time_s": record["time_s"],
                     **{k: record[k] for k in MOE_KEYS if k in record}})
            elif name == "train.setup":
                out["setup"][int(rank)] = record
            elif name == "train.finish":
                out["memory"][int(rank)] = record["memory"]
                if int(rank) == 0:
                    out["saved"] = list(record.get("saved") or [])
    return out
