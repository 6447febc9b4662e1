"""Rendering of ``msdist`` results: Rich for people, JSON for scripts.

Commands compute plain data (dicts) and call one function here. Diagnostics go to
stderr so that ``--format json`` leaves stdout holding the JSON alone.
"""

from __future__ import annotations

import io
import json
import sys

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

AXES = ("tp", "cp", "dp", "pp")
EXPERT_COLUMNS = ("ep", "etp", "edp")
# Groups the plan always lists for the expert layers (topology.plan.RUNTIME_KEYS).
EXPERT_KEYS = ("ep", "etp", "edp", "etp-ep")
# Rows shown at each end of a large rank table, and groups at each end of a listing.
HEAD_ROWS = 8
HEAD_GROUPS = 4
RECORD_WIDTH = 120


def stdout_console(record: bool = False, echo: bool = True) -> Console:
    """The console for results; with ``echo=False`` it only records (for --svg)."""
    file = None if echo else io.StringIO()
    console = Console(record=record, highlight=False, soft_wrap=False, file=file)
    if not console.is_terminal:
        # Piped or recorded output has no width to respect; 80 columns would cut the
        # wide verify tables.
        console.width = RECORD_WIDTH
    return console


def stderr_console() -> Console:
    return Console(stderr=True, highlight=False)


def print_json(data) -> None:
    sys.stdout.write(json.dumps(data))
    sys.stdout.write("\n")
    sys.stdout.flush()


def warn(messages) -> None:
    console = stderr_console()
    for message in messages:
        console.print(Text("warning: ", style="bold yellow") + Text(message))


def _mib(mb: float) -> str:
    return f"{mb / 1024:.1f} GB" if mb >= 1024 else f"{mb:.0f} MB"


# ------------------------------------------------------------------ plan
def experts_split(plan: dict) -> bool:
    """True when expert layers are split unlike the dense ones (ep > 1 or etp != tp).

    Otherwise their groups are the dense ones, so people see the dense groups only
    (``--format json`` keeps every key).
    """
    expert = plan.get("expert_sizes")
    return bool(expert) and (expert["ep"] > 1 or expert["etp"] != plan["sizes"]["tp"])


def shown_keys(plan: dict, keys) -> list[str]:
    """``keys`` less the standard expert ones when they repeat the dense groups."""
    if experts_split(plan):
        return list(keys)
    return [k for k in keys if k not in EXPERT_KEYS]


def _distinct_keys(plan: dict, keys: list[str]) -> list[str]:
    # With the expert columns the table would not fit: keep the keys whose groups have more
    # than one rank and are not an earlier key's groups under another name.
    kept = []
    for key in keys:
        groups = plan["groups"][key]
        if len(groups[0]) > 1 and all(plan["groups"][k] != groups for k in kept):
            kept.append(key)
    return kept


def plan_summary(plan: dict, source: str | None = None) -> Panel:
    sizes = plan["sizes"]
    comms = plan["communicators"]
    lines = Table.grid(padding=(0, 2))
    lines.add_column(style="bold")
    lines.add_column()
    if plan.get("name"):
        lines.add_row("layout", str(plan["name"]) + (f"  ({source})" if source else ""))
    elif source:
        lines.add_row("layout", source)
    lines.add_row(
        "world",
        f"{plan['world_size']} ranks = {plan['nodes']} node(s) x {plan['devices_per_node']} devices"
        f"   backend {plan['backend']}",
    )
    lines.add_row("sizes", "  ".join(f"{a}={sizes[a]}" for a in AXES))
    expert = plan.get("expert_sizes")
    if expert:
        note = "expert layers; pp shared" if experts_split(plan) else "expert layers = dense (ep 1, etp = tp)"
        lines.add_row("experts", "  ".join(f"{a}={expert[a]}" for a in ("etp", "ep", "edp"))
                      + f"  pp={sizes['pp']}   ({note})")
    lines.add_row("order", f"{plan['order']}  (first axis varies fastest)")
    groups = plan["groups"]
    lines.add_row(
        "groups",
        "  ".join(
            f"{key}: {len(groups[key])} x {len(groups[key][0])}"
            + (" [cross-node]" if plan["cross_node"].get(key) else "")
            for key in shown_keys(plan, groups)
        ),
    )
    lines.add_row(
        "communicators",
        f"{comms['per_rank']} per rank ({', '.join(comms['groups']) or 'none'}); "
        f"HCCL buffers ~{_mib(comms['buffer_mb_per_rank'])} per rank "
        f"(2 x HCCL_BUFFSIZE={comms['hccl_buffsize_mb']} MB each)",
    )
    return Panel(lines, title="msdist plan", title_align="left", expand=False)


def _group_index_maps(plan: dict, rows) -> dict:
    # rank -> group index for each key, only for the ranks shown.
    wanted = {row["rank"] for row in rows}
    maps = {}
    for key, key_groups in plan["groups"].items():
        index = {}
        for i, members in enumerate(key_groups):
            for r in members:
                if r in wanted:
                    index[r] = i
        maps[key] = index
    return maps


def _elided(items: list, head: int, show_all: bool):
    """(first items, number hidden, last items) for a long list."""
    if show_all or len(items) <= 2 * head + 1:
        return items, 0, []
    return items[:head], len(items) - 2 * head, items[-head:]


def rank_table(plan: dict, show_all: bool) -> Table:
    first, hidden, last = _elided(plan["ranks"], HEAD_ROWS, show_all)
    maps = _group_index_maps(plan, first + last)
    keys = shown_keys(plan, plan["groups"])
    coords = AXES
    if experts_split(plan):
        coords, keys = (*AXES, *EXPERT_COLUMNS), _distinct_keys(plan, keys)
    table = Table(title="ranks", title_justify="left", show_edge=False, pad_edge=False)
    for column in ("rank", "node", "local", *coords):
        table.add_column(column, justify="right", no_wrap=True)
    for key in keys:
        table.add_column(f"#{key}", justify="right", style="cyan", no_wrap=True)
    table.caption = "#key = index of the rank's group in the listing below" + (
        " (keys of size-1 or repeated groups left out)" if coords != AXES else "")

    def add(row):
        table.add_row(
            str(row["rank"]),
            str(row["node"]),
            str(row["local_rank"]),
            *(str(row[a]) for a in coords),
            *(str(maps[key][row["rank"]]) for key in keys),
        )

    for row in first:
        add(row)
    if hidden:
        table.add_row("...", *["..."] * (2 + len(coords) + len(keys)), style="dim")
        table.caption = f"{hidden} more ranks not shown (use --all); " + table.caption
    for row in last:
        add(row)
    return table


def _ranks_text(members: list[int]) -> str:
    if len(members) <= 16:
        return "[" + ", ".join(map(str, members)) + "]"
    step = members[1] - members[0]
    if all(b - a == step for a, b in zip(members, members[1:])):
        return f"[{members[0]}, {members[1]}, ..., {members[-1]}] ({len(members)} ranks, stride {step})"
    return "[" + ", ".join(map(str, members[:8])) + f", ... {members[-1]}] ({len(members)} ranks)"


def group_listing(plan: dict, show_all: bool) -> Table:
    table = Table(title="groups", title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("axis", style="bold")
    table.add_column("group", justify="right")
    table.add_column("ranks (by group rank)")
    table.add_column("")
    for key in shown_keys(plan, plan["groups"]):
        key_groups = plan["groups"][key]
        crossing = set(plan["cross_node"].get(key, ()))
        indexed = list(enumerate(key_groups))
        first, hidden, last = _elided(indexed, HEAD_GROUPS, show_all)
        for i, members in first:
            mark = Text("crosses nodes", style="yellow") if i in crossing else ""
            table.add_row(key, str(i), _ranks_text(members), mark)
        if hidden:
            table.add_row(key, "...", f"{hidden} more groups (use --all)", "", style="dim")
        for i, members in last:
            mark = Text("crosses nodes", style="yellow") if i in crossing else ""
            table.add_row(key, str(i), _ranks_text(members), mark)
        table.add_section()
    return table


def render_plan(plan: dict, source: str | None, show_all: bool, svg: str | None, echo: bool = True,
                extra=()) -> None:
    """The plan's summary, rank table and groups, then ``extra`` renderables (cost tables)."""
    if not (echo or svg):
        warn(plan["warnings"])
        return
    console = stdout_console(record=bool(svg), echo=echo)
    console.print(plan_summary(plan, source))
    console.print(rank_table(plan, show_all))
    console.print()
    console.print(group_listing(plan, show_all))
    for renderable in extra:
        console.print()
        console.print(renderable)
    if svg:
        console.save_svg(svg, title="msdist plan")
    warn(plan["warnings"])


def render_rank(view: dict, svg: str | None, echo: bool = True, extra=()) -> None:
    if not (echo or svg):
        warn(view["warnings"])
        return
    console = stdout_console(record=bool(svg), echo=echo)
    coords = view["coords"]
    split = experts_split(view)
    expert = "".join(f"  {a}={view['expert_coords'][a]}" for a in EXPERT_COLUMNS) if split else ""
    head = Text.assemble(
        ("rank ", "bold"),
        (str(view["rank"]), "bold cyan"),
        f"  node {view['node']}  local rank {view['local_rank']}  ",
        "  ".join(f"{a}={coords[a]}" for a in AXES) + expert,
        f"   (world {view['world_size']}, order {view['order']})",
    )
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("group", style="bold")
    table.add_column("index", justify="right")
    table.add_column("rank in group", justify="right")
    table.add_column("size", justify="right")
    table.add_column("members (by group rank)")
    table.add_column("")
    for key in shown_keys(view, view["groups"]):
        group = view["groups"][key]
        table.add_row(
            key,
            str(group["index"]),
            str(group["group_rank"]),
            str(group["size"]),
            _ranks_text(group["ranks"]),
            Text("crosses nodes", style="yellow") if group["cross_node"] else "",
        )
    comms = view["communicators"]
    foot = Text(
        f"joins {comms['per_rank']} communicator(s); HCCL buffers ~{_mib(comms['buffer_mb_per_rank'])}"
    )
    console.print(Panel(Group(head, table, foot), title="msdist plan --rank", title_align="left", expand=False))
    for renderable in extra:
        console.print()
        console.print(renderable)
    if svg:
        console.save_svg(svg, title=f"msdist plan --rank {view['rank']}")
    warn(view["warnings"])


def render_layout_list(rows: list[dict]) -> None:
    table = Table(show_edge=False, pad_edge=False)
    columns = ("name", "world_size", "nodes", "tp", "cp", "dp", "pp", "ep", "etp", "order", "backend", "file")
    for column in columns:
        table.add_column("world" if column == "world_size" else column)
    for row in rows:
        table.add_row(*(str(row[c]) for c in columns))
    stdout_console().print(table)


# ------------------------------------------------------------------ verify
def _human_bytes(n: int) -> str:
    for unit, size in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def correctness_table(rows: list[dict]) -> Table:
    table = Table(title="correctness", title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("check", style="bold")
    table.add_column("group")
    table.add_column("mode")
    table.add_column("result")
    table.add_column("max error", justify="right")
    table.add_column("failed ranks")
    for row in rows:
        result = Text("pass", style="green") if row["passed"] else Text("FAIL", style="bold red")
        check = row["check"] + (" (uneven)" if row.get("split") == "uneven" else "")
        error = "-" if row.get("max_error") is None else f"{row['max_error']:.3g}"
        table.add_row(
            check, row["group"], row.get("mode") or "pynative", result, error,
            ", ".join(map(str, row.get("failed_ranks", []))),
        )
    return table


def bandwidth_table(rows: list[dict]) -> Table:
    table = Table(title="bandwidth (time = slowest rank; busbw as nccl-tests)", title_justify="left",
                  show_edge=False, pad_edge=False)
    for column, justify in (("op", "left"), ("group", "left"), ("n", "right"), ("size", "right"),
                            ("dtype", "left"), ("time us", "right"), ("algbw GB/s", "right"),
                            ("busbw GB/s", "right"), ("#wrong", "right"), ("", "left")):
        table.add_column(column, justify=justify)
    for row in rows:
        mode = row.get("mode") or "pynative"
        table.add_row(
            row["op"] + ("" if mode == "pynative" else f" ({mode})"),
            row["group"] + (" (x-node)" if row.get("crosses_nodes") else ""),
            str(row["group_size"]), _human_bytes(row["bytes"]), row["dtype"],
            f"{row['time_us']:.1f}", f"{row['algbw_gbps']:.4f}", f"{row['busbw_gbps']:.4f}",
            Text(str(row["wrong"]), style="green" if row["wrong"] == 0 else "bold red"),
            Text("composed", style="yellow") if row["composed"] else "native",
        )
    return table


def summary_table(rows: list[dict]) -> Table:
    """One row per family of checks and mode (``report["summary"]``)."""
    table = Table(title="correctness summary", title_justify="left", show_edge=False, pad_edge=False,
                  caption="per-check rows: the failed ones below; all of them with --verbose",
                  caption_justify="left")
    for column, justify in (("family", "left"), ("mode", "left"), ("passed", "right"),
                            ("failed", "right"), ("worst error", "right")):
        table.add_column(column, justify=justify, style="bold" if column == "family" else None)
    for row in rows:
        failed = Text(str(row["failed"]), style="bold red" if row["failed"] else "green")
        error = "-" if row.get("max_error") is None else f"{row['max_error']:.3g}"
        table.add_row(row["family"], row["mode"], str(row["passed"]), failed, error)
    return table


def render_verify(report: dict, verbose: bool = False) -> None:
    """The report for people: the summary first; per-check rows for failures (all of them
    with ``verbose``); bandwidth; the compute probe; the verdict."""
    console = stdout_console()
    layout = report["layout"]
    console.print(
        Text.assemble(
            ("msdist verify ", "bold"),
            f"{layout.get('name') or ''}  {report['ranks']} ranks  "
            f"tp={layout['tp']} cp={layout['cp']} dp={layout['dp']} pp={layout['pp']}  "
            + (f"ep={layout['ep']} etp={layout['etp']}  " if "ep" in layout else "")
            + f"order {layout['order']}  backend {layout['backend']}",
            f"  ({report['duration_s']:.1f} s)" if report.get("duration_s") else "",
        )
    )
    if report["correctness"]:
        summary = report.get("summary")
        if summary:
            console.print(summary_table(summary))
            console.print()
        rows = report["correctness"] if (verbose or not summary) else [
            r for r in report["correctness"] if not r["passed"]]
        if rows:
            console.print(correctness_table(rows))
            console.print()
    if report["bandwidth"]:
        console.print(bandwidth_table(report["bandwidth"]))
        if any(r["composed"] for r in report["bandwidth"]):
            console.print(
                Text("composed = built from other collectives on this backend (CPU has no "
                     "reduce-scatter/all-to-all kernel): all-reduce + slice, all-gather + select.",
                     style="dim")
            )
        console.print()
    pair = report.get("sendrecv_slowest")
    if pair:
        where = " (crosses nodes)" if pair.get("crosses_nodes") else ""
        console.print(Text(f"slowest pipeline neighbour pair: {pair['group']}{where}, sendrecv "
                           f"{pair['busbw_gbps']:.4f} GB/s at {_human_bytes(pair['bytes'])}",
                           style="bold"))
        console.print()
    compute = report.get("compute")
    if compute:
        n = compute["shape"][0]
        console.print(Text(f"compute: {compute['tflops']:.4g} TFLOP/s per device (slowest rank, {compute['dtype']} "
                           f"{n}x{n} matmul); `msdist suggest --calibrate REPORT.json` prices layouts with it and "
                           "the bandwidths above", style="dim"))
        console.print()
    for miss in report.get("busbw_misses", []):
        mode = "" if (miss.get("mode") or "pynative") == "pynative" else f" ({miss['mode']})"
        console.print(Text(f"below --min-busbw: {miss['op']}{mode} on {miss['group']} at "
                           f"{_human_bytes(miss['bytes'])}: {miss['busbw_gbps']:.4f} GB/s", style="bold red"))
    err = stderr_console()
    for failure in report["failures"]:
        err.print(Text(f"rank {failure['rank']} failed: {failure['reason']}", style="bold red"))
        if failure.get("log_tail"):
            err.print(Panel(Text(failure["log_tail"]), title=f"rank {failure['rank']} log tail",
                            title_align="left", expand=False))
    if report.get("log_dir"):
        err.print(Text(f"logs: {report['log_dir']}", style="dim"))
    verdict = Text("OK: every check passed", style="bold green") if report["ok"] else Text("FAILED", style="bold red")
    console.print(verdict)
