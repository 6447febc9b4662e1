"""The global weights of GPTModel and each rank's slice of them (numpy only).

Every global parameter is drawn from its own numpy generator keyed by ``(seed, global
name)``, e.g. ``layers.3.mlp.fc1.weight``. A rank draws only the tensors of its layers
(not the whole model) and keeps its slice; whatever the layout, the slices put back
together are the dense model's tensors, and a layer's weights do not depend on which
other layers a stage holds.

Initialization (GPT-2 / Megatron): linear weights and embeddings ``N(0, 0.02)``, the
output projections of attention and MLP ``N(0, 0.02 / sqrt(2 L))``, biases zero, norm
weights one and norm biases zero.

Slices (tp group of size ``G``, rank ``r``): a column-parallel weight ``[out, in]`` keeps
rows ``r*out/G ..``; with ``stride`` 2 (SwiGLU's fused ``[gate; up]``) rank r keeps rows r
of each half, ``[gate_r; up_r]``; a row-parallel weight keeps columns ``r*in/G ..``.
"""

from __future__ import annotations

import math
import zlib

import numpy as np

__all__ = ["draw", "tp_slice", "STD"]

STD = 0.02


def _generator(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(name.encode("utf-8"))])


def draw(seed: int, name: str, shape, kind: str, num_layers: int = 1) -> np.ndarray:
    """The global tensor ``name`` (float32).

    Args:
        seed: The model seed (``mindspore.set_seed``'s, 0 when none was set).
        name: Global parameter name; the generator's key.
        shape: Its full shape.
        kind: ``"normal"`` (std 0.02), ``"output"`` (std 0.02 / sqrt(2 num_layers)),
            ``"zeros"`` or ``"ones"``.
        num_layers: The model's layer count (for ``"output"``).

    Example: ``draw(0, "layers.0.attention.qkv.weight", (192, 64), "normal")`` is the same
    array on every rank and at every layout.
    """
    shape = tuple(int(s) for s in shape)
    if kind == "zeros":
        return np.zeros(shape, np.float32)
    if kind == "ones":
        return np.ones(shape, np.float32)
    std = STD if kind == "normal" else STD / math.sqrt(2.0 * num_layers)
    return (_generator(seed, name).standard_normal(shape) * std).astype(np.float32)


def tp_slice(full: np.ndarray, dim, rank: int, size: int, stride: int = 1) -> np.ndarray:
    """Rank ``rank``'s part of ``full`` split over ``size`` ranks along ``dim`` (None: all).

    ``stride`` > 1 splits each of ``stride`` equal blocks of ``dim`` and concatenates this
    rank's pieces: ``tp_slice(arange(8), 0, 1, 2, stride=2) == [2, 3, 6, 7]``.
    """
    if dim is None or size == 1:
        return full
    blocks = np.split(full, stride, axis=dim)
    return np.concatenate([np.split(b, size, axis=dim)[rank] for b in blocks], axis=dim)


def tp_unslice(parts: list, dim, stride: int = 1) -> np.ndarray:
    """The inverse of :func:`tp_slice`: the full tensor from every rank's part, in rank order."""
    if dim is None:
        return parts[0]
    pieces = [np.split(p, stride, axis=dim) for p in parts]
    return np.concatenate([pieces[r][s] for s in range(stride) for r in range(len(parts))], axis=dim)
