"""What ``fully_shard`` runs, per execution mode: pure Python, no MindSpore import.

The runtime (:mod:`.unit`) and the cost model (``costmodel/runtime.py``) both read these
functions, so what the cost model prices is what runs.

* PyNative: one bucketed all-gather per unit (per dtype of its parameters) before the
  unit's forward; with ``reshard_after_forward`` the unit's gathered weights are freed when
  its forward ends and gathered again at its backward (2 gathers per micro-batch); with
  ``prefetch`` the next unit's gather (in forward order, then in backward order) is
  launched asynchronously while the current unit computes. A unit that contains other
  units (the root: embeddings, head) keeps its weights from its forward to its backward,
  as torch FSDP2 does, since its backward follows its forward at once.
* Compiled (``"jit"``: ``ms.jit`` and GRAPH_MODE): one all-gather per parameter inside the
  graph, kept from the forward to the backward, nothing prefetched: the graph cannot hold
  the eager unit state, and recomputed gathers of a group were ordered differently on
  different ranks (measured: wrong gradients at dp4).
"""

from __future__ import annotations

__all__ = ["MODES", "fsdp_runtime", "unit_reshards", "peak_gathered_bytes"]

MODES = ("pynative", "jit", "graph")

_COMPILED_REASON = (
    "compiled code (ms.jit / GRAPH_MODE) all-gathers each parameter inside the graph and "
    "keeps the gathered weights from the forward to the backward ({asked} run in PyNative "
    "only: recomputed gathers of a group were ordered differently on different ranks)"
)


def _check(mode, reshard_after_forward, prefetch):
    if mode not in MODES:
        raise ValueError(f"fsdp_runtime: mode={mode!r}; expected one of {', '.join(MODES)} "
                         "('jit' covers ms.jit and GRAPH_MODE alike)")
    for name, value in (("reshard_after_forward", reshard_after_forward), ("prefetch", prefetch)):
        if not isinstance(value, bool):
            raise ValueError(f"fsdp_runtime: {name}={value!r} must be True or False")


def fsdp_runtime(mode: str, reshard_after_forward: bool = True, prefetch: bool = True) -> dict:
    """What ``fully_shard(..., reshard_after_forward=, prefetch=)`` runs in ``mode``.

    Args:
        mode: ``"pynative"``, ``"jit"`` or ``"graph"`` (the last two run alike).
        reshard_after_forward: What the user asked for.
        prefetch: What the user asked for.

    Returns:
        A dict: ``reshard_after_forward`` and ``prefetch`` (bools, what runs),
        ``gathers_per_unit`` (all-gathers of a unit per micro-batch, 1 or 2),
        ``units_alive`` (most units, besides the root unit, whose gathered weights are
        alive at once: 2 with reshard and prefetch, 1 with reshard alone, None when
        every unit's stay alive until the backward) and ``reason`` (why something asked
        does not run in this mode, or None).

    Raises:
        ValueError: an unknown mode or a non-bool flag.

    Example: ``fsdp_runtime("pynative")["units_alive"] == 2``;
    ``fsdp_runtime("jit")["reshard_after_forward"] is False``.
    """
    _check(mode, reshard_after_forward, prefetch)
    if mode == "pynative":
        units_alive = (2 if prefetch else 1) if reshard_after_forward else None
        return {"reshard_after_forward": reshard_after_forward, "prefetch": prefetch,
                "gathers_per_unit": 2 if reshard_after_forward else 1,
                "units_alive": units_alive, "reason": None}
    asked = [name for name, on in (("reshard_after_forward", reshard_after_forward),
                                   ("prefetch", prefetch)) if on]
    reason = None
    if asked:
        reason = _COMPILED_REASON.format(asked=" and ".join(asked))
    return {"reshard_after_forward": False, "prefetch": False, "gathers_per_unit": 1,
            "units_alive": None, "reason": reason}


def unit_reshards(reshard_after_forward: bool, has_sub_units: bool) -> bool:
    """Whether a unit frees its gathered weights after its forward (PyNative).

    A unit that contains other units (the root) keeps them: its backward starts right
    after its forward ends (torch FSDP2 does the same).
    """
    return bool(reshard_after_forward) and not has_sub_units


def peak_gathered_bytes(unit_bytes, root_bytes: int = 0, reshard_after_forward: bool = True,
                        prefetch: bool = True) -> int:
    """Most bytes of gathered weights alive at once in a PyNative forward + backward.

    Args:
        unit_bytes: Full (unpadded) parameter bytes of each leaf unit, in forward order.
        root_bytes: Those of the root unit (the parameters no leaf unit holds), alive
            throughout.
        reshard_after_forward: Whether the leaf units reshard.
        prefetch: Whether the next unit's gather is launched ahead.

    Returns:
        ``root + sum(units)`` without reshard; ``root + max(unit)`` with reshard alone;
        ``root + max(unit[i] + unit[i+1])`` with reshard and prefetch (the same pairs in
        the backward, in reverse order).

    Example: ``peak_gathered_bytes([100, 100, 40], 10) == 210``.
    """
    sizes = [int(b) for b in unit_bytes]
    if any(b < 0 for b in sizes) or int(root_bytes) < 0:
        raise ValueError(f"peak_gathered_bytes: unit_bytes={list(unit_bytes)!r} and "
                         f"root_bytes={root_bytes!r} must be >= 0")
    if not sizes:
        return int(root_bytes)
    if not reshard_after_forward:
        return int(root_bytes) + sum(sizes)
    if not prefetch or len(sizes) == 1:
        return int(root_bytes) + max(sizes)
    return int(root_bytes) + max(a + b for a, b in zip(sizes, sizes[1:]))
