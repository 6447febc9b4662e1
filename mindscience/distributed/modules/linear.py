"""Tensor-parallel linear layers (Megatron's column / row split), with sequence parallelism.

A dense layer ``y = x @ W.T + b`` with ``W`` of shape ``[out, in]`` is split over the
``G`` ranks of the tensor-parallel (tp) group in one of two ways:

===================  ====================  ==================  ===============================
layer                weight on each rank   bias on each rank   communication (forward)
===================  ====================  ==================  ===============================
ColumnParallel       ``[out/G, in]``       ``[out/G]``         input: copy (or all-gather of
                     (rows of ``W``)                           the sequence); output: optional
                                                               all-gather of the last dim
RowParallel          ``[out, in/G]``       ``[out]`` (whole)   input: optional scatter of the
                     (columns of ``W``)                        last dim; output: all-reduce
                                                               (or reduce-scatter of the
                                                               sequence)
===================  ====================  ==================  ===============================

Example, tp = 2, ``in=4``, ``out=6``: ColumnParallelLinear keeps rows 0-2 of ``W`` on
tp rank 0 and rows 3-5 on tp rank 1; RowParallelLinear keeps columns 0-1 on rank 0 and
columns 2-3 on rank 1. The usual MLP is ``Column(gather_output=False) -> activation ->
Row(input_is_parallel=True)``: one all-reduce forward, one backward.

"Sequence" is the FIRST dim of the activations and "hidden" the LAST (as in
:mod:`mindscience.distributed.mappings`): inputs are ``(S, ..., H)``.

Without :func:`~mindscience.distributed.manager.initialize_parallel` (or with tp = 1)
the layers use a size-1 group, make no communication at all and behave as
``mindspore.mint.nn.Linear`` (bit for bit with ``compute_dtype=ms.float32`` or ``None``
on float32 inputs; the default ``compute_dtype`` is bfloat16).

Modes: PyNative, ``mindspore.jit`` (``layer.construct = ms.jit(layer.construct)`` or a
jit-compiled function or train step calling the layer) and GRAPH_MODE, with the same
numbers. Argument errors (sizes, shapes) raise ``ValueError`` before this rank starts
any collective (at trace time in compiled code).

Uneven sequences: with ``use_sequence_parallel=True`` both layers take
``layer(x, split_sizes=[...])`` (the sequence rows of each tp rank, e.g.
``mappings.even_split_sizes(S, tp)``) and pass it to their sequence mappings. A rank
may hold zero rows (e.g. ``[3, 0, 2, 1]``); its RowParallelLinear bias gradient is then
zero.

Precision: the output has the input's dtype. Only the matmul (with the bias for
ColumnParallelLinear, as in a dense layer) runs in ``compute_dtype``; communication runs
in the input's dtype, so a float32 model all-reduces float32 partial sums even when the
matmul is bfloat16. MindSpore's CPU build has no bfloat16 MatMul kernel, so on CPU a
bfloat16 matmul is emulated with the numerics of a bfloat16 GEMM with float32
accumulation: operands rounded to bfloat16, multiplied in float32, result rounded to
bfloat16.
"""

from __future__ import annotations

import numbers
from typing import Optional, Union

import mindspore as ms
from mindspore import nn, ops

from .. import mappings
from ..collectives import resolve_group
from ..group import ParallelGroup
from ..sharding import mark_sharding
from .init import InitMethod, default_bias_init, default_weight_init, initialize_affine_weight

__all__ = ["ColumnParallelLinear", "RowParallelLinear"]

GroupLike = Union[ParallelGroup, str]


def _tp_group(group: Optional[GroupLike]) -> ParallelGroup:
    """The group a layer shards over, resolved once at construction.

    ``group`` if given (a ParallelGroup or a backend group name), else the manager's
    tensor-parallel group when parallel groups are initialized, else a size-1 group.
    """
    if group is not None:
        return resolve_group(group)
    from .. import manager

    if manager.is_initialized():
        return manager.get_tensor_parallel_group()
    return ParallelGroup.trivial("tp")


def _check_positive(cls: str, **values) -> None:
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
            raise ValueError(f"{cls}: {key}={value!r} must be a positive integer.")


class _ParallelLinear(nn.Cell):
    """Shared machinery: group, dtype handling, the local matmul and input checks."""

    def __init__(self, group, compute_dtype, skip_bias_add):
        super().__init__()
        self.group = _tp_group(group)
        self.tp_size = self.group.size
        self.tp_rank = self.group.rank
        self.compute_dtype = compute_dtype
        self.skip_bias_add = bool(skip_bias_add)
        self._cpu = ms.get_context("device_target") == "CPU"
        self._dense = ops.Dense()

    def _init_params(self, in_features, out_features, bias, split_dim, weight_init, bias_init,
                     param_init_dtype) -> None:
        """Check the sizes, then draw ``weight`` and ``bias`` (None without bias).

        ``split_dim`` is the weight dim sharded over tp: 0 splits the output features
        (Column; the bias is split with them), 1 the input features (Row; the bias is
        whole on every rank).
        """
        cls = type(self).__name__
        _check_positive(cls, in_features=in_features, out_features=out_features)
        key, size, kind = (("out_features", out_features, "output"),
                           ("in_features", in_features, "input"))[split_dim]
        if size % self.tp_size:
            raise ValueError(
                f"{cls}: {key}={size} is not divisible by the tensor-parallel size "
                f"{self.tp_size} (group {list(self.group.ranks)}): each rank holds "
                f"{key}/{self.tp_size} {kind} features. Choose {key} as a multiple of "
                f"{self.tp_size}, or another tp size."
            )
        self.in_features = in_features
        self.out_features = out_features
        self.has_bias = bool(bias)
        self._parallel = self.tp_size > 1
        # Weight first, then bias, each drawn in full: the same global-RNG draws as
        # mint.nn.Linear, so the shards re-assemble to its tensors.
        self.weight = initialize_affine_weight(
            (out_features, in_features), self.tp_size, split_dim,
            default_weight_init() if weight_init is None else weight_init,
            param_init_dtype, tp_rank=self.tp_rank, name="weight",
        )
        self.bias = None
        if self.has_bias:
            self.bias = initialize_affine_weight(
                (out_features,), self.tp_size if split_dim == 0 else 1, 0,
                default_bias_init(in_features) if bias_init is None else bias_init,
                param_init_dtype, tp_rank=self.tp_rank, name="bias",
            )
        # Checkpoints read these marks to know which slice of W (and b) this rank holds.
        mark_sharding(self.weight, axis="tp", partition_dim=split_dim)
        if self.bias is not None:
            mark_sharding(self.bias, axis="tp" if split_dim == 0 else None,
                          partition_dim=0 if split_dim == 0 else None)

    def _local_linear(self, x, bias):
        """``x @ self.weight.T (+ bias)`` in compute_dtype; the result has ``x``'s dtype."""
        out_dtype = x.dtype
        dtype = self.compute_dtype if self.compute_dtype is not None else out_dtype
        weight = self.weight
        if x.dtype != dtype:
            x = ops.cast(x, dtype)
        if weight.dtype != dtype:
            weight = ops.cast(weight, dtype)
        if bias is not None and bias.dtype != dtype:
            bias = ops.cast(bias, dtype)
        if self._cpu and dtype == ms.bfloat16:
            # No bfloat16 MatMul on CPU: multiply the bfloat16-rounded operands in float32
            # and round the result once, like a bfloat16 GEMM with float32 accumulation.
            x = ops.cast(x, ms.float32)
            weight = ops.cast(weight, ms.float32)
            if bias is not None:
                bias = ops.cast(bias, ms.float32)
            y = ops.cast(self._dense(x, weight, bias), dtype)
        else:
            y = self._dense(x, weight, bias)
        if y.dtype != out_dtype:
            y = ops.cast(y, out_dtype)
        return y

    def _check_last_dim(self, x, expected: int, what: str, fix: str) -> None:
        shape = tuple(x.shape)
        if not shape or shape[-1] != expected:
            raise ValueError(
                f"{type(self).__name__}: the input's last dim is "
                f"{shape[-1] if shape else '(scalar)'} (shape {shape}), expected {expected} "
                f"({what}). {fix}"
            )

    def _check_sequence(self, x, divisible: bool) -> None:
        """Sequence parallelism: inputs are (S, ..., H); with ``divisible`` tp must divide S
        (an even split; ``split_sizes`` are checked by the mappings)."""
        shape = tuple(x.shape)
        if len(shape) < 2:
            raise ValueError(
                f"{type(self).__name__}: use_sequence_parallel=True expected an input of "
                f"shape (S, ..., H) with the sequence first, got shape {shape}. Add the "
                "sequence dim, or set use_sequence_parallel=False."
            )
        if divisible and shape[0] % self.tp_size:
            raise ValueError(
                f"{type(self).__name__}: the sequence dim (dim 0) is {shape[0]} (shape "
                f"{shape}), not divisible by the tensor-parallel size {self.tp_size}; "
                "use_sequence_parallel=True reduce-scatters the output along dim 0, so each "
                f"rank needs S/{self.tp_size} rows. Pad the sequence to a multiple of "
                f"{self.tp_size}, shard it unevenly with layer(x, split_sizes="
                f"even_split_sizes({shape[0]}, {self.tp_size})), or set "
                "use_sequence_parallel=False."
            )


class ColumnParallelLinear(_ParallelLinear):
    """Linear layer whose output features (rows of the weight) are split over the tp group.

    Under the same ``mindspore.set_seed``, the weight and bias of all tp ranks put back
    together are exactly those of ``mindspore.mint.nn.Linear(in_features, out_features,
    bias)`` (default inits: ``HeUniform(sqrt(5))`` weight, ``Uniform(1/sqrt(in))`` bias),
    for any tp size.

    Example, tp = 2, ``ColumnParallelLinear(4, 6, gather_output=False)``: each rank holds
    a ``[3, 4]`` weight and a ``[3]`` bias; an input ``(S, 4)`` (the same on both ranks)
    gives ``(S, 3)`` per rank: output features 0-2 on tp rank 0, 3-5 on tp rank 1. With
    ``gather_output=True`` both ranks get the full ``(S, 6)``.

    Args:
        in_features: Input size.
        out_features: Output size of the whole layer; must be divisible by tp.
        bias: Whether to add a bias (sharded like the output).
        gather_output: All-gather the output's last dim so every rank gets the full
            output. False keeps ``(..., out_features/tp)`` per rank (feed it to a
            ``RowParallelLinear(input_is_parallel=True)``).
        use_sequence_parallel: The input is this rank's chunk of the sequence
            ``(S/tp, ..., in)``; it is all-gathered along dim 0 before the matmul (and the
            input gradient reduce-scattered). Otherwise the input ``(S, ..., in)`` is
            the same on every rank (and the input gradient all-reduced).
        weight_init: Initializer of the full ``[out, in]`` weight. Default as mint.nn.Linear.
        bias_init: Initializer of the full ``[out]`` bias. Default as mint.nn.Linear.
        param_init_dtype: Dtype of the parameters.
        compute_dtype: Dtype of the matmul; None computes in the input's dtype. The
            output always has the input's dtype (see the module docstring).
        skip_bias_add: Return ``(output, bias)`` without adding the bias, so that the
            caller can fuse the add into what follows (Megatron's convention). The
            returned bias matches the output's last dim: with ``gather_output`` it is the
            full bias (all-gathered, differentiable), else this rank's shard; None
            without bias.
        group: Override the group to shard over (a ParallelGroup or a backend name).
            Default: the manager's tp group, or a size-1 group if not initialized.

    Inputs:
        x: ``(S, ..., in_features)``, or ``(S/tp, ..., in_features)`` with sequence parallelism.
        split_sizes: Sequence parallelism only: the rows of each tp rank (an uneven
            sequence); x then holds ``split_sizes[tp_rank]`` rows. None: even shards.

    Outputs:
        ``(S, ..., out_features)`` if ``gather_output`` else ``(S, ..., out_features/tp)``;
        or ``(output, bias)`` with ``skip_bias_add``.

    Raises:
        ValueError: ``out_features`` not divisible by tp (construction); an input whose
            last dim is not ``in_features`` (call).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = True,
        use_sequence_parallel: bool = False,
        weight_init: Optional[InitMethod] = None,
        bias_init: Optional[InitMethod] = None,
        param_init_dtype=ms.float32,
        compute_dtype=ms.bfloat16,
        *,
        skip_bias_add: bool = False,
        group: Optional[GroupLike] = None,
    ):
        super().__init__(group, compute_dtype, skip_bias_add)
        self.gather_output = bool(gather_output)
        self.use_sequence_parallel = bool(use_sequence_parallel)
        self._init_params(in_features, out_features, bias, 0, weight_init, bias_init,
                          param_init_dtype)
        self.out_features_per_partition = out_features // self.tp_size

    def construct(self, x, split_sizes=None):
        self._check_last_dim(
            x, self.in_features, "in_features",
            "Pass inputs of shape (S, ..., in_features)"
            + (", sequence-sharded (S/tp, ..., in_features)." if self.use_sequence_parallel else "."),
        )
        if self.use_sequence_parallel:
            self._check_sequence(x, divisible=False)
        if self._parallel:
            if self.use_sequence_parallel:
                x = mappings.gather_from_sequence(x, self.group, split_sizes=split_sizes)
            else:
                x = mappings.copy_to_all(x, self.group)
        fused_bias = None if self.skip_bias_add else self.bias
        y = self._local_linear(x, fused_bias)
        if self._parallel and self.gather_output:
            y = mappings.gather_from_hidden(y, self.group)
        if not self.skip_bias_add:
            return y
        bias = self.bias
        if bias is not None and self._parallel and self.gather_output:
            bias = mappings.gather_from_hidden(bias, self.group)
        return y, bias

    def extend_repr(self):
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(per rank {self.out_features_per_partition}), bias={self.has_bias}, "
            f"gather_output={self.gather_output}, "
            f"use_sequence_parallel={self.use_sequence_parallel}, tp={self.tp_size}, "
            f"compute_dtype={self.compute_dtype}"
        )


class RowParallelLinear(_ParallelLinear):
    """Linear layer whose input features (columns of the weight) are split over the tp group.

    Each rank multiplies its ``in_features/tp`` slice of the input by its weight columns;
    the partial results are summed over the group (all-reduce), or summed and split along
    the sequence (reduce-scatter) with sequence parallelism. The bias is whole on every
    rank and is added after that reduction.

    Under the same ``mindspore.set_seed``, the re-assembled weight and the bias equal
    ``mindspore.mint.nn.Linear(in_features, out_features, bias)``'s, for any tp size.

    Example, tp = 2, ``RowParallelLinear(4, 6)``: each rank holds a ``[6, 2]`` weight
    (input features 0-1 on tp rank 0, 2-3 on tp rank 1) and the whole ``[6]`` bias; an
    input ``(S, 4)`` gives ``(S, 6)`` on both ranks. With ``use_sequence_parallel`` rank
    r gets rows ``r*S/2:(r+1)*S/2`` of it.

    Bias gradient under sequence parallelism: the bias is added to this rank's sequence
    chunk only, so each rank's bias gradient is its chunk's share, and the dense
    layer's bias gradient is the SUM over the tp group. All-reduce it over the tp group
    before the optimizer step (as Megatron does for its sequence-parallel parameters);
    such a bias carries ``bias.sequence_parallel = True``. The weight gradient needs no
    such step.

    Args:
        in_features: Input size of the whole layer; must be divisible by tp.
        out_features: Output size.
        bias: Whether to add a bias (not sharded).
        input_is_parallel: The input is already this rank's slice of the last dim,
            ``(S, ..., in_features/tp)`` (e.g. a ``ColumnParallelLinear(gather_output=False)``
            output). Otherwise the full input ``(S, ..., in_features)``, the same on every
            rank, is split here.
        use_sequence_parallel: Reduce-scatter the output along dim 0, giving
            ``(S/tp, ..., out_features)``; S must be divisible by tp. Otherwise all-reduce.
        weight_init: Initializer of the full ``[out, in]`` weight. Default as mint.nn.Linear.
        bias_init: Initializer of the ``[out]`` bias. Default as mint.nn.Linear.
        param_init_dtype: Dtype of the parameters.
        compute_dtype: Dtype of the matmul; None computes in the input's dtype. The
            output, the reduction and the bias add use the input's dtype.
        skip_bias_add: Return ``(output, bias)`` without adding the (whole) bias.
        group: Override the group to shard over (a ParallelGroup or a backend name).

    Inputs:
        x: ``(S, ..., in_features)``, or ``(S, ..., in_features/tp)`` if ``input_is_parallel``.
        split_sizes: Sequence parallelism only: the output rows of each tp rank (summing
            to S) for an uneven sequence. None: S must be divisible by tp.

    Outputs:
        ``(S, ..., out_features)``, or ``(S/tp, ..., out_features)`` with sequence
        parallelism; or ``(output, bias)`` with ``skip_bias_add``.

    Raises:
        ValueError: ``in_features`` not divisible by tp (construction); an input whose
            last dim is not the expected size, or (sequence parallel) whose dim 0 is not
            divisible by tp (call).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = False,
        use_sequence_parallel: bool = False,
        weight_init: Optional[InitMethod] = None,
        bias_init: Optional[InitMethod] = None,
        param_init_dtype=ms.float32,
        compute_dtype=ms.bfloat16,
        *,
        skip_bias_add: bool = False,
        group: Optional[GroupLike] = None,
    ):
        super().__init__(group, compute_dtype, skip_bias_add)
        self.input_is_parallel = bool(input_is_parallel)
        self.use_sequence_parallel = bool(use_sequence_parallel)
        self._init_params(in_features, out_features, bias, 1, weight_init, bias_init,
                          param_init_dtype)
        self.in_features_per_partition = in_features // self.tp_size
        if self.bias is not None and self.use_sequence_parallel:
            self.bias.sequence_parallel = True

    def construct(self, x, split_sizes=None):
        if self.input_is_parallel:
            self._check_last_dim(
                x, self.in_features_per_partition,
                f"in_features/tp = {self.in_features}/{self.tp_size}, input_is_parallel=True",
                "Pass this rank's slice of the last dim, or set input_is_parallel=False "
                "to pass the full input.",
            )
        else:
            self._check_last_dim(
                x, self.in_features, "in_features",
                "Pass the full input, or set input_is_parallel=True to pass this rank's "
                f"slice of size {self.in_features_per_partition}.",
            )
        if self.use_sequence_parallel:
            self._check_sequence(x, divisible=split_sizes is None)
        if not self._parallel and not self.skip_bias_add and (
                self.compute_dtype is None or self.compute_dtype == x.dtype):
            # tp = 1, nothing to reduce: fuse the bias into the matmul as a dense layer
            # does. Same numerics as the add below, because both run in x's dtype.
            return self._local_linear(x, self.bias)
        if self._parallel and not self.input_is_parallel:
            x = mappings.scatter_to_hidden(x, self.group)
        y = self._local_linear(x, None)
        if self._parallel:
            if self.use_sequence_parallel:
                y = mappings.reduce_scatter_to_sequence(y, self.group, split_sizes=split_sizes)
            else:
                y = mappings.reduce_from_all(y, self.group)
        if self.skip_bias_add:
            return y, self.bias
        if self.bias is not None and y.shape[0] > 0:
            # (A rank holding no rows of an uneven sequence, split_sizes[r] == 0, skips the
            # add: its output is empty either way, and MindSpore 2.10's gradient of a
            # broadcast add onto an empty tensor, a CPU ReduceSum over zero rows, returns
            # uninitialized memory instead of zeros (measured). Without the add the bias
            # gradient is this rank's share: zero.)
            bias = self.bias if self.bias.dtype == y.dtype else ops.cast(self.bias, y.dtype)
            y = y + bias
        return y

    def extend_repr(self):
        return (
            f"in_features={self.in_features} (per rank {self.in_features_per_partition}), "
            f"out_features={self.out_features}, bias={self.has_bias}, "
            f"input_is_parallel={self.input_is_parallel}, "
            f"use_sequence_parallel={self.use_sequence_parallel}, tp={self.tp_size}, "
            f"compute_dtype={self.compute_dtype}"
        )
