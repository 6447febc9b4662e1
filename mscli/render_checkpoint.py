"""Rendering of ``msdist checkpoint`` results (Rich on stdout, JSON for scripts) and its
progress bar (Rich, on stderr, shown only for long work on a terminal)."""

from __future__ import annotations

import sys
from contextlib import contextmanager

from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .render import HEAD_ROWS, print_json, stderr_console, stdout_console

# A progress bar only pays off past this much data.
PROGRESS_MIN_BYTES = 256 << 20


def human_bytes(n) -> str:
    n = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@contextmanager
def progress(description: str, total: int):
    """Yields ``advance(nbytes)``; draws a bar on stderr when ``total`` is large."""
    console = stderr_console()
    if total < PROGRESS_MIN_BYTES or not console.is_terminal:
        yield lambda n: None
        return
    from rich.progress import (BarColumn, DownloadColumn, Progress, TimeRemainingColumn,
                               TransferSpeedColumn)

    with Progress(Text(description), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


def _sharding(s: dict) -> str:
    if not s or s.get("axis") is None:
        return "replicated" + (" (sp)" if s and s.get("sequence_parallel") else "")
    text = f"{s['axis']} dim {s['partition_dim']}"
    if s.get("partition_stride", 1) > 1:
        text += f" stride {s['partition_stride']}"
    return text


def _layout(lay) -> str:
    if not lay:
        return "?"
    experts = ""
    if (lay.get("ep") or 1) > 1 or (lay.get("etp") is not None and lay.get("etp") != lay.get("tp", 1)):
        experts = f"; experts ep{lay.get('ep') or 1} x etp{lay.get('etp', lay.get('tp', 1))}"
    return (f"tp{lay.get('tp', 1)} x cp{lay.get('cp', 1)} x dp{lay.get('dp', 1)} x "
            f"pp{lay.get('pp', 1)}{experts} ({lay.get('world_size')} ranks, {lay.get('order')})")


def render_inspect(data: dict, fmt: str, show_all: bool = False) -> None:
    if fmt == "json":
        print_json(data)
        return _problems(data)
    console = stdout_console()
    verdict = Text("OK", style="bold green") if data["ok"] else Text(
        "INCOMPLETE" if not data["complete"] else "CORRUPT", style="bold red")
    head = Text.assemble(
        ("checkpoint ", "bold"), data["directory"], "\n", ("layout     ", "bold"),
        _layout(data.get("layout")), "\n", ("step       ", "bold"), str(data.get("step")), "\n",
        ("size       ", "bold"), human_bytes(data.get("total_bytes", 0)),
        f" in {len(data['parameters'])} parameters, {len(data['files'])} files\n",
        ("integrity  ", "bold"), verdict,
        "" if data["checksums"] else " (checksums not verified: --no-checksums)")
    for record in data.get("optimizers") or ():
        head.append("\n")
        head.append("optimizer  ", "bold")
        head.append(_optimizer(record))
    console.print(Panel(head, expand=False))
    params = data["parameters"]
    if params:
        table = Table(title="parameters", title_justify="left")
        for col in ("name", "global shape", "dtype", "sharding", "bytes", "stage", "shards"):
            table.add_column(col, justify="right" if col in ("bytes", "stage", "shards") else "left")
        shown = params if show_all or len(params) <= 2 * HEAD_ROWS else (
            params[:HEAD_ROWS] + [None] + params[-HEAD_ROWS:])
        for p in shown:
            if p is None:
                table.add_row(f"... {len(params) - 2 * HEAD_ROWS} more (--all)", "", "", "", "", "", "")
                continue
            table.add_row(p["name"], str(tuple(p["shape"])), p["dtype"], _sharding(p["sharding"]),
                          human_bytes(p["bytes"]), str(p["stage"]),
                          str(p["shards"]) + (f" +{p['copies']} copies" if p["copies"] else ""))
        console.print(table)
    if data["files"]:
        table = Table(title="files", title_justify="left")
        for col in ("file", "rank", "bytes", "crc32", "status"):
            table.add_column(col)
        for f in data["files"]:
            style = "green" if f.get("status") == "ok" else "red"
            table.add_row(f["file"], str(f.get("rank", "")), human_bytes(f.get("bytes")),
                          f.get("crc32") or "", Text(f.get("status", ""), style=style))
        console.print(table)
    _problems(data)


def _optimizer(record: dict) -> str:
    """One optimizer of the manifest's record, e.g. ``adamw (exp_avg, exp_avg_sq), ZeRO stage 1 over 4 ranks``."""
    if record.get("class") != "DistributedOptimizer":
        return str(record.get("class"))
    state = ", ".join(record.get("state") or []) or "no state"
    return (f"{record.get('kind')} ({state}), ZeRO stage {record.get('zero_stage')} over "
            f"{record.get('group_size')} rank{'s' if record.get('group_size') != 1 else ''}")


def _problems(data: dict) -> None:
    # One plain line per note and problem (no wrapping), on stderr, whatever the format.
    for note in data.get("notes", ()):
        sys.stderr.write(f"msdist: note: {' '.join(note.split())}\n")
    for problem in data["problems"]:
        sys.stderr.write(f"msdist: problem: {' '.join(problem.split())}\n")


def render_written(data: dict, fmt: str) -> None:
    if fmt == "json":
        print_json(data)
        return
    line = Text.assemble(("wrote ", "bold"), data["output"], f" ({human_bytes(data['bytes'])}, "
                         f"{data['parameters']} parameters")
    if data.get("layout"):
        line.append(f", {data['files']} files, layout {_layout(data['layout'])}")
    line.append(f") from {data['source']}")
    stdout_console().print(line)
