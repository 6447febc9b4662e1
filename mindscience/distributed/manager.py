"""Runtime communication groups for tensor, context, data, pipeline and expert parallelism.

The groups come from the same :class:`~mindscience.distributed.topology.Layout` that
``msdist plan`` prints, so the member ranks created here are exactly the planned ones.

Typical use, in every rank of an ``msrun`` job::

    from mindspore.communication import init
    from mindscience.distributed import manager

    init()
    manager.initialize_parallel(tensor_parallel_size=2, context_parallel_size=2)
    tp = manager.get_tensor_parallel_group()   # ParallelGroup(key="tp", ranks=(0, 1), ...)

Example, 8 ranks, tp=2, pp=2, order tp-cp-dp-pp, seen from global rank 5:
tp group (4, 5) rank 1; dp group (5, 7) rank 0; pp group (1, 5) rank 1, so rank 5 is
the last pipeline stage, its previous stage is rank 1 and its next (ring) is rank 1.

Expert layers (Mixture-of-Experts) fold over the same ranks with their own groups:
``initialize_parallel(..., expert_model_parallel_size=4)`` adds the ep, etp (expert
tensor), edp (expert data) and etp-ep (token dispatch) groups, read with
``get_expert_model_parallel_group()`` and the other ``get_expert_*`` getters.

Backend communicators are created only for groups of size > 1, once per distinct set
of member ranks (``dp-cp`` reuses ``dp``'s communicator when cp == 1, ``edp`` reuses
``dp-cp``'s when the experts are not split). Their names are
``msd<generation>-<axes>-<group index>`` (at most ~30 characters at any world size),
where the generation counts initializations in this process, so that
``destroy_parallel()`` followed by ``initialize_parallel(...)`` with other sizes never
reuses a name that MindSpore already bound to other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .group import CommGroup, CommGroupBase, ParallelGroup
from .topology import DEFAULT_ORDER, Layout, LayoutError, parse_axis_key

__all__ = [
    "CommGroup", "CommGroupBase", "CommGroupCreator", "ParallelGroup", "ParallelInitError",
    "ParallelNotInitializedError", "initialize_parallel", "destroy_parallel",
    "is_initialized", "get_layout", "get_group", "get_embedding_group",
    "get_expert_model_parallel_group", "get_expert_model_parallel_group_name",
    "get_expert_model_parallel_rank", "get_expert_model_parallel_world_size",
    "get_expert_tensor_parallel_group", "get_expert_tensor_parallel_group_name",
    "get_expert_tensor_parallel_rank", "get_expert_tensor_parallel_world_size",
    "get_expert_data_parallel_group", "get_expert_data_parallel_group_name",
    "get_expert_data_parallel_rank", "get_expert_data_parallel_world_size",
    "get_expert_tensor_and_model_parallel_group",
]

# The dense groups, then the expert ones (topology.plan.RUNTIME_KEYS, what msdist plan counts).
STANDARD_KEYS = ("tp", "cp", "dp", "pp", "dp-cp", "ep", "etp", "edp", "etp-ep")


class ParallelInitError(RuntimeError, ValueError):
    """``initialize_parallel`` was called with values that cannot form a layout.

    It is a RuntimeError (as the upstream API raises) and a ValueError (as the
    topology raises for the same values).
    """


class ParallelNotInitializedError(RuntimeError):
    """A getter was called before ``initialize_parallel``."""


@dataclass
class _ParallelState:
    layout: Layout
    rank: int
    generation: int
    groups: dict = field(default_factory=dict)  # key as given -> ParallelGroup
    backend_names: dict = field(default_factory=dict)  # Layout.signature -> backend name


_STATE: _ParallelState | None = None
_GENERATION = 0


def _communication_initialized() -> bool:
    # Checked before anything touches a collective: a collective before
    # mindspore.communication.init() segfaults the process on CPU.
    from mindspore.communication import _comm_helper

    try:
        return bool(_comm_helper._is_initialized())
    except Exception:  # noqa: BLE001 - any failure means "not usable"
        return False


def _world() -> tuple[int, int]:
    from mindspore.communication import get_group_size, get_rank

    return get_rank(), get_group_size()


def _create_backend_group(name: str, ranks: list[int]) -> None:
    from mindspore.communication import create_group

    create_group(name, ranks)


def initialize_parallel(
    tensor_parallel_size: int = 1,
    context_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    order: str = DEFAULT_ORDER,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
) -> Layout:
    """Create the tp, cp, dp, pp and dp-cp groups of this process, and the expert groups.

    Call it in every rank after ``mindspore.communication.init()``. The data-parallel
    size is ``world_size // (tp * cp * pp)``; the expert data-parallel size is
    ``world_size // (etp * ep * pp)``.

    Args:
        tensor_parallel_size: tp size.
        context_parallel_size: cp (sequence) size.
        pipeline_parallel_size: pp size; pipeline groups are really created.
        order: The four axes joined by ``-``, first varying fastest; may name ``ep``
            (``tp-cp-ep-dp-pp``), else ep sits just before dp.
        expert_model_parallel_size: ep, the ranks the experts of a MoE layer are split
            over (tokens are exchanged over the ``etp-ep`` group).
        expert_tensor_parallel_size: etp, the split of each expert's ffn dimension;
            None means tp.

    Returns:
        The :class:`Layout` in force (the same object ``msdist plan`` works on).

    Raises:
        RuntimeError: communication not initialized, already initialized, or (as
            :class:`ParallelInitError`) sizes or order that do not fit the world.
    """
    global _STATE, _GENERATION
    if _STATE is not None:
        raise RuntimeError(
            "initialize_parallel() was already called in this process "
            f"(layout {_describe(_STATE.layout)}). Call destroy_parallel() first to "
            "build groups for another layout."
        )
    if not _communication_initialized():
        raise RuntimeError(
            "MindSpore communication is not initialized: call "
            "mindspore.communication.init() (in a job started with msrun) before "
            "initialize_parallel()."
        )
    rank, world = _world()
    try:
        layout = Layout(
            world_size=world,
            tp=tensor_parallel_size,
            cp=context_parallel_size,
            pp=pipeline_parallel_size,
            order=order,
            ep=expert_model_parallel_size,
            etp=expert_tensor_parallel_size,
        )
    except LayoutError as err:
        raise ParallelInitError(f"initialize_parallel: {err}") from None
    _GENERATION += 1
    state = _ParallelState(layout=layout, rank=rank, generation=_GENERATION)
    _STATE = state
    try:
        for key in STANDARD_KEYS:
            _build_group(state, key)
        _build_embedding_group(state)
    except BaseException:
        _STATE = None
        raise
    return layout


def _build_group(state: _ParallelState, key: str) -> ParallelGroup:
    layout = state.layout
    members = layout.group_of(state.rank, key)
    backend_name = None
    if len(members) > 1:
        # Keys with the same signature have the same members on every rank, so every rank
        # reuses (or creates) the same communicators in the same sequence.
        signature = layout.signature(key)
        backend_name = state.backend_names.get(signature)
        if backend_name is None:
            eff_key = "-".join(layout.effective_axes(key))
            backend_name = f"msd{state.generation}-{eff_key}-{layout.group_index(state.rank, eff_key)}"
            _create_backend_group(backend_name, members)
            state.backend_names[signature] = backend_name
    group = ParallelGroup(
        key=key,
        ranks=tuple(members),
        rank=layout.group_rank(state.rank, key),
        backend_name=backend_name,
    )
    state.groups[key] = group
    return group


def _build_embedding_group(state: _ParallelState) -> ParallelGroup:
    """Megatron's embedding group: the first and the last stage of this rank's pipeline.

    Tied parameters (an input embedding shared with the output layer) live on both and
    their gradients are summed over it (:class:`~mindscience.distributed.finalize.
    GradientFinalizer`). Ranks on the middle stages, and every rank when pp == 1, get a
    size-1 group. Only the two members create the communicator (pp == 2: the pipeline
    group's own).
    """
    pp = state.groups["pp"]
    ends = (pp.ranks[0], pp.ranks[-1])
    if pp.size == 1 or state.rank not in ends:
        group = ParallelGroup.trivial("embedding", state.rank)
    elif pp.size == 2:
        group = ParallelGroup(key="embedding", ranks=ends, rank=ends.index(state.rank),
                              backend_name=pp.backend_name)
    else:
        name = f"msd{state.generation}-emb-{state.layout.group_index(state.rank, 'pp')}"
        _create_backend_group(name, list(ends))
        group = ParallelGroup(key="embedding", ranks=ends, rank=ends.index(state.rank),
                              backend_name=name)
    state.groups["embedding"] = group
    return group


def get_embedding_group() -> ParallelGroup:
    """The embedding group (first + last pipeline stage) of this rank; size 1 elsewhere."""
    return _state().groups["embedding"]


def _describe(layout: Layout) -> str:
    experts = f" ep={layout.ep} etp={layout.etp} edp={layout.edp}" if layout.has_experts_split else ""
    return (
        f"tp={layout.tp} cp={layout.cp} dp={layout.dp} pp={layout.pp}{experts} "
        f"order={layout.order} world={layout.world_size}"
    )


def _state() -> _ParallelState:
    if _STATE is None:
        raise ParallelNotInitializedError(
            "parallel groups are not initialized: call "
            "mindscience.distributed.manager.initialize_parallel(...) first (after "
            "mindspore.communication.init())."
        )
    return _STATE


def is_initialized() -> bool:
    """True between ``initialize_parallel`` and ``destroy_parallel``."""
    return _STATE is not None


def destroy_parallel() -> None:
    """Forget the current groups so that ``initialize_parallel`` may run again.

    The backend communicators stay alive (MindSpore on CPU cannot destroy groups
    safely); the next initialization uses new names, so nothing collides.
    Calling it when not initialized does nothing.
    """
    global _STATE
    _STATE = None


def get_layout() -> Layout:
    """The layout passed to ``initialize_parallel``."""
    return _state().layout


def get_group(key: str) -> ParallelGroup:
    """This process's group for any axis combination, e.g. ``"tp-cp"``, ``"tp-dp-cp"`` or ``"etp-ep"``.

    Groups beyond :data:`STANDARD_KEYS` are created on first use: like any group
    creation this is collective, so every rank must ask for the same keys in the
    same order.

    Raises:
        RuntimeError: not initialized.
        ValueError: unknown or repeated axis in ``key``, or dense axes (tp, cp, dp) mixed
            with expert axes (etp, ep, edp).
    """
    state = _state()
    group = state.groups.get(key)
    if group is None:
        parse_axis_key(key)
        group = _build_group(state, key)
    return group


def created_group_names() -> list[str]:
    """Backend communicators created by the current initialization (size > 1 only)."""
    return list(_state().backend_names.values())


def get_created_group_count() -> int:
    """How many backend communicators the current initialization created."""
    return len(_state().backend_names)


# ------------------------------------------------------------- upstream getters
def get_tensor_parallel_group() -> ParallelGroup:
    return get_group("tp")


def get_context_parallel_group() -> ParallelGroup:
    return get_group("cp")


def get_data_parallel_group() -> ParallelGroup:
    return get_group("dp")


def get_data_context_parallel_group() -> ParallelGroup:
    return get_group("dp-cp")


def get_pipeline_parallel_group() -> ParallelGroup:
    return get_group("pp")


def get_tensor_parallel_group_name() -> str:
    """Backend name of the tp group; RuntimeError when tp == 1 (no communicator)."""
    return get_group("tp").group_name


def get_context_parallel_group_name() -> str:
    return get_group("cp").group_name


def get_data_parallel_group_name() -> str:
    return get_group("dp").group_name


def get_data_context_parallel_group_name() -> str:
    return get_group("dp-cp").group_name


def get_pipeline_parallel_group_name() -> str:
    return get_group("pp").group_name


def get_tensor_parallel_rank() -> int:
    return get_group("tp").rank


def get_context_parallel_rank() -> int:
    return get_group("cp").rank


def get_data_parallel_rank() -> int:
    return get_group("dp").rank


def get_data_context_parallel_rank() -> int:
    return get_group("dp-cp").rank


def get_pipeline_parallel_rank() -> int:
    return get_group("pp").rank


def get_tensor_parallel_world_size() -> int:
    return get_group("tp").size


def get_context_parallel_world_size() -> int:
    return get_group("cp").size


def get_data_parallel_world_size() -> int:
    return get_group("dp").size


def get_data_context_parallel_world_size() -> int:
    return get_group("dp-cp").size


def get_pipeline_parallel_world_size() -> int:
    return get_group("pp").size


# ------------------------------------------------------------- expert getters (Megatron's names)
def get_expert_model_parallel_group() -> ParallelGroup:
    """The ep group: the ranks that split one MoE layer's experts between them."""
    return get_group("ep")


def get_expert_model_parallel_group_name() -> str:
    return get_group("ep").group_name


def get_expert_model_parallel_rank() -> int:
    return get_group("ep").rank


def get_expert_model_parallel_world_size() -> int:
    return get_group("ep").size


def get_expert_tensor_parallel_group() -> ParallelGroup:
    """The etp group: the ranks that split each expert's ffn dimension."""
    return get_group("etp")


def get_expert_tensor_parallel_group_name() -> str:
    return get_group("etp").group_name


def get_expert_tensor_parallel_rank() -> int:
    return get_group("etp").rank


def get_expert_tensor_parallel_world_size() -> int:
    return get_group("etp").size


def get_expert_data_parallel_group() -> ParallelGroup:
    """The edp group: the ranks holding the same expert shards (expert gradients reduce here)."""
    return get_group("edp")


def get_expert_data_parallel_group_name() -> str:
    return get_group("edp").group_name


def get_expert_data_parallel_rank() -> int:
    return get_group("edp").rank


def get_expert_data_parallel_world_size() -> int:
    return get_group("edp").size


def get_expert_tensor_and_model_parallel_group() -> ParallelGroup:
    """The etp-ep group, over which a MoE layer dispatches its tokens."""
    return get_group("etp-ep")


def is_pipeline_first_stage() -> bool:
    return get_group("pp").rank == 0


def is_pipeline_last_stage() -> bool:
    group = get_group("pp")
    return group.rank == group.size - 1


def get_pipeline_parallel_next_rank() -> int:
    """Global rank of the next pipeline stage (the last stage wraps to the first)."""
    group = get_group("pp")
    return group.ranks[(group.rank + 1) % group.size]


def get_pipeline_parallel_prev_rank() -> int:
    """Global rank of the previous pipeline stage (the first stage wraps to the last)."""
    group = get_group("pp")
    return group.ranks[(group.rank - 1) % group.size]


# ------------------------------------------------------------- upstream creator
class CommGroupCreator:
    """Upstream's group creator, over the same topology as :func:`initialize_parallel`.

    Unlike upstream's, constructing it and :meth:`get_group_rank_ids` are pure
    arithmetic: no device and no ``init()`` needed, so they plan groups anywhere.

    Args:
        tp: Tensor-parallel size (the world is the product of the four sizes).
        cp: Context-parallel size.
        dp: Data-parallel size.
        pp: Pipeline-parallel size.
        order: The axes joined by ``-``, the first varying fastest.

    Example::

        >>> CommGroupCreator(tp=2, cp=1, dp=2, pp=2, order="tp-cp-dp-pp").get_group_rank_ids("dp")
        [[0, 2], [1, 3], [4, 6], [5, 7]]

    Raises:
        ParallelInitError: sizes or order that do not form a layout.
    """

    def __init__(self, tp: int, cp: int, dp: int, pp: int, order: str = DEFAULT_ORDER):
        try:
            for name, value in (("dp", dp),):
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise LayoutError(f"{name}={value!r} is invalid: expected a positive integer.")
            self.layout = Layout(world_size=tp * cp * dp * pp, tp=tp, cp=cp, pp=pp, order=order)
        except (LayoutError, TypeError) as err:
            raise ParallelInitError(f"CommGroupCreator: {err}") from None
        self.tp, self.cp, self.dp, self.pp = tp, cp, dp, pp
        self.order = "-".join(self.layout.axes)
        self.world_size = self.layout.world_size
        self.ordered_size = [self.layout.sizes[axis] for axis in self.layout.axes]

    @property
    def rank(self) -> int:
        """This process's global rank (asked of MindSpore on first use)."""
        return _world()[0]

    def get_group_rank_ids(self, parallelisms: str) -> list:
        """Every group of the axes in ``parallelisms`` (e.g. ``"dp-cp"``), as rank lists."""
        parse_axis_key(parallelisms)
        return self.layout.groups(parallelisms)

    def init_group(self, parallelisms: str):
        """Create this process's group of ``parallelisms`` on the backend.

        Call it on every rank (group creation is collective). Returns a
        :class:`ParallelGroup` (a ``CommGroup``); for a size-1 group no communicator is
        made and the group is the size-1 identity group.

        Raises:
            RuntimeError: communication not initialized.
        """
        if not _communication_initialized():
            raise RuntimeError(
                "MindSpore communication is not initialized: call "
                "mindspore.communication.init() before CommGroupCreator.init_group()."
            )
        rank = self.rank
        members = self.layout.group_of(rank, parallelisms)
        group_rank = self.layout.group_rank(rank, parallelisms)
        if len(members) == 1:
            return ParallelGroup.trivial(parallelisms, rank)
        name = f"{parallelisms}-" + "-".join(str(r) for r in members)
        if len(name) > 64:
            # Upstream spells out every member; long groups get a short, unique name.
            name = f"{parallelisms}-{members[0]}-n{len(members)}-g{self.layout.group_index(rank, parallelisms)}"
        _create_backend_group(name, members)
        return ParallelGroup(key=parallelisms, ranks=tuple(members), rank=group_rank,
                             backend_name=name)
