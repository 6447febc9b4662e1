"""Pictures of ``msdist`` data: the device grid of a plan, memory per stage, step time,
the pipeline timeline and ``verify``'s bandwidth curves.

Like :mod:`mscli.render`, every function takes the plain dicts the commands computed (the
plan, the cost estimate, the verify report), so pictures are made and tested without
MindSpore. matplotlib (the ``plots`` extra) is imported only when a picture is asked
for, with the Agg backend and no pyplot, so ``msdist plan`` stays fast without it.

SVG output keeps text as text (``svg.fonttype = none``) and names the drawn things with
``gid`` (``cell-r5``, ``mem-s0-weights``, ``bw-all_reduce-tp``, ``sched-s1-F3-c0`` and its
number ``schedlabel-s1-F3-c0``, the chart frames ``axes-memory``, ``axes-time``,
``axes-bandwidth``), so a test or a script can find a rank's cell, read its colour or map
an axis's ticks to pixels.

Output paths are checked before anything is drawn (:func:`mscli.errors.check_output_file`:
the suffix matches the format, the folder takes a file); a write that still fails is one
:class:`~mscli.errors.UsageError` line.
"""

from __future__ import annotations

import functools
import os

from .errors import UsageError, check_output_file, write_error

AXES = ("tp", "cp", "dp", "pp")
# A world larger than this is drawn as its first and last EDGE_NODES nodes.
MAX_DRAWN_DEVICES = 512
MAX_DRAWN_NODES = 64
EDGE_NODES = 4
# A node wider than this is drawn as its first and last EDGE_DEVICES devices.
MAX_DRAWN_COLUMNS = 64
EDGE_DEVICES = 16
LEGEND_GROUPS = 16
INSTALL_HINT = 'pip install -e ".[plots]" (or pip install matplotlib)'
SVG_RC = {"svg.fonttype": "none", "svg.hashsalt": "msdist", "font.size": 9}
PNG_DPI = 110
GIB = 1024**3
MEMORY_PARTS = (("weights", "weights_bytes", "#4e79a7"), ("gradients", "gradients_bytes", "#f28e2b"),
                ("optimizer", "optimizer_bytes", "#59a14f"), ("activations", "activations_bytes", "#e15759"),
                ("communicators", "communicator_bytes", "#b07aa1"))
TIME_PARTS = (("compute", "compute_s", "#4e79a7"), ("bubble", "bubble_s", "#bab0ac"), ("tp", "tp_s", "#f28e2b"),
              ("cp", "cp_s", "#59a14f"), ("pp", "pp_s", "#e15759"), ("dp", "dp_s", "#b07aa1"))
CROSS_EDGE = "#d62728"
STAGE_SHADES = ("#eeeeee", "#cfcfcf")
MARKERS = {"tp": "o", "cp": "s", "dp": "^", "pp": "D", "dp-cp": "v", "world": "*"}


def require(option: str):
    """The ``matplotlib`` package, or a one-line UsageError saying how to install it."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError(f"{option} draws with matplotlib, which is not installed: {INSTALL_HINT}.") from None
    matplotlib.use("Agg", force=True)
    return matplotlib


def _figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained")


def save(fig, path: str, fmt: str | None = None, option: str = "--svg") -> None:
    """Write ``fig`` as SVG or PNG (``fmt``, else the file's suffix, else SVG).

    Raises:
        UsageError: the file cannot be written (one line naming ``option`` and ``path``).
    """
    fmt = fmt or ("png" if os.path.splitext(path)[1].lower() == ".png" else "svg")
    metadata = {"Date": None} if fmt == "svg" else None
    try:
        fig.savefig(path, format=fmt, dpi=PNG_DPI, metadata=metadata, bbox_inches="tight", pad_inches=0.12)
    except OSError as err:
        raise write_error(option, path, err) from None


# ------------------------------------------------------------------ the device grid
def color_axis(plan: dict, color_by: str | None = None) -> str:
    """``--color-by``, checked; by default the innermost axis (first of the order) larger than 1."""
    if color_by is not None:
        if color_by not in plan["groups"]:
            raise UsageError(f"--color-by {color_by!r} is invalid: expected one of {', '.join(plan['groups'])}.")
        return color_by
    sizes = {**plan.get("expert_sizes", {}), **plan["sizes"]}  # the order may name ep
    for axis in plan["order"].split("-"):
        if sizes.get(axis, 1) > 1:
            return axis
    return "tp"


def _elide(count: int, edge: int, limit: int) -> tuple[list[int], int]:
    """The indices drawn of ``count`` and where the elision goes (-1 when all are drawn)."""
    if count <= limit or count <= 2 * edge:
        return list(range(count)), -1
    return list(range(edge)) + list(range(count - edge, count)), edge


def grid_cells(plan: dict, color_by: str | None = None) -> dict:
    """What the device grid draws, as data: nodes shown, and per drawn device its rank, group and stage.

    Returns a dict with ``axis`` (the colour axis), ``nodes`` and ``columns`` (the node and
    local indices drawn), ``node_gap`` / ``column_gap`` (position of the ellipsis row or
    column, -1 for none) and ``cells``: ``(node, local) -> {"rank", "group", "stage",
    "crosses"}`` where ``group`` is the rank's group index on ``axis`` and ``crosses`` says
    that group spans nodes. For ``ascend-64`` (8 nodes x 8, tp=4) coloured by tp, cell
    (0, 5) is rank 5 in tp group 1 of stage 0.
    """
    axis = color_axis(plan, color_by)
    columns_total = min(plan["devices_per_node"], plan["world_size"])
    many = plan["world_size"] > MAX_DRAWN_DEVICES or plan["nodes"] > MAX_DRAWN_NODES
    nodes, node_gap = _elide(plan["nodes"], EDGE_NODES, EDGE_NODES * 2 if many else plan["nodes"])
    columns, column_gap = _elide(columns_total, EDGE_DEVICES, MAX_DRAWN_COLUMNS)
    wanted_nodes, wanted_columns = set(nodes), set(columns)
    group_of = {}
    for index, members in enumerate(plan["groups"][axis]):
        for r in members:
            group_of[r] = index
    crossing = set(plan["cross_node"].get(axis, ()))
    cells = {}
    for row in plan["ranks"]:
        if row["node"] in wanted_nodes and row["local_rank"] in wanted_columns:
            group = group_of[row["rank"]]
            cells[(row["node"], row["local_rank"])] = {
                "rank": row["rank"], "group": group, "stage": row["pp"], "crosses": group in crossing}
    return {"axis": axis, "nodes": nodes, "node_gap": node_gap, "columns": columns,
            "column_gap": column_gap, "cells": cells, "nodes_total": plan["nodes"],
            "columns_total": columns_total}


@functools.lru_cache(maxsize=1)
def palette() -> tuple[str, ...]:
    """The group colours, 56 distinct ones from matplotlib's qualitative maps, most distinct first.

    tab20's ten dark hues, then its ten light ones (the first 20, as before); then tab20b's
    five and tab20c's four colour families (tab20c's greys would vanish on the grey stage
    bands), one shade at a time in the order darkest, third, second, lightest, so that
    neighbouring groups change hue.
    """
    from matplotlib import colormaps, colors

    tab20 = [colormaps["tab20"]((2 * i) % 20 + i // 10) for i in range(20)]
    b, c = colormaps["tab20b"].colors, colormaps["tab20c"].colors
    families = [fam for pair in zip([b[4 * f:4 * f + 4] for f in range(5)],
                                    [c[4 * f:4 * f + 4] for f in range(4)] + [None]) for fam in pair if fam]
    extra = [family[shade] for shade in (0, 2, 1, 3) for family in families]
    return tuple(colors.to_hex(color) for color in tab20 + extra)


def group_color(index: int) -> str:
    """The ``index``-th group colour of :func:`palette` (repeating after its 56)."""
    colours = palette()
    return colours[index % len(colours)]


def grid_colors(grid: dict) -> dict[int, str]:
    """Colour of each group drawn in the grid, by order of first appearance: the drawn groups (up
    to 56) all differ even when the world has thousands; beyond, group i and i + 56 share one
    (the picture says so)."""
    order = sorted({cell["group"] for cell in grid["cells"].values()})
    return {group: group_color(i) for i, group in enumerate(order)}


def _text_color(hex_color: str) -> str:
    r, g, b = (int(hex_color[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


def _members_text(members: list[int]) -> str:
    if len(members) <= 4:
        return ",".join(map(str, members))
    step = members[1] - members[0]
    if all(b - a == step for a, b in zip(members, members[1:])):
        return f"{members[0]}-{members[-1]}" if step == 1 else f"{members[0]},{members[1]},..,{members[-1]}"
    return f"{members[0]},{members[1]},..,{members[-1]}"


def _positions(drawn: list[int], gap: int) -> dict[int, float]:
    """Drawing position of each drawn index; an elision takes one slot."""
    return {index: float(i + (1 if 0 <= gap <= i else 0)) for i, index in enumerate(drawn)}


def _runs(values: list) -> list[tuple[int, int, object]]:
    """(first, last, value) of each run of equal neighbours."""
    runs, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            runs.append((start, i - 1, values[start]))
            start = i
    return runs


def draw_grid(ax, plan: dict, color_by: str | None = None, highlight: int | None = None) -> dict:
    """Draw the device grid of ``plan`` on ``ax``; returns :func:`grid_cells`' data."""
    from matplotlib.patches import Patch, Rectangle

    grid = grid_cells(plan, color_by)
    axis, cells = grid["axis"], grid["cells"]
    ys, xs = _positions(grid["nodes"], grid["node_gap"]), _positions(grid["columns"], grid["column_gap"])
    width = len(xs) + (1 if grid["column_gap"] >= 0 else 0)
    font = 8 if width <= 16 else 6 if width <= 40 else 4
    colors = grid_colors(grid)
    row_labels = []
    for node in grid["nodes"]:
        y = ys[node]
        # Pipeline stages as bands behind the cells: one per run of equal stage along the row.
        runs = _runs([cells[(node, c)]["stage"] for c in grid["columns"]])
        for first, last, stage in runs:
            x0, x1 = xs[grid["columns"][first]], xs[grid["columns"][last]]
            ax.add_patch(Rectangle((x0 - 0.48, y - 0.5), x1 - x0 + 0.96, 0.98, facecolor=STAGE_SHADES[stage % 2],
                                   edgecolor="none", zorder=0, gid=f"band-n{node}-x{first}-s{stage}"))
            if len(runs) > 1:
                ax.text(x0 - 0.44, y - 0.47, f"stage {stage}", fontsize=6, va="top", ha="left", color="#444444",
                        zorder=1)
        row_labels.append(f"node {node}" + (f"\nstage {runs[0][2]}" if len(runs) == 1 else ""))
        for column in grid["columns"]:
            cell = cells[(node, column)]
            color = colors[cell["group"]]
            edge, line = (CROSS_EDGE, 2.0) if cell["crosses"] else ("white", 0.8)
            if highlight is not None and cell["rank"] == highlight:
                edge, line = "black", 3.0
            x = xs[column]
            ax.add_patch(Rectangle((x - 0.4, y - 0.3), 0.8, 0.72, facecolor=color, edgecolor=edge, linewidth=line,
                                   zorder=2, gid=f"cell-r{cell['rank']}"))
            ax.text(x, y + 0.06, str(cell["rank"]), ha="center", va="center", fontsize=font,
                    color=_text_color(color), zorder=3, gid=f"label-r{cell['rank']}")
    if grid["node_gap"] >= 0:
        hidden = grid["nodes_total"] - len(grid["nodes"])
        first_hidden, last_hidden = grid["nodes"][grid["node_gap"] - 1] + 1, grid["nodes"][grid["node_gap"]] - 1
        ax.text((width - 1) / 2, grid["node_gap"], f"...  {hidden} nodes not drawn (nodes {first_hidden}-"
                f"{last_hidden}, {hidden * grid['columns_total']} devices)  ...", ha="center", va="center",
                fontsize=8, style="italic", gid="elided-nodes")
    if grid["column_gap"] >= 0:
        hidden = grid["columns_total"] - len(grid["columns"])
        ax.text(grid["column_gap"], -0.9, f"... {hidden} ...", ha="center", va="center", fontsize=7,
                gid="elided-columns")
    ax.set_xlim(-0.6, width - 0.4)
    rows = len(ys) + (1 if grid["node_gap"] >= 0 else 0)
    ax.set_ylim(rows - 0.45, -0.6)
    ax.set_yticks(list(ys.values()), row_labels)
    ax.set_xticks(list(xs.values()), [str(c) for c in xs], fontsize=font)
    ax.xaxis.tick_top()
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.set_aspect("equal")
    sizes = plan["sizes"]
    title = (f"{plan.get('name') or 'layout'}: {plan['world_size']} devices = {plan['nodes']} node(s) x "
             f"{plan['devices_per_node']}   " + " ".join(f"{a}={sizes[a]}" for a in AXES))
    ax.set_title(title + f"\ncoloured by {axis} group" + (f", rank {highlight} outlined in black"
                                                       if highlight is not None else ""), fontsize=9, loc="left")
    # The legend: groups drawn (up to LEGEND_GROUPS), what the red edge and the bands mean.
    shown = sorted({cell["group"] for cell in cells.values()})
    handles = [Patch(facecolor=colors[g], label=f"{axis} {g}: {_members_text(plan['groups'][axis][g])}")
               for g in shown[:LEGEND_GROUPS]]
    hidden = len(plan["groups"][axis]) - len(handles)
    if hidden:
        handles.append(Patch(facecolor="none", edgecolor="none", label=f"+{hidden} more {axis} groups"))
    if any(cell["crosses"] for cell in cells.values()):
        handles.append(Patch(facecolor="white", edgecolor=CROSS_EDGE, linewidth=2, label=f"{axis} group crosses nodes"))
    handles.append(Patch(facecolor=STAGE_SHADES[0], edgecolor="#999999", label="band = pipeline stage"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    crossing = [key for key, groups in plan["cross_node"].items() if groups]
    notes = [f"groups crossing nodes: {', '.join(crossing)}" if crossing else "no group crosses a node"]
    if grid["node_gap"] >= 0:
        notes.append(f"{len(grid['nodes'])} of {grid['nodes_total']} nodes drawn (first and last {EDGE_NODES})")
    label = "; ".join(notes)
    if len(shown) > len(palette()):  # more groups than distinguishable colours: say so, on its own line
        label += (f"\n{len(shown)} {axis} groups drawn with {len(palette())} colours: groups {len(palette())} "
                  "apart share one (read the rank labels)")
    ax.set_xlabel(label, fontsize=8, loc="left")
    return grid


# ------------------------------------------------------------------ memory and step time
def draw_memory(ax, memory: dict) -> list[int]:
    """Stacked bars of memory per stage against the device line; returns the over-limit stages."""
    stages = memory["stages"]
    device = memory["device_memory_bytes"] / GIB
    xs = list(range(len(stages)))
    bottoms = [0.0] * len(stages)
    parts = MEMORY_PARTS
    if any(s.get("gathered_bytes") for s in stages):  # ZeRO-3: the weights gathered for a micro-batch
        parts = MEMORY_PARTS[:4] + (("ZeRO-3 gathered", "gathered_bytes", "#edc948"),) + MEMORY_PARTS[4:]
    for label, key, color in parts:
        heights = [s[key] / GIB for s in stages]
        bars = ax.bar(xs, heights, bottom=bottoms, color=color, label=label, width=0.7)
        for bar, s in zip(bars, stages):
            bar.set_gid(f"mem-s{s['stage']}-{label}")
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.axhline(device, color="black", linestyle="--", linewidth=1.2, gid="mem-device",
               label=f"device memory {device:.0f} GiB")
    over = [s["stage"] for s, total in zip(stages, bottoms) if total > device]
    for x, s, total in zip(xs, stages, bottoms):
        if s["stage"] in over:
            ax.annotate(f"over by\n{total - device:.0f} GiB", (x, total), ha="center", va="bottom", fontsize=6.5,
                        color=CROSS_EDGE, fontweight="bold", gid=f"mem-over-s{s['stage']}")
    ax.set_xticks(xs, [str(s["stage"]) for s in stages], fontsize=7 if len(xs) <= 16 else 5)
    ax.set_xlabel("pipeline stage")
    ax.set_ylabel("GiB per device")
    ax.set_gid("axes-memory")
    ax.set_ylim(0, max(max(bottoms), device) * 1.18)
    ax.set_title("memory per stage" + (f": {len(over)} of {len(stages)} over" if over else ": fits"),
                 fontsize=9, loc="left")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    return over


def draw_time(ax, time: dict) -> None:
    """The step-time breakdown as one stacked bar (seconds)."""
    breakdown = time["breakdown"]
    bottom = 0.0
    for label, key, color in TIME_PARTS:
        value = float(breakdown.get(key, 0.0))
        if value <= 0:
            continue
        ax.bar([0], [value], bottom=bottom, color=color, label=f"{label} {value:.3g} s", width=0.6,
               gid=f"time-{label}")
        bottom += value
    ax.set_xticks([])
    ax.set_xlim(-0.6, 0.6)
    ax.set_ylim(0, max(bottom, float(time["step_time_s"]), 1e-12) * 1.05)
    ax.set_ylabel("seconds per step")
    ax.set_gid("axes-time")
    extra = []
    if time.get("tokens_per_s"):
        extra.append(f"{time['tokens_per_s']:,.0f} tokens/s")
    if time.get("mfu") is not None:
        extra.append(f"MFU {100 * time['mfu']:.0f}%")
    ax.set_title(f"step {time['step_time_s']:.3g} s" + ("\n" + ", ".join(extra) if extra else ""), fontsize=9,
                 loc="left")
    handles, labels = ax.get_legend_handles_labels()  # top of the stack first, as drawn
    ax.legend(handles[::-1], labels[::-1], fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


# ------------------------------------------------------------------ pipeline timeline
SCHEDULE_FONT = 6
# Room the timeline's axis leaves for everything else across the figure: stage labels and legend.
SCHEDULE_MARGIN_IN = 2.8


def schedule_numbered(timeline: list, makespan: float, width_in: float) -> bool:
    """Whether the timeline's blocks get their microbatch numbers: all of them or none.

    One rule for every block (a forward is half a backward's width, so a per-block rule
    numbered the backwards of a long timeline and not its forwards): the narrowest block
    must hold the widest number at :data:`SCHEDULE_FONT` points, with the axis
    ``width_in - SCHEDULE_MARGIN_IN`` inches wide.
    """
    blocks = [b for row in timeline for b in row]
    if not blocks or makespan <= 0:
        return False
    narrowest = min(float(b["end"]) - float(b["start"]) for b in blocks)
    digits = max(len(str(b["microbatch"])) for b in blocks)
    points_per_unit = max(width_in - SCHEDULE_MARGIN_IN, 1.0) * 72 / makespan
    # A digit of DejaVu Sans is 0.64 em wide; keep a point of margin.
    return narrowest * points_per_unit >= 0.64 * SCHEDULE_FONT * digits + 1.0


def draw_schedule(ax, schedule: dict, width_in: float = 8.0) -> None:
    """The pipeline schedule's timeline: one row per stage, forward and backward blocks per microbatch.

    ``schedule`` is plan's ``"schedule"`` data (``timeline`` per stage of ``{"kind", "microbatch",
    "chunk", "start", "end"}`` in units of one chunk's forward); ``width_in`` the figure's
    width, which decides whether the blocks are numbered (:func:`schedule_numbered`).
    """
    from matplotlib.patches import Patch, Rectangle

    timeline = schedule["timeline"]
    chunks = max(1, int(schedule.get("virtual_stages") or 1))
    palette = {"F": ("#4e79a7", "#a0cbe8"), "B": ("#f28e2b", "#ffbe7d")}
    makespan = float(schedule.get("makespan") or max((b["end"] for row in timeline for b in row), default=1))
    numbered = schedule_numbered(timeline, makespan, width_in)
    for stage, row in enumerate(timeline):
        for block in row:
            kind = block["kind"]
            color = palette.get(kind, ("#59a14f", "#8cd17d"))[int(block.get("chunk", 0)) % 2]
            start, end = float(block["start"]), float(block["end"])
            name = f"s{stage}-{kind}{block['microbatch']}-c{block.get('chunk', 0)}"
            ax.add_patch(Rectangle((start, stage - 0.4), end - start, 0.8, facecolor=color, edgecolor="white",
                                   linewidth=0.6, gid=f"sched-{name}"))
            if numbered:
                ax.text((start + end) / 2, stage, str(block["microbatch"]), ha="center", va="center",
                        fontsize=SCHEDULE_FONT, color=_text_color(color), gid=f"schedlabel-{name}")
    ax.set_xlim(0, makespan)
    ax.set_ylim(len(timeline) - 0.5, -0.5)
    ax.set_yticks(range(len(timeline)), [f"stage {s}" for s in range(len(timeline))])
    ax.set_xlabel("time (one chunk's forward = 1; a backward lasts 2)"
                  + ("" if numbered else "; blocks too narrow to number by microbatch"))
    bubble = schedule.get("bubble_fraction")
    title = (f"{schedule['schedule']} schedule: {schedule['stages']} stages x {schedule['microbatches']} "
             f"microbatches" + (f", {chunks} virtual stages" if chunks > 1 else "") + f", makespan {makespan:g}")
    if bubble is not None:
        title += f", bubble {100 * bubble:.1f}%"
    ax.set_title(title, fontsize=9, loc="left")
    handles = [Patch(facecolor=palette["F"][0], label="forward" + (" (number = microbatch)" if numbered else "")),
               Patch(facecolor=palette["B"][0], label="backward")]
    if chunks > 1:
        handles += [Patch(facecolor=palette["F"][1], label="forward, odd chunk"),
                    Patch(facecolor=palette["B"][1], label="backward, odd chunk")]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


# ------------------------------------------------------------------ whole pictures
def plan_figure(plan: dict, color_by: str | None = None, highlight: int | None = None):
    """The plan picture: the device grid; with ``memory`` the chart per stage beside it (and
    ``time``'s breakdown bar); with ``schedule`` the pipeline timeline below."""
    grid = grid_cells(plan, color_by)
    columns = len(grid["columns"]) + (1 if grid["column_gap"] >= 0 else 0)
    rows = len(grid["nodes"]) + (1 if grid["node_gap"] >= 0 else 0)
    grid_w, grid_h = 2.2 + 0.5 * columns + 2.0, 1.6 + 0.5 * rows
    memory, time, schedule = plan.get("memory"), plan.get("time"), plan.get("schedule")
    mem_w = min(9.0, 3.2 + 0.3 * len(memory["stages"])) if memory else 0.0
    time_w = 2.0 if (memory and time) else 0.0
    top_h = max(grid_h, 4.6 if memory else 0.0)
    sched_h = 1.4 + 0.32 * len(schedule["timeline"]) if schedule else 0.0
    width = max(grid_w + mem_w + time_w, 8.0 if schedule else 0.0)
    fig = _figure(width, top_h + sched_h)
    panels = fig.subfigures(2, 1, height_ratios=[top_h, sched_h]) if schedule else [fig]
    ratios = [grid_w] + ([mem_w] if memory else []) + ([time_w] if time_w else [])
    axes = panels[0].subplots(1, len(ratios), width_ratios=ratios, squeeze=False)[0]
    draw_grid(axes[0], plan, color_by, highlight)
    # The equal-aspect grid rarely fills its share: keep it (and its legend) against the charts on
    # its right and level with their titles, so the spare room falls at the picture's left and
    # bottom edges, which saving with a tight bounding box trims, not between legend and charts.
    axes[0].set_anchor("NE" if memory else "NW")
    if memory:
        draw_memory(axes[1], memory)
    if time_w:
        draw_time(axes[2], time)
    if schedule:
        draw_schedule(panels[1].subplots(), schedule, width)
    return fig


def bandwidth_series(report: dict) -> list[dict]:
    """One series per (op, group) of the verify report: sizes, busbw, dashed (crosses nodes).

    Groups of one rank (busbw 0 by definition) are left out.
    """
    series: dict[tuple, dict] = {}
    for row in report.get("bandwidth", []):
        if row["group_size"] <= 1:
            continue
        mode = row.get("mode") or "pynative"
        op = row["op"] if mode == "pynative" else f"{row['op']}-{mode}"  # the expert groups' jit rows
        key = (op, row["group"])
        entry = series.setdefault(key, {"op": op, "group": row["group"], "group_size": row["group_size"],
                                        "dashed": False, "points": []})
        entry["dashed"] = entry["dashed"] or bool(row.get("crosses_nodes", False))
        entry["points"].append((row["bytes"], row["busbw_gbps"]))
    for entry in series.values():
        entry["points"].sort()
    return list(series.values())


def _size_label(n: int) -> str:
    for unit, size in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def bandwidth_figure(report: dict):
    """Bus bandwidth vs message size, one line per (op, group), log-2 x axis, inter-node dashed."""
    series = bandwidth_series(report)
    fig = _figure(8.5, 4.8)
    ax = fig.add_subplot()
    sizes = sorted({b for s in series for b, _ in s["points"]})
    for i, s in enumerate(series):
        color = group_color(i)
        marker = MARKERS.get(s["group"].split("=")[0], "x")  # "cp=dp-cp": one group, two names
        bytes_, bw = zip(*s["points"])
        ax.plot(bytes_, bw, linestyle="--" if s["dashed"] else "-", marker=marker, color=color, linewidth=1.4,
                markersize=5, label=f"{s['op']} {s['group']} (n={s['group_size']})" + (" inter-node" if s["dashed"] else ""),
                gid=f"bw-{s['op']}-{s['group']}")
    ax.set_xscale("log", base=2)
    if sizes:
        ax.set_xticks(sizes, [_size_label(b) for b in sizes])
        ax.set_xlim(sizes[0] / 1.5, sizes[-1] * 1.5)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("message size (bytes, log2)")
    ax.set_gid("axes-bandwidth")
    ax.set_ylabel("bus bandwidth (GB/s)")
    layout = report.get("layout", {})
    dtype = report["bandwidth"][0]["dtype"] if report.get("bandwidth") else ""
    ax.set_title(f"msdist verify {layout.get('name') or ''}: {report.get('ranks', '?')} ranks, backend "
                 f"{layout.get('backend', '?')}, {dtype}; busbw as nccl-tests (slowest rank); dashed = crosses nodes",
                 fontsize=9, loc="left")
    ax.grid(True, which="major", alpha=0.3)
    if len(sizes) == 1:
        ax.text(0.01, 0.98, "one message size (--quick): sweep with -b/-e/-f for curves", transform=ax.transAxes,
                va="top", fontsize=7, style="italic", gid="note-one-size")
    if series:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    else:
        ax.text(0.5, 0.5, "no bandwidth rows in this report (run verify with --checks bandwidth)",
                transform=ax.transAxes, ha="center", gid="note-no-bandwidth")
    return fig


def check_plot(path: str) -> None:
    """``verify --plot``'s target: a writable FILE.svg or FILE.png (not a folder), and matplotlib.

    ``verify`` calls it before launching any rank, so a bad path costs no run.
    """
    check_output_file("--plot", path, (".svg", ".png"))
    require("--plot")


def save_plan(plan: dict, outputs, color_by: str | None = None, highlight: int | None = None) -> None:
    """Draw the plan picture once and write it to each ``(path, "svg"|"png")`` of ``outputs``."""
    matplotlib = require("--svg")
    with matplotlib.rc_context(SVG_RC):
        fig = plan_figure(plan, color_by, highlight)
        for path, fmt in outputs:
            save(fig, path, fmt, f"--{fmt}")


def save_bandwidth(report: dict, path: str) -> None:
    """Write ``verify``'s bandwidth picture to ``path`` (SVG, or PNG by suffix)."""
    matplotlib = require("--plot")
    with matplotlib.rc_context(SVG_RC):
        save(bandwidth_figure(report), path, option="--plot")
