"""The communication group object handed to mappings and layers.

Pure Python (no MindSpore import): the manager fills it from the topology, and a
size-1 group needs no backend communicator at all, so mappings and layers treat it as
a no-op and work unchanged without parallelism.

Upstream mindscience names its group classes ``CommGroupBase`` (size 1, no
communicator) and ``CommGroup``; both exist here with upstream's attributes
(``name``, ``size``, ``rank``, ``group_name``), and :class:`ParallelGroup` is a
``CommGroup``, so upstream code that checks ``isinstance`` keeps working.
"""

from __future__ import annotations

from dataclasses import dataclass


class GroupNotCreatedError(RuntimeError):
    """A backend name was asked of a group that has no backend communicator."""


class CommGroupBase:
    """Upstream's size-1 group: this process alone, no backend communicator.

    Every mapping is the identity on it. ``group_name`` raises, as upstream's does.

    Args:
        parallelisms: The axis key, e.g. ``"tp"`` or ``"dp-cp"``.
    """

    def __init__(self, parallelisms: str):
        self.name = parallelisms
        self._group_name = None
        self._group_size = 1
        self._group_rank = 0

    @property
    def size(self) -> int:
        return self._group_size

    @property
    def rank(self) -> int:
        return self._group_rank

    @property
    def group_name(self) -> str:
        raise GroupNotCreatedError(
            f"the {self.name!r} group has size 1, so no backend communicator exists: "
            "check group.size > 1 before asking for group_name."
        )

    def __str__(self) -> str:
        return (
            f"{self.name}: {self._group_name}, group_rank: {self._group_rank}, "
            f"group_size: {self._group_size}"
        )


class CommGroup(CommGroupBase):
    """Upstream's group over a backend communicator.

    Args:
        parallelisms: The axis key.
        group_name: Backend communicator name (from ``create_group``).
        group_size: Number of member ranks.
        group_rank: This process's rank in the group; asked of the backend when None
            (which needs ``mindspore.communication.init()``).
    """

    def __init__(self, parallelisms: str, group_name: str, group_size: int,
                 group_rank: int | None = None):
        super().__init__(parallelisms)
        self._group_name = group_name
        self._group_size = int(group_size)
        if group_rank is None:
            from mindspore.communication import get_group_rank_from_world_rank, get_rank

            group_rank = get_group_rank_from_world_rank(get_rank(), group_name)
        self._group_rank = int(group_rank)

    @property
    def group_name(self) -> str:
        return self._group_name


@dataclass(frozen=True)
class ParallelGroup(CommGroup):
    """One communication group as seen from this process.

    Attributes:
        key: Axis key such as ``"tp"`` or ``"dp-cp"``.
        ranks: Member global ranks ordered by group rank.
        rank: This process's rank inside the group.
        backend_name: Name of the backend communicator, or None for a size-1 group.

    Example: on global rank 5 of 8 ranks with tp=2, the tp group is
    ``ParallelGroup(key="tp", ranks=(4, 5), rank=1, backend_name="msd1-tp-2")``.
    """

    key: str
    ranks: tuple
    rank: int = 0
    backend_name: str | None = None

    @classmethod
    def trivial(cls, key: str, global_rank: int = 0) -> "ParallelGroup":
        """A size-1 group holding only this process: every mapping on it is the identity."""
        return cls(key=key, ranks=(global_rank,), rank=0, backend_name=None)

    @property
    def name(self) -> str:
        """The axis key (upstream ``CommGroup.name`` holds the key too)."""
        return self.key

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def global_rank(self) -> int:
        return self.ranks[self.rank]

    @property
    def group_name(self) -> str:
        """Backend communicator name, to pass to MindSpore collectives.

        Raises:
            GroupNotCreatedError: the group has size 1, so no communicator exists.
        """
        if self.backend_name is None:
            raise GroupNotCreatedError(
                f"the {self.key!r} group has size {self.size}, so no backend communicator "
                "was created for it. Check group.size > 1 before asking for group_name "
                "(mappings and layers accept the size-1 group as is)."
            )
        return self.backend_name

    def __str__(self) -> str:
        return (
            f"{self.key}: {self.backend_name}, group_rank: {self.rank}, "
            f"group_size: {self.size}, ranks: {list(self.ranks)}"
        )
