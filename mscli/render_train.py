"""Rendering of ``msdist train``: the run, a line per step as it happens, then measured beside predicted.

Like :mod:`mscli.render`, it only draws the plain data the command built
(:mod:`mindscience.distributed.training.report`).
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .render import RECORD_WIDTH, print_json, stderr_console, stdout_console
from .render_cost import human_bytes, human_rate, human_seconds


def step_line(row: dict) -> str:
    """``step   3  loss 5.5123  0.41 s  1.25 K tokens/s  MFU 0.8%``; a MoE model's adds
    ``aux 0.0102  load 1.38x  dropped 0`` (max/mean tokens per expert of the busiest layer)."""
    line = (f"step {row['step']:>4}  loss {row['loss']:.6f}  {human_seconds(row['time_s'])}  "
            f"{human_rate(row['tokens_per_s'])} tokens/s  MFU {row['mfu']:.2%}")
    if row.get("aux_loss") is not None:
        line += (f"  aux {row['aux_loss']:.4f}  load {row.get('max_load', 0.0):.2f}x  "
                 f"dropped {row.get('dropped_tokens', 0)}")
    return line


def _ratio(value) -> Text:
    if value is None:
        return Text("-", style="dim")
    style = "green" if 0.5 <= value <= 2 else "yellow"
    return Text(f"{value:.2f}x", style=style)


def _value(row: dict, key: str) -> str:
    value = row[key]
    if value is None:
        return "not measured"
    if row["what"].endswith("(bytes)"):
        return human_bytes(value)
    if row["what"].startswith("step time"):
        return human_seconds(value)
    return human_rate(value)


def comparison_table(report: dict) -> Table:
    """Measured vs predicted: step time, tokens/s, and per stage the bytes of each kind."""
    layout = report["layout"]
    table = Table(title=f"measured vs predicted (cost model, device peak {report['cluster']['peak_tflops']:g} "
                        f"TFLOP/s x {report['cluster']['compute_efficiency']:.3g})",
                  title_justify="left", caption_justify="left", show_edge=False, pad_edge=False)
    for column, justify in (("what", "left"), ("stage", "right"), ("measured", "right"), ("predicted", "right"),
                            ("ratio", "right")):
        table.add_column(column, justify=justify, no_wrap=True)
    for row in report["comparison"]:
        table.add_row(row["what"], "" if row["stage"] is None else str(row["stage"]), _value(row, "measured"),
                      _value(row, "predicted"), _ratio(row["ratio"]))
    measured = report["measured"]
    table.caption = (f"step time: median of {measured['steps_timed']} step(s) after the first (which compiles); "
                     "bytes: the largest rank of each stage, counted from its Parameters "
                     f"(opt.memory_bytes()); activations are estimated only (CPU memory counters read 0). "
                     f"Layout tp={layout['tp']} cp={layout['cp']} dp={layout['dp']} pp={layout['pp']}.")
    return table


def restarts_table(restarts: list) -> Table:
    """One row per restart: when, which rank and why, the step resumed from, what was lost."""
    table = Table(title=f"{len(restarts)} restart(s) (--max-restarts)", title_justify="left", show_edge=False,
                  pad_edge=False)
    for column, justify in (("#", "right"), ("at", "right"), ("rank", "right"), ("why", "left"),
                            ("resumed from", "right"), ("steps lost", "right"), ("time lost", "right"),
                            ("layout", "left")):
        table.add_column(column, justify=justify, no_wrap=column != "why")
    for r in restarts:
        layout = r.get("layout")
        table.add_row(str(r["attempt"]), human_seconds(r["at_s"]), str(r["rank"]), f"{r['kind']}: {r['reason']}",
                      f"step {r['resumed_from']}", str(r["steps_lost"]), human_seconds(r["seconds_lost"]),
                      "same" if not layout else f"tp={layout['tp']} cp={layout['cp']} dp={layout['dp']} "
                                                f"pp={layout['pp']}")
    return table


def render_header(model: dict, training: dict, layout: dict, resumed: dict | None) -> None:
    """What runs (printed before the ranks start): model, layout, batch, and the resumed step."""
    console = stdout_console()
    console.print(Text(
        f"msdist train: {model.get('name') or 'model'} at tp={layout['tp']} cp={layout['cp']} dp={layout['dp']} "
        f"pp={layout['pp']}{_expert_axes(layout)} ({layout['world_size']} ranks), "
        f"{training['global_batch_size']} sequences x "
        f"{model['seq_length']} tokens per step, micro-batch {training['micro_batch_size']}, zero stage "
        f"{training['zero_stage']}, recompute {training['recompute']}, {training['mode']}", style="bold"))
    if resumed:
        console.print(f"resumed from {resumed['directory']} (step {resumed['step']})")


def _expert_axes(layout: dict) -> str:
    """`` ep=4 etp=1`` when the layout has expert axes of its own, else empty."""
    ep, etp = layout.get("ep", 1) or 1, layout.get("etp")
    if ep == 1 and (etp is None or etp == layout["tp"]):
        return ""
    return f" ep={ep} etp={etp if etp is not None else layout['tp']}"


def live_console() -> Console:
    """The stdout console for lines printed while the progress display runs on stderr.

    The display (a Rich Live) redirects ``sys.stdout`` through itself while it runs, so
    that on a terminal a line goes above the progress bars of the same screen. When stdout
    is not a terminal (a file, a pipe) that redirection would send the line to stderr:
    write to the real stdout instead.
    """
    out = sys.stdout
    real = getattr(out, "rich_proxied_file", out)
    isatty = getattr(real, "isatty", None)
    console = Console(file=out if isatty is not None and isatty() else real, highlight=False, soft_wrap=False)
    if not console.is_terminal:
        console.width = RECORD_WIDTH
    return console


def print_steps(rows: list, console: Console | None = None) -> None:
    """One :func:`step_line` per row, as the steps finish (see :func:`live_console`)."""
    console = console or live_console()
    for row in rows:
        console.print(step_line(row))


def render_report(report: dict, shown=()) -> None:
    """The end of the human view: the step lines not ``shown`` during the run, the
    comparison table, the checkpoints written (:func:`render_header` printed the title)."""
    console = stdout_console()
    for row in report["steps"]:
        if row["step"] not in shown:
            console.print(step_line(row))
    console.print(comparison_table(report))
    for path in report.get("checkpoints") or []:
        console.print(f"saved {path}")
    restarts = report.get("restarts") or []
    if restarts:
        console.print(restarts_table(restarts))
    stopped = report.get("stopped")
    if stopped:
        where = stopped["saved"] or "nothing (no --save)"
        console.print(Text(f"stopped on a signal after step {stopped['step']}: every rank saved {where}; "
                           "resume with --resume on the --save folder (exit code 3)", style="bold yellow"))


def restart_line(record: dict) -> str:
    """``restart 1: rank 1 crash at step 3 -> resumed from step 2 (DIR), 0 step(s) and 6.1 s lost``."""
    where = record["checkpoint"] or "no checkpoint: from the start"
    line = (f"restart {record['attempt']}: rank {record['rank']} {record['kind']} after step {record['reached_step']} "
            f"({record['at_s']:.1f} s into the run) -> resumed from step {record['resumed_from']} ({where}); "
            f"{record['steps_lost']} step(s) and {record['seconds_lost']:.1f} s lost")
    if record.get("layout"):
        line += f"; {record['why']}"
    return line


def print_restart(record: dict, console: Console | None = None) -> None:
    """The line of a restart, as it happens (its reason follows, dimmed)."""
    console = console or live_console()
    console.print(Text(restart_line(record), style="bold yellow"))
    console.print(Text(f"  {record['reason']}", style="dim"))


def render_failures(failures: list, log_dir: str, fmt: str, restarts=(), failure=None) -> None:
    """Which rank failed and why (stderr; with --format json also the JSON on stdout), after
    the restarts that ran (``--max-restarts``: the last failure is the run's)."""
    if fmt == "json":
        print_json({"ok": False, "failures": failures, "log_dir": log_dir, "restarts": list(restarts),
                    "failure": failure})
    err = stderr_console()
    if restarts:
        err.print(Text(f"{len(restarts)} restart(s) ran; the last launch failed too: no restart left "
                       "(--max-restarts).", style="bold red"))
    if failure and not any(f["reason"].endswith(failure) for f in failures or []):
        err.print(Text(f"stopped: {failure}", style="bold red"))
    for item in failures or [{"rank": -1, "reason": "the run did not finish", "log_tail": ""}]:
        err.print(Text(f"rank {item['rank']} failed: {item['reason']}", style="bold red"))
        if item.get("log_tail"):
            err.print(Panel(Text(item["log_tail"]), title=f"rank {item['rank']} log tail", border_style="red"))
    err.print(f"logs: {log_dir}")


def render_interrupted(outcome: dict, fmt: str) -> None:
    """A second signal stopped every rank at once."""
    message = outcome.get("failure") or "stopped at once by a second signal: nothing more was saved"
    if fmt == "json":
        print_json({"ok": False, "interrupted": True, "failure": message, "restarts": outcome.get("restarts")})
    stderr_console().print(Text(f"msdist train: {message}", style="bold red"))


def node_done(node_rank: int, ok: bool) -> None:
    stderr_console().print(f"node {node_rank}: {'ok' if ok else 'FAILED'}; node 0 prints the report.")
