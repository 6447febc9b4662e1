"""Rich view of a pipeline schedule and the embedding groups (``msdist plan --schedule``)."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from mindscience.distributed.pipeline.schedules import Action

_STYLE = {"F": "cyan", "B": "magenta"}


def timeline_text(sched: dict) -> Text:
    """One line per stage, one column per time unit (a forward = 1, a backward = 2)."""
    labels = [str(Action(e["kind"], e["microbatch"], e["chunk"]))
              for rank in sched["timeline"] for e in rank]
    width = max([len(s) for s in labels] + [2])
    text = Text()
    for r, rank in enumerate(sched["timeline"]):
        cells = [None] * sched["makespan"]
        for e in rank:
            for t in range(e["start"], e["end"]):
                cells[t] = e
        text.append(f"stage {r} | ", style="bold")
        for cell in cells:
            if cell is None:
                text.append(".".ljust(width) + " ", style="dim")
            else:
                label = str(Action(cell["kind"], cell["microbatch"], cell["chunk"]))
                text.append(label.ljust(width) + " ", style=_STYLE[cell["kind"]])
        text.append("\n")
    return text


def schedule_view(data: dict) -> list:
    """The schedule's heading, timeline and per-stage table; the embedding groups."""
    out = []
    emb = data.get("embedding_groups")
    if emb:
        shown = ", ".join("(" + ", ".join(map(str, g)) + ")" for g in emb[:8])
        more = f" ... {len(emb)} in all" if len(emb) > 8 else ""
        out.append(Text.assemble(("embedding groups ", "bold"), "(first + last stage; tied "
                                 "parameters are summed over them): ", shown + more))
    sched = data.get("schedule")
    if not sched:
        return out
    head = Text.assemble(
        ("schedule ", "bold"), (sched["schedule"], "bold cyan"),
        f"  p={sched['stages']} m={sched['microbatches']} v={sched['virtual_stages']}  "
        f"makespan {sched['makespan']} units (forward = 1, backward = 2)  bubble "
        f"{sched['bubble_fraction']:.1%} of stage time, idle/compute "
        f"{sched['bubble_ratio']:.3f} vs (p-1)/(v m) = {sched['theoretical_bubble_ratio']:.3f}")
    table = Table(show_edge=False, pad_edge=False)
    layers = sched.get("stage_layers")  # with a model: layers per model stage (chunk c of rank r: c*p + r)
    p = sched["stages"]
    for col in ("stage", "steps", "idle", "peak in flight") + (("layers",) if layers else ()):
        table.add_column(col, justify="right")
    for r in range(p):
        mine = [str(layers[k]) for k in range(r, len(layers), p)] if layers else []
        table.add_row(str(r), str(len(sched["actions"][r])), f"{sched['idle_fraction'][r]:.1%}",
                      str(sched["peak_in_flight"][r]), *(["+".join(mine)] if layers else []))
    parts = [head, timeline_text(sched)]
    if sched.get("layer_timeline"):  # unequal stages: the same order with durations in layers
        parts += [Text.assemble(("durations in layers ", "bold"), f"(a forward of model stage k = its layers "
                                f"{sched['stage_layers']}[k] units, a backward twice): makespan "
                                f"{sched['layer_makespan']} units"),
                  timeline_text({"timeline": sched["layer_timeline"], "makespan": sched["layer_makespan"]})]
    out.append(Group(*parts, table))
    return out
