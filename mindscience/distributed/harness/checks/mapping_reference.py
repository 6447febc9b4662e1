"""The numpy reference of the nine mappings, forward and backward, even and ragged.

Pure numpy: every rank computes what every group rank must get, from the inputs that it
can regenerate for any rank (small integers drawn from ``(seed, global rank, ...)``).

``sizes`` is the sequence (dim 0) length of each group rank: ``None`` means the even
split. Example, G = 2, global shape ``(3, 4)``, ``sizes=(2, 1)``: ``scatter_to_sequence``
gives group rank 0 rows 0-1 and rank 1 row 2; its gradient is the two upstream
gradients concatenated, ``(3, 4)`` on both ranks.
"""

from __future__ import annotations

import numpy as np

MAPPING_NAMES = (
    "copy_to_all",
    "reduce_from_all",
    "scatter_to_hidden",
    "gather_from_hidden",
    "scatter_to_sequence",
    "gather_from_sequence",
    "gather_from_sequence(tensor_parallel_output_grad=False)",
    "reduce_scatter_to_sequence",
    "all_to_all_from_hidden_to_sequence",
    "all_to_all_from_sequence_to_hidden",
)
# The mappings that split or join the sequence dim, and so take split_sizes.
SEQUENCE_MAPPINGS = (
    "scatter_to_sequence",
    "gather_from_sequence",
    "gather_from_sequence(tensor_parallel_output_grad=False)",
    "reduce_scatter_to_sequence",
    "all_to_all_from_hidden_to_sequence",
    "all_to_all_from_sequence_to_hidden",
)
DTYPES = ("float32", "float16", "bfloat16")
TOLERANCE = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 1e-2}
LOW, HIGH = -3, 4  # inputs and cotangents are integers in [-3, 3]

# Collectives each mapping runs (forward + backward), to report which are composed.
COLLECTIVES = {
    "copy_to_all": ("all_reduce",),
    "reduce_from_all": ("all_reduce",),
    "scatter_to_hidden": ("all_gather",),
    "gather_from_hidden": ("all_gather",),
    "scatter_to_sequence": ("all_gather",),
    "gather_from_sequence": ("all_gather", "reduce_scatter"),
    "gather_from_sequence(tensor_parallel_output_grad=False)": ("all_gather",),
    "reduce_scatter_to_sequence": ("reduce_scatter", "all_gather"),
    "all_to_all_from_hidden_to_sequence": ("all_to_all",),
    "all_to_all_from_sequence_to_hidden": ("all_to_all",),
}

# Which side of a sequence mapping holds this rank's shard of dim 0.
_LOCAL_IN = ("gather_from_sequence", "gather_from_sequence(tensor_parallel_output_grad=False)",
             "all_to_all_from_sequence_to_hidden")


def _sizes(S: int, G: int, sizes):
    return tuple(sizes) if sizes is not None else (S // G,) * G


def _rows(a, sizes, r):
    """Group rank r's shard of dim 0."""
    start = int(sum(sizes[:r]))
    return a[start:start + sizes[r]]


def _cols(a, G, r):
    return np.split(a, G, axis=-1)[r]


def input_shape(name: str, shape: tuple, G: int, r: int, sizes=None) -> tuple:
    """The input shape on group rank ``r`` for the global shape ``(S, ..., H)``."""
    S, H = shape[0], shape[-1]
    sizes = _sizes(S, G, sizes)
    if name in ("gather_from_hidden", "all_to_all_from_hidden_to_sequence"):
        shape = shape[:-1] + (H // G,)
    if name in _LOCAL_IN:
        shape = (sizes[r],) + shape[1:]
    return shape


def output_shape(name: str, shape: tuple, G: int, r: int, sizes=None) -> tuple:
    """The output shape on group rank ``r`` for the global shape ``(S, ..., H)``."""
    S, H = shape[0], shape[-1]
    sizes = _sizes(S, G, sizes)
    if name in ("scatter_to_hidden", "all_to_all_from_sequence_to_hidden"):
        shape = shape[:-1] + (H // G,)
    if name in ("scatter_to_sequence", "reduce_scatter_to_sequence",
                "all_to_all_from_hidden_to_sequence"):
        shape = (sizes[r],) + shape[1:]
    return shape


def reference(name: str, xs: list, cs: list, r: int, sizes=None):
    """Forward output and input gradient of mapping ``name`` on group rank ``r``.

    Args:
        name: One of :data:`MAPPING_NAMES`.
        xs: Every group rank's input, by group rank.
        cs: Every group rank's upstream gradient (same shape as its output).
        r: The group rank to compute for.
        sizes: The sequence length of each group rank; None: the even split.
    """
    G = len(xs)
    if name == "copy_to_all":
        return xs[r], sum(cs)
    if name == "reduce_from_all":
        return sum(xs), cs[r]
    if name == "scatter_to_hidden":
        return _cols(xs[r], G, r), np.concatenate(cs, -1)
    if name == "gather_from_hidden":
        return np.concatenate(xs, -1), _cols(cs[r], G, r)
    if name in _LOCAL_IN:
        sizes = tuple(x.shape[0] for x in xs) if sizes is None else tuple(sizes)
    else:
        sizes = _sizes(xs[r].shape[0], G, sizes)
    if name == "scatter_to_sequence":
        return _rows(xs[r], sizes, r), np.concatenate(cs, 0)
    if name == "gather_from_sequence":
        return np.concatenate(xs, 0), _rows(sum(cs), sizes, r)
    if name == "gather_from_sequence(tensor_parallel_output_grad=False)":
        return np.concatenate(xs, 0), _rows(cs[r], sizes, r)
    if name == "reduce_scatter_to_sequence":
        return _rows(sum(xs), sizes, r), np.concatenate(cs, 0)
    if name == "all_to_all_from_hidden_to_sequence":
        return _rows(np.concatenate(xs, -1), sizes, r), _cols(np.concatenate(cs, 0), G, r)
    if name == "all_to_all_from_sequence_to_hidden":
        return _cols(np.concatenate(xs, 0), G, r), _rows(np.concatenate(cs, -1), sizes, r)
    raise ValueError(f"unknown mapping {name!r}: expected one of {', '.join(MAPPING_NAMES)}")


def ints(shape, *key) -> np.ndarray:
    """Small integers in [LOW, HIGH) from the seed ``key``: exact in every dtype."""
    rng = np.random.default_rng([abs(int(k)) for k in key])
    return rng.integers(LOW, HIGH, size=shape).astype(np.float32)


def max_error(got: np.ndarray, want: np.ndarray) -> float:
    if got.shape != want.shape:
        return float("inf")
    if got.size == 0:
        return 0.0
    return float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
