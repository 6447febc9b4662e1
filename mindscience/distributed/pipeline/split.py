"""How many transformer layers each pipeline stage holds (pure: no MindSpore).

One function, :func:`stage_layers`, shared by the cost model (``plan --model``,
``suggest``), ``plan --schedule`` and the models that build a rank's stage, so what is
priced is what is built.

Real runs cut their layers unevenly (Megatron's options, same names):

* even (default): ``num_layers / (pp * v)`` per model stage;
* ``first_stage_layers`` / ``last_stage_layers``: the first / last model stage holds that
  many, the others share the rest evenly;
* ``account_for_embedding_in_pipeline_split`` / ``account_for_loss_in_pipeline_split``:
  the embedding (first stage) and the loss (last stage) count as one layer each, and the
  ``num_layers + 1 (+ 1)`` "layers" are split evenly.

Model stage ``k`` of ``pp * v``: with ``v`` virtual stages (interleaved schedule), chunk
``c`` of pipeline rank ``i`` is model stage ``c * pp + i`` (Megatron's assignment).

Example, Llama 3 405B on 16 stages (126 layers, embedding and loss counted)::

    >>> stage_layers(126, 16, account_for_embedding_in_pipeline_split=True,
    ...              account_for_loss_in_pipeline_split=True)
    [7, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 7]
    >>> stage_layers(5, 2, first_stage_layers=2)
    [2, 3]
"""

from __future__ import annotations

import numbers
from typing import Optional

from ..costmodel.errors import ModelConstraintError, ModelError

__all__ = ["stage_layers", "stage_layer_offsets", "model_stage_of"]


def _count(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ModelError(f"{name}={value!r} is invalid: expected an integer >= {minimum}.")
    return int(value)


def stage_layers(num_layers: int, pp: int, virtual_stages: int = 1, *,
                 first_stage_layers: Optional[int] = None,
                 last_stage_layers: Optional[int] = None,
                 account_for_embedding_in_pipeline_split: bool = False,
                 account_for_loss_in_pipeline_split: bool = False) -> list:
    """Layers of every model stage, in model-stage order (``pp * virtual_stages`` entries).

    Args:
        num_layers: Transformer layers of the whole model.
        pp: Pipeline stages (ranks of a pipeline group).
        virtual_stages: Model chunks per pipeline rank (``v``; 1 unless interleaved).
        first_stage_layers: Layers of model stage 0 (None: as the others).
        last_stage_layers: Layers of the last model stage (None: as the others).
        account_for_embedding_in_pipeline_split: The embedding counts as a layer of stage 0.
        account_for_loss_in_pipeline_split: The loss counts as a layer of the last stage.

    Returns:
        ``[layers of model stage 0, ..., layers of model stage pp*v - 1]``; they sum to
        ``num_layers`` and every entry is >= 1 when ``pp * v > 1`` (a stage without layers
        but with the embedding or loss is allowed only through the ``account_for``
        options, where it may hold 0).

    Raises:
        ModelConstraintError: the layers cannot be cut that way; the message names the
            values and the options that would cut them.
        ModelError: a count is not a positive integer, or the two kinds of options are mixed.
    """
    num_layers = _count("num_layers", num_layers, 1)
    pp = _count("pp", pp, 1)
    v = _count("virtual_stages", virtual_stages, 1)
    stages = pp * v
    explicit = first_stage_layers is not None or last_stage_layers is not None
    counted = bool(account_for_embedding_in_pipeline_split) + bool(account_for_loss_in_pipeline_split)
    if explicit and counted:
        raise ModelError(
            "first_stage_layers/last_stage_layers and account_for_*_in_pipeline_split cannot be "
            "combined (Megatron refuses it too): choose one way to cut the layers.")
    if stages == 1:
        if explicit and (first_stage_layers, last_stage_layers) not in ((None, None),):
            for name, value in (("first_stage_layers", first_stage_layers),
                                ("last_stage_layers", last_stage_layers)):
                if value is not None and value != num_layers:
                    raise ModelConstraintError(
                        f"{name}={value} with a single stage: it holds all {num_layers} layers. "
                        f"Drop {name} or use pp > 1.", "stage layers")
        return [num_layers]

    if counted:
        total = num_layers + counted
        if total % stages:
            raise ModelConstraintError(
                f"num_layers={num_layers} + {counted} (embedding/loss counted as layers) = {total} "
                f"does not split evenly over {stages} model stages (pp={pp} x v={v}). Use a stage "
                f"count that divides {total}, or first_stage_layers/last_stage_layers.", "num_layers % pp")
        each = total // stages
        out = [each] * stages
        if account_for_embedding_in_pipeline_split:
            out[0] -= 1
        if account_for_loss_in_pipeline_split:
            out[-1] -= 1
        if any(n < 0 for n in out):  # only possible with one layer per stage and both counted
            raise ModelConstraintError(
                f"num_layers={num_layers} on {stages} model stages leaves a stage with no room "
                "for the embedding and the loss. Use fewer stages.", "num_layers % pp")
        return out

    first = None if first_stage_layers is None else _count("first_stage_layers", first_stage_layers, 1)
    last = None if last_stage_layers is None else _count("last_stage_layers", last_stage_layers, 1)
    rest, middle = num_layers, stages
    if first is not None:
        rest, middle = rest - first, middle - 1
    if last is not None:
        rest, middle = rest - last, middle - 1
    if rest < middle or (middle == 0 and rest != 0) or (middle and rest % middle):
        given = ", ".join(f"{k}={x}" for k, x in (("first_stage_layers", first),
                                                      ("last_stage_layers", last)) if x is not None)
        hint = (f"the other {middle} stage(s) would share {rest} layers" if middle
                else f"they must add up to num_layers={num_layers}")
        even = [n for n in range(1, num_layers) if (num_layers - n) % (stages - 1) == 0
                and (num_layers - n) // (stages - 1) >= 1][:3]
        fix = (f" e.g. first_stage_layers={even[0]}" if even and not given else "")
        raise ModelConstraintError(
            f"num_layers={num_layers} cannot be cut into {stages} model stages (pp={pp} x v={v})"
            f"{' with ' + given if given else ''}: {hint}, which is not a whole number >= 1 each. "
            f"Choose pp*v dividing {num_layers}, or set first_stage_layers/last_stage_layers"
            f"{fix}, or account_for_embedding/loss_in_pipeline_split.", "num_layers % pp")
    each = rest // middle if middle else 0
    out = [each] * stages
    if first is not None:
        out[0] = first
    if last is not None:
        out[-1] = last
    return out


def stage_layer_offsets(layers: list) -> list:
    """Global index of the first layer of every model stage: ``[0, 2]`` for ``[2, 3]``."""
    offsets, at = [], 0
    for n in layers:
        offsets.append(at)
        at += n
    return offsets


def model_stage_of(pp_rank: int, chunk: int, pp: int) -> int:
    """Model stage of chunk ``chunk`` on pipeline rank ``pp_rank`` (``chunk * pp + pp_rank``)."""
    return chunk * pp + pp_rank
