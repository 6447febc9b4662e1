"""Rendering of the cost model: memory and communication tables (``plan --model``), ``suggest``.

Like :mod:`mscli.render`, these functions take the plain data the commands computed.
"""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from .render import HEAD_ROWS, _elided, stderr_console, stdout_console

GIB = 1024**3
MIB = 1024**2


def human_bytes(n: float) -> str:
    """``1.5 GiB``, ``312 MiB``, ``0 B``."""
    if n >= GIB:
        return f"{n / GIB:.1f} GiB"
    if n >= MIB:
        return f"{n / MIB:.0f} MiB"
    return f"{n:.0f} B" if n < 1024 else f"{n / 1024:.0f} KiB"


def human_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


def human_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} us"


def _fits(ok: bool) -> Text:
    return Text("yes", style="green") if ok else Text("NO", style="bold red")


def memory_table(estimate: dict, show_all: bool = False) -> Table:
    model, memory = estimate["model"], estimate["memory"]
    training = model["training"]
    device = memory["device_memory_bytes"]
    title = (f"memory per rank: {model['name']} ({human_count(model['parameters'])} parameters), "
             f"{training['precision']}, recompute {training['recompute']}, "
             f"{'' if training['sequence_parallel'] else 'no '}sequence parallel, "
             f"{'distributed' if training['distributed_optimizer'] else 'replicated'} optimizer, "
             f"{model['num_microbatches']} micro-batches/step; device {human_bytes(device)}")
    table = Table(title=title, title_justify="left", caption_justify="left", show_edge=False, pad_edge=False)
    for column in ("stage", "layers", "params", "weights", "grads", "optimizer", "activations",
                   "comm buffers", "total", "fits"):
        table.add_column(column, justify="left" if column == "fits" else "right", no_wrap=True)
    first, hidden, last = _elided(memory["stages"], HEAD_ROWS // 2, show_all)

    def add(s):
        table.add_row(
            str(s["stage"]), str(s["layers"]), human_count(s["parameters"]),
            *(human_bytes(s[k]) for k in ("weights_bytes", "gradients_bytes", "optimizer_bytes",
                                          "activations_bytes", "communicator_bytes", "total_bytes")),
            _fits(s["total_bytes"] <= device),
        )

    for stage in first:
        add(stage)
    if hidden:
        table.add_row("...", f"{hidden} more stages (use --all)", *[""] * 8, style="dim")
    for stage in last:
        add(stage)
    verdict = "fits" if memory["fits"] else "does NOT fit"
    table.caption = (f"peak {human_bytes(memory['peak_bytes'])} per rank {verdict} in "
                     f"{human_bytes(device)}; activations: Korthikanti et al. 2022 with 1F1B "
                     "micro-batches in flight (docs/COST_MODEL.md)")
    return table


def communication_table(estimate: dict, cluster: dict) -> Table:
    comm = estimate["communication"]
    table = Table(title="communication per step (busiest rank; ring bus factors as nccl-tests; no overlap)",
                  title_justify="left", caption_justify="left", show_edge=False, pad_edge=False)
    for column, justify in (("group", "left"), ("op", "left"), ("n", "right"), ("calls", "right"),
                            ("message", "right"), ("sent", "right"), ("link", "left"), ("est time", "right")):
        table.add_column(column, justify=justify, no_wrap=True)
    for row in comm["per_step"]:
        link = (Text(f"inter-node {cluster['inter_node_gbps']:g} GB/s", style="yellow") if row["crosses_nodes"]
                else f"intra-node {cluster['intra_node_gbps']:g} GB/s")
        table.add_row(row["group"], row["op"], str(row["group_size"]), str(row["count"]),
                      human_bytes(row["message_bytes"]), human_bytes(row["bytes"]), link,
                      human_seconds(row["est_time_s"]))
    if comm["bottleneck"]:
        table.caption = (f"total {human_seconds(comm['est_time_s'])} per step; bottleneck: "
                         f"{comm['bottleneck']}; pipeline bubble (pp-1)/m = "
                         f"{estimate['model']['pipeline_bubble']:.1%}")
    else:
        table.caption = "no communication: every axis has size 1"
    return table


def cost_view(data: dict, show_all: bool = False) -> list:
    """The renderables ``msdist plan --model`` adds (nothing without a model)."""
    if "memory" not in data:
        return []
    return [memory_table(data, show_all), communication_table(data, data["model"]["cluster"])]


def _rejected_text(result: dict) -> str:
    return ", ".join(f"{reason}: {n}" for reason, n in sorted(result["rejected"].items(), key=lambda kv: -kv[1]))


def render_suggest(result: dict, model_name: str) -> None:
    """The ranked candidates; nothing when none fits (:func:`nothing_fits_message` says why)."""
    candidates = result["candidates"]
    if not candidates:
        return
    nodes = result["world_size"] // result["devices_per_node"]
    title = (f"msdist suggest: {model_name} on {result['world_size']} devices ({nodes} node(s) x "
             f"{result['devices_per_node']}), {human_bytes(result['device_memory_bytes'])} per device: "
             f"{result['valid']} layout(s) fit, best {len(candidates)} shown")
    table = Table(title=title, title_justify="left", caption_justify="left", show_edge=False, pad_edge=False)
    for column in ("#", "tp", "cp", "dp", "pp", "order", "peak/rank", "fits", "comm/step", "bottleneck",
                   "bubble", "crosses nodes"):
        table.add_column(column, justify="left" if column in ("order", "fits", "bottleneck", "crosses nodes")
                         else "right", no_wrap=True)
    for i, c in enumerate(candidates, 1):
        crossing = [k for k in ("tp", "cp") if c["cross_node"][k]]
        table.add_row(str(i), str(c["tp"]), str(c["cp"]), str(c["dp"]), str(c["pp"]), c["order"],
                      human_bytes(c["peak_bytes"]), _fits(c["fits"]), human_seconds(c["est_time_s"]),
                      c["bottleneck"] or "-", f"{c['pipeline_bubble']:.1%}",
                      Text(", ".join(crossing), style="yellow") if crossing else "-")
    rejected = _rejected_text(result)
    table.caption = "ranked by estimated communication per step, then peak memory" + (
        f"; rejected sizes: {rejected}" if rejected else "")
    stdout_console().print(table)


def nothing_fits_message(result: dict) -> str:
    """One line: why no layout was suggested and what is closest."""
    world = result["world_size"]
    closest = result["closest"]
    if closest is None:
        return (f"no (tp, cp, pp) of {world} devices meets the model's constraints (rejected sizes: "
                f"{_rejected_text(result)}): change the device count or the model's shape.")
    c = closest
    return (f"no layout of {world} devices fits {human_bytes(result['device_memory_bytes'])} per device "
            f"(rejected sizes: {_rejected_text(result)}). Closest: tp={c['tp']} cp={c['cp']} dp={c['dp']} "
            f"pp={c['pp']}, {c['why']}. Try: " + "; ".join(c["hints"]) + ".")


def warn_nothing_fits(message: str) -> None:
    stderr_console().print(Text("msdist: ", style="bold red") + Text(message), soft_wrap=True)
