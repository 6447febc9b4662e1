"""Which slice of each parameter a rank holds and writes, for any layout (pure arithmetic).

A parameter of global shape ``S`` with sharding ``{"axis": "tp", "partition_dim": d,
"partition_stride": s}`` is held by tp rank ``r`` as the concatenation along ``d`` of the
global ranges :func:`~mindscience.distributed.sharding.local_slices` gives. A *piece* is
that as data: ``{"dim": d, "ranges": [[g0, g1, l0], ...]}`` (global ``[g0, g1)`` along
``d`` is local ``[l0, l0 + g1 - g0)``; every other dim whole), or ``{"dim": None}`` for a
whole (replicated) tensor.

Writers: a rank writes a parameter when its coordinates on every axis that does NOT
split the parameter (except pp, whose stages hold different parameters) are 0, so each
element is written once per pipeline stage holding it. Example, tp2 x dp2 (order
tp-cp-dp-pp): ranks 0 and 1 (dp 0) write their tp shards of a column weight, rank 0
alone writes a replicated LayerNorm weight, ranks 2 and 3 write nothing.

Pipeline stages of a new layout (offline reshard with another pp), :func:`place_stages`:

* a parameter of global layer ``i`` (the manifest's ``layer``: the index after one of the
  prefixes given to ``set_global_layer_names``, ``layers`` by default, recorded at save)
  goes to stage ``i * pp // L``, ``L`` the number of layers (the last index + 1);
* the others go by their place in the saved parameter order (stage by stage, then
  ``position``, the order of ``cell.parameters_and_names()``): before the first layer's
  parameters (an embedding) -> the first stage; after the last layer's (a final norm, an
  output head) -> the last stage; between two layers -> the stage of the layer before;
* optimizer state (a ``base`` parameter recorded) goes with its parameter; state with no
  parameter (a step counter, the learning rate) by its own position (in a pp1 save it
  comes after the model's parameters: the last stage). ``load`` finds a parameter in any
  file, so this placement decides only which rank file holds what.

A version-1 manifest records no layer nor position: the layer is read from
``layers.<i>`` in the name, and the others keep their saved first/last-stage role.
"""

from __future__ import annotations

import re

from ..sharding import local_slices
from ..topology.layout import Layout
from .errors import CheckpointError

__all__ = ["layout_from_dict", "piece_for", "local_shape", "writes", "stage_for", "place_stages",
           "layer_index", "LAYER_RE", "expert_name", "expert_entries", "EXPERT_AXES", "check_experts"]

# The axes of the expert layers (Megatron's folding: etp x ep x edp x pp over the same
# ranks as tp x cp x dp x pp); a rank's coordinates on them come from Layout.expert_coords.
EXPERT_AXES = ("etp", "ep", "edp")

LAYER_RE = re.compile(r"(^|\.)layers\.(\d+)(?=\.|$)")


def _prefix_re(prefix: str):
    return re.compile(r"(^|\.)" + re.escape(prefix) + r"\.(\d+)(?=\.|$)")


def layer_index(name: str, prefixes=("layers",)):
    """The global layer index in ``name``: the number after the first of ``prefixes``
    found (``"net.blocks.3.w"`` with prefix ``blocks`` -> 3), or None."""
    for prefix in prefixes:
        m = _prefix_re(prefix).search(name)
        if m:
            return int(m.group(2))
    return None


def layout_from_dict(data: dict) -> Layout:
    keys = ("world_size", "tp", "cp", "dp", "pp", "order", "ep", "etp")
    return Layout(**{k: data[k] for k in keys if data.get(k) is not None})


def _axis_size(layout: Layout, axis) -> int:
    return 1 if axis is None else int(getattr(layout, axis, 1))


def _coords(layout: Layout, rank: int, axis=None) -> dict:
    """The rank's coordinates on the dense axes, or on the expert ones when ``axis`` is one."""
    if axis in EXPERT_AXES:
        return layout.expert_coords(rank)
    return layout.coords(rank)


# ------------------------------------------------------------------ experts
# An expert parameter (``param.expert_parallel``: dim 0 = the ep rank's local experts,
# ep rank e holding global experts [e*L, (e+1)*L)) is stored as one entry PER GLOBAL
# EXPERT, ``<head>.<k>.<last>`` (``layers.1.mlp.experts.w1`` -> ``layers.1.mlp.experts.3.w1``),
# of the parameter's shape without dim 0, split only by its etp mark (its dims shifted by
# one). Its sharding records ``"expert": {"index": k, "count": E}``. So every entry has at
# most one split dim (the format's pieces), a checkpoint of any ep loads at any other
# ep (a rank reads the entries of the experts it holds), and merge gives one tensor per
# expert.


def _component_at(name: str, tail: str) -> int:
    """Where ``tail`` occurs in ``name`` as whole dot-separated components (last one), or -1."""
    pos = name.rfind(tail)
    while pos >= 0:
        end = pos + len(tail)
        if (pos == 0 or name[pos - 1] == ".") and (end == len(name) or name[end] == "."):
            return pos
        pos = name.rfind(tail, 0, pos)
    return -1


def expert_name(name: str, index: int, base: str | None = None) -> str:
    """The checkpoint name of global expert ``index`` of the expert parameter ``name``; for
    an optimizer state, ``base`` (its parameter's name) says where the index goes.

        >>> expert_name("0.layers.1.mlp.experts.w1", 3)
        '0.layers.1.mlp.experts.3.w1'
        >>> expert_name("1.layers.1.mlp.experts.w1.exp_avg", 3, base="0.layers.1.mlp.experts.w1")
        '1.layers.1.mlp.experts.3.w1.exp_avg'
    """
    if base and base != name:
        parts = base.split(".")
        for i in range(len(parts) - 1):
            tail = ".".join(parts[i:])
            pos = _component_at(name, tail)
            if pos >= 0:
                return name[:pos] + expert_name(tail, index) + name[pos + len(tail):]
    head, _, last = name.rpartition(".")
    return f"{head}.{int(index)}.{last}" if head else f"{int(index)}.{last}"


def expert_sharding(sharding: dict, index: int, count: int) -> dict:
    """The sharding of one expert's entry: the parameter's without its dim 0."""
    out = dict(sharding)
    if out.get("axis") is not None:
        if out.get("partition_dim") in (None, 0):
            raise CheckpointError(f"an expert parameter split over {out['axis']!r} along dim "
                                  f"{out.get('partition_dim')!r}: dim 0 holds the local experts "
                                  "(split over ep); mark the ffn dim instead.")
        out["partition_dim"] = int(out["partition_dim"]) - 1
    out["expert"] = {"index": int(index), "count": int(count)}
    return out


def check_experts(name: str, count: int, layout: Layout) -> int:
    """Local experts per ep rank for ``count`` global experts at ``layout``.

    Raises:
        CheckpointError: ``ep`` does not divide the expert count.
    """
    ep = int(getattr(layout, "ep", 1) or 1)
    if count % ep:
        raise CheckpointError(f"parameter {name!r}: {count} experts are not divisible by ep={ep}: "
                              "every ep rank holds num_experts/ep whole experts. Choose an ep "
                              f"that divides {count}.")
    return count // ep


def expert_entries(name: str, local_count: int, layout: Layout, rank: int, base: str | None = None) -> list:
    """``[(global expert index, checkpoint name)]`` of the ``local_count`` experts ``rank``
    holds (``base``: an optimizer state's parameter, see :func:`expert_name`)."""
    first = layout.expert_coords(rank)["ep"] * int(local_count)
    return [(first + j, expert_name(name, first + j, base)) for j in range(int(local_count))]


def check_splittable(name: str, global_shape, sharding: dict, layout: Layout) -> None:
    """Raise if ``layout`` cannot split the parameter as its sharding says."""
    axis = sharding.get("axis")
    if axis is None:
        return
    dim, stride = sharding["partition_dim"], sharding.get("partition_stride", 1)
    size = _axis_size(layout, axis)
    if dim >= len(global_shape):
        raise CheckpointError(f"parameter {name!r}: partition_dim={dim} but its global shape "
                              f"{tuple(global_shape)} has {len(global_shape)} dims.")
    if global_shape[dim] % (size * stride):
        raise CheckpointError(
            f"parameter {name!r}: dim {dim} of its global shape {tuple(global_shape)} is "
            f"{global_shape[dim]}, not divisible by {axis}={size}"
            + (f" x partition_stride {stride}" if stride > 1 else "")
            + f": the new layout cannot split it. Choose a {axis} size that divides "
            f"{global_shape[dim] // stride}.")


def piece_for(name: str, global_shape, sharding: dict, layout: Layout, rank: int) -> dict:
    """The piece of the parameter that ``rank`` holds under ``layout``."""
    axis = sharding.get("axis")
    if axis is None:
        return {"dim": None}
    check_splittable(name, global_shape, sharding, layout)
    dim = sharding["partition_dim"]
    size = _axis_size(layout, axis)
    coord = _coords(layout, rank, axis)[axis] if size > 1 else 0
    ranges, local = [], 0
    for g0, g1 in local_slices(global_shape[dim], size, coord, sharding.get("partition_stride", 1)):
        ranges.append([g0, g1, local])
        local += g1 - g0
    return {"dim": dim, "ranges": ranges}


def local_shape(global_shape, piece: dict) -> tuple:
    shape = list(global_shape)
    if piece["dim"] is not None:
        shape[piece["dim"]] = sum(g1 - g0 for g0, g1, _ in piece["ranges"])
    return tuple(shape)


def global_shape_from_local(name: str, local, sharding: dict, layout: Layout) -> tuple:
    """The global shape of a parameter from this rank's local shape."""
    shape = list(local)
    axis = sharding.get("axis")
    if axis is not None:
        dim = sharding["partition_dim"]
        if dim >= len(shape):
            raise CheckpointError(f"parameter {name!r}: partition_dim={dim} is out of range for "
                                  f"its local shape {tuple(local)}.")
        shape[dim] *= _axis_size(layout, axis)
    return tuple(shape)


def writes(layout: Layout, rank: int, axis, expert: dict | None = None) -> bool:
    """Whether ``rank`` writes (its piece of) a parameter split over ``axis``.

    ``expert`` (an expert entry's ``{"index", "count"}``): the ep rank holding that
    expert writes it, from its etp rank(s) (each its piece) of expert-data-parallel rank 0.
    """
    if expert is not None:
        local = check_experts(f"expert {expert['index']}", int(expert["count"]), layout)
        coords = layout.expert_coords(rank)
        if coords["ep"] != int(expert["index"]) // local:
            return False
        return all(coords[a] == 0 for a in ("etp", "edp") if a != axis)
    coords = layout.coords(rank)
    return all(coords[a] == 0 for a in ("tp", "cp", "dp") if a != axis)


def stage_for(name: str, saved_stage: int, saved_pp: int, new_pp: int, num_layers: int) -> int:
    """The pipeline stage holding ``name`` under a layout with ``new_pp`` stages."""
    if new_pp == saved_pp:
        return saved_stage
    m = LAYER_RE.search(name)
    if m and num_layers:
        return int(m.group(2)) * new_pp // num_layers
    if saved_pp > 1 and saved_stage == saved_pp - 1:
        return new_pp - 1
    return min(saved_stage, new_pp - 1) if saved_stage == 0 else new_pp - 1


def count_layers(names) -> int:
    idx = [int(m.group(2)) for m in (LAYER_RE.search(n) for n in names) if m]
    return max(idx) + 1 if idx else 0


def place_stages(params: dict, saved_pp: int, new_pp: int) -> dict:
    """{name: stage under ``new_pp`` stages} for a manifest's ``parameters`` (the rules in
    the module doc)."""
    if new_pp == saved_pp:
        return {n: e.get("stage", 0) for n, e in params.items()}
    if any(e.get("position") is None or "layer" not in e for e in params.values()):
        num = count_layers(params)  # format 1
        return {n: stage_for(n, e.get("stage", 0), saved_pp, new_pp, num) for n, e in params.items()}
    layers = [e["layer"] for e in params.values() if e["layer"] is not None]
    num = max(layers) + 1 if layers else 0
    # The model's parameters (no base) in saved order; state follows its base.
    model = sorted((n for n, e in params.items() if not e.get("base") or e["base"] not in params),
                   key=lambda n: (params[n].get("stage", 0), params[n]["position"], n))
    at = [i for i, n in enumerate(model) if params[n]["layer"] is not None]
    out, last = {}, None
    for i, name in enumerate(model):
        layer = params[name]["layer"]
        if layer is not None:
            last = out[name] = layer * new_pp // num
        elif not at or i < at[0]:
            out[name] = 0
        else:
            out[name] = new_pp - 1 if i > at[-1] else last
    for name, entry in params.items():
        if name not in out:
            out[name] = out[entry["base"]]
    return out


def rename_layers(name: str, offset: int, prefix: str = "layers") -> str:
    """``name`` with the index after ``<prefix>.`` shifted by ``offset``:
    ``rename_layers("net.layers.1.w", 4)`` -> ``"net.layers.5.w"``."""
    pattern = _prefix_re(prefix)
    return pattern.sub(lambda m: f"{m.group(1)}{prefix}.{int(m.group(2)) + offset}", name, count=1)
