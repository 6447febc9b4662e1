"""A parallel layout: the sizes of the tp, cp, dp and pp axes and how ranks map onto them.

Pure rank arithmetic with no MindSpore import, shared by ``msdist plan`` and the runtime
manager, so that what the planner prints is exactly what ``initialize_parallel`` creates.

Conventions (Megatron's):

* ``order`` lists the four axes, the FIRST varying fastest: with ``"tp-cp-dp-pp"`` the
  ranks of one tensor-parallel group are adjacent. A rank is
  ``sum(coord[a] * stride[a])`` where ``stride`` of an axis is the product of the sizes of
  the axes before it in ``order``.
* A group key is one axis or several joined by ``-`` (``"tp"``, ``"dp-cp"``). A group holds
  the ranks that differ only in the key's axes. Inside a group, ranks are ordered by group
  rank, which enumerates the key's axes in ``order``'s order (earlier axis fastest), so
  ``"dp-cp"`` and ``"cp-dp"`` name the same groups. Groups are listed by group index, which
  enumerates the remaining axes the same way.

Example: 8 ranks, tp=2, cp=1, pp=2 (so dp=2), order ``tp-cp-dp-pp``::

    rank  tp dp pp     tp groups  [0,1] [2,3] [4,5] [6,7]
    0     0  0  0      dp groups  [0,2] [1,3] [4,6] [5,7]
    1     1  0  0      pp groups  [0,4] [1,5] [2,6] [3,7]
    2     0  1  0
    5     1  0  1
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import gcd, prod

from .errors import LayoutError

AXES = ("tp", "cp", "dp", "pp")
AXIS_NAMES = {"tp": "tensor", "cp": "context", "dp": "data", "pp": "pipeline"}
DEFAULT_ORDER = "tp-cp-dp-pp"
BACKENDS = ("cpu", "ascend", "gpu")


def _check_positive_int(name: str, value, fix: str) -> None:
    # bool is an int subclass; `tp: true` in YAML must not pass as 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(
            f"{name}={value!r} is invalid: expected a positive integer, got {type(value).__name__}. {fix}"
        )
    if value < 1:
        raise LayoutError(f"{name}={value} is invalid: expected a positive integer (>= 1). {fix}")


def parse_order(order: str) -> tuple[str, ...]:
    """Split and validate an order string such as ``"tp-cp-dp-pp"``.

    Raises:
        LayoutError: the order is not a string, names an unknown axis, repeats one or
            leaves one out.
    """
    if not isinstance(order, str):
        raise LayoutError(
            f"order={order!r} is invalid: expected a string such as {DEFAULT_ORDER!r}."
        )
    parts = tuple(p.strip() for p in order.split("-"))
    unknown = [p for p in parts if p not in AXES]
    if unknown:
        raise LayoutError(
            f"order={order!r} names unknown axis {unknown[0]!r}: expected each of "
            f"{', '.join(AXES)} exactly once, joined by '-', e.g. {DEFAULT_ORDER!r}."
        )
    dupes = sorted({p for p in parts if parts.count(p) > 1})
    if dupes:
        raise LayoutError(
            f"order={order!r} repeats axis {dupes[0]!r}: expected each of "
            f"{', '.join(AXES)} exactly once, e.g. {DEFAULT_ORDER!r}."
        )
    missing = [a for a in AXES if a not in parts]
    if missing:
        raise LayoutError(
            f"order={order!r} is missing axis {missing[0]!r}: expected each of "
            f"{', '.join(AXES)} exactly once, e.g. {DEFAULT_ORDER!r}."
        )
    return parts


def parse_axis_key(key: str) -> tuple[str, ...]:
    """Split and validate a group key such as ``"tp"`` or ``"dp-cp"``.

    Returns:
        The axes in the key's own spelling order.

    Raises:
        LayoutError: empty key, unknown or repeated axis.
    """
    if not isinstance(key, str) or not key.strip():
        raise LayoutError(
            f"group key {key!r} is invalid: expected one or more of {', '.join(AXES)} "
            "joined by '-', e.g. 'tp' or 'dp-cp'."
        )
    parts = tuple(p.strip() for p in key.split("-"))
    for p in parts:
        if p not in AXES:
            raise LayoutError(
                f"group key {key!r} names unknown axis {p!r}: expected one or more of "
                f"{', '.join(AXES)} joined by '-', e.g. 'tp' or 'dp-cp'."
            )
    if len(set(parts)) != len(parts):
        raise LayoutError(
            f"group key {key!r} repeats an axis: name each axis at most once, e.g. 'dp-cp'."
        )
    return parts


@dataclass(frozen=True)
class Layout:
    """Sizes of the four parallel axes over a world of ranks, validated at construction.

    Args:
        world_size: Number of ranks. May be omitted when ``dp`` is given (then it is
            ``tp*cp*dp*pp``).
        tp: Tensor-parallel size.
        cp: Context (sequence) parallel size.
        pp: Pipeline-parallel size.
        dp: Data-parallel size; derived as ``world_size // (tp*cp*pp)`` when omitted,
            and must agree with it when given.
        order: The four axes joined by ``-``, first varying fastest.
        devices_per_node: Ranks per node; defaults to ``world_size`` (one node).
        name: Optional label.
        backend: ``cpu``, ``ascend`` or ``gpu`` (used by ``msdist verify``).

    Raises:
        LayoutError: any inconsistent or out-of-range value, with a message saying how
            to fix it.
    """

    world_size: int | None = None
    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int | None = None
    order: str = DEFAULT_ORDER
    devices_per_node: int | None = None
    name: str | None = None
    backend: str = "cpu"
    axes: tuple = field(init=False, repr=False, compare=False)
    _strides: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        for axis in ("tp", "cp", "pp"):
            _check_positive_int(axis, getattr(self, axis), f"Set {axis} to 1 to leave the axis unused.")
        if self.dp is not None:
            _check_positive_int("dp", self.dp, "Remove dp to derive it from world_size.")
        model = self.tp * self.cp * self.pp
        if self.world_size is None:
            if self.dp is None:
                raise LayoutError(
                    "world_size is missing: expected the number of ranks (or dp, to derive "
                    "world_size = tp*cp*dp*pp). Add world_size."
                )
            object.__setattr__(self, "world_size", model * self.dp)
        _check_positive_int("world_size", self.world_size, "Set it to the number of ranks.")
        world = self.world_size
        if world % model:
            raise LayoutError(
                f"tp*cp*pp = {self.tp}*{self.cp}*{self.pp} = {model} does not divide "
                f"world_size={world}: expected a divisor of {world}. Change tp, cp or pp, "
                "or world_size."
            )
        if self.dp is None:
            object.__setattr__(self, "dp", world // model)
        elif model * self.dp != world:
            raise LayoutError(
                f"dp={self.dp} disagrees with world_size={world}: tp*cp*dp*pp = "
                f"{model * self.dp}, expected {world}. Set dp={world // model} or remove dp "
                "to derive it."
            )
        if self.devices_per_node is None:
            object.__setattr__(self, "devices_per_node", world)
        _check_positive_int(
            "devices_per_node", self.devices_per_node, "Set it to the ranks on one node."
        )
        if world % self.devices_per_node:
            raise LayoutError(
                f"devices_per_node={self.devices_per_node} does not divide "
                f"world_size={world}: every node must hold the same number of ranks. "
                "Use a divisor of world_size."
            )
        if self.backend not in BACKENDS:
            raise LayoutError(
                f"backend={self.backend!r} is invalid: expected one of {', '.join(BACKENDS)}."
            )
        if self.name is not None and not isinstance(self.name, str):
            raise LayoutError(f"name={self.name!r} is invalid: expected a string.")
        axes = parse_order(self.order)
        strides, stride = {}, 1
        for axis in axes:
            strides[axis] = stride
            stride *= getattr(self, axis)
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "_strides", strides)

    # ----------------------------------------------------------------- sizes
    @property
    def sizes(self) -> dict[str, int]:
        """Axis sizes keyed by axis, in the fixed order tp, cp, dp, pp."""
        return {a: getattr(self, a) for a in AXES}

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.devices_per_node

    def size(self, key: str) -> int:
        """Size of a group of ``key`` (product of its axes' sizes)."""
        return prod(getattr(self, a) for a in parse_axis_key(key))

    def num_groups(self, key: str) -> int:
        return self.world_size // self.size(key)

    def stride(self, axis: str) -> int:
        """Distance in global ranks between neighbours along ``axis``."""
        return self._strides[parse_axis_key(axis)[0]]

    def effective_axes(self, key: str) -> tuple[str, ...]:
        """The key's axes whose size is > 1, in ``order``'s order.

        Two keys with the same effective axes have the same groups (``dp-cp`` equals
        ``dp`` when cp == 1), so they can share one communicator.
        """
        keyset = set(parse_axis_key(key))
        return tuple(a for a in self.axes if a in keyset and getattr(self, a) > 1)

    # ----------------------------------------------------------- rank <-> coords
    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise LayoutError(
                f"rank {rank!r} is outside the world: expected an integer in "
                f"0..{self.world_size - 1}."
            )

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's position on every axis, e.g. ``{"tp": 1, "cp": 0, "dp": 0, "pp": 1}``."""
        self._check_rank(rank)
        return {a: (rank // self._strides[a]) % getattr(self, a) for a in AXES}

    def rank_of(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """The global rank at the given coordinates (inverse of :meth:`coords`)."""
        coords = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
        for axis, value in coords.items():
            size = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
                raise LayoutError(
                    f"{axis} coordinate {value!r} is out of range: expected 0..{size - 1}."
                )
        return sum(coords[a] * self._strides[a] for a in AXES)

    def node_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.devices_per_node

    def local_rank_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank % self.devices_per_node

    # ---------------------------------------------------------------- groups
    def _split(self, key: str) -> tuple[list[str], list[str]]:
        keyset = set(parse_axis_key(key))
        inside = [a for a in self.axes if a in keyset]
        outside = [a for a in self.axes if a not in keyset]
        return inside, outside

    def _span(self, axes: list[str]) -> list[int]:
        # Rank offsets covered by all coordinates of `axes`, the first axis fastest.
        values = [0]
        for axis in axes:
            stride = self._strides[axis]
            values = [v + c * stride for c in range(getattr(self, axis)) for v in values]
        return values

    def groups(self, key: str) -> list[list[int]]:
        """Every group of ``key``: a list by group index of rank lists by group rank.

        Example: 8 ranks, tp=2, cp=2, pp=1 (dp=2), order tp-cp-dp-pp:
        ``groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]``,
        ``groups("dp-cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]``.
        """
        inside, outside = self._split(key)
        offsets = self._span(inside)
        return [[base + o for o in offsets] for base in self._span(outside)]

    def group_of(self, rank: int, key: str) -> list[int]:
        """The member ranks (by group rank) of the ``key`` group that holds ``rank``."""
        coords = self.coords(rank)
        inside, _ = self._split(key)
        base = rank - sum(coords[a] * self._strides[a] for a in inside)
        return [base + o for o in self._span(inside)]

    def _enumerate(self, rank: int, axes: list[str]) -> int:
        coords = self.coords(rank)
        index, scale = 0, 1
        for axis in axes:
            index += coords[axis] * scale
            scale *= getattr(self, axis)
        return index

    def group_rank(self, rank: int, key: str) -> int:
        """``rank``'s position inside its ``key`` group."""
        return self._enumerate(rank, self._split(key)[0])

    def group_index(self, rank: int, key: str) -> int:
        """Index in :meth:`groups` of the ``key`` group that holds ``rank``."""
        return self._enumerate(rank, self._split(key)[1])

    def crosses_nodes(self, ranks) -> bool:
        """True when the ranks do not all sit on one node."""
        first = ranks[0] // self.devices_per_node
        return any(r // self.devices_per_node != first for r in ranks)

    def crossing_groups(self, key: str) -> list[int]:
        """Indices of the ``key`` groups whose ranks span more than one node.

        Not all groups of a key need agree: with 3 ranks per node and tp=2, group
        ``[0, 1]`` stays on node 0 while ``[2, 3]`` spans nodes 0 and 1.
        """
        if self.num_nodes == 1:
            return []
        return [i for i, g in enumerate(self.groups(key)) if self.crosses_nodes(g)]

    def crossing_group_count(self, key: str) -> int:
        """How many ``key`` groups span more than one node, without listing the groups.

        Equals ``len(crossing_groups(key))`` in O(devices_per_node**2) instead of
        O(world_size), so a layout search can ask it for thousands of candidates.

        Derivation: a group's members are ``b + o`` where ``b`` (its smallest rank)
        combines the coordinates of the axes outside the key and ``o`` runs over the
        offsets of the key's axes, from 0 to ``span = sum((size - 1) * stride)``. With
        ``D`` ranks per node the group stays on node ``b // D`` exactly when
        ``b % D + span < D``. So only the residues ``b % D`` matter: they are counted
        axis by axis (``c * stride % D`` repeats with period ``D / gcd(stride, D)``).

        Example: 6 ranks, 3 per node, tp=2 (dp=3): tp groups ``[0,1] [2,3] [4,5]``,
        ``span = 1``, residues of ``b`` = 0, 2, 1; only ``b = 2`` crosses::

            >>> Layout(world_size=6, tp=2, devices_per_node=3).crossing_group_count("tp")
            1
        """
        if self.num_nodes == 1:
            return 0
        inside, outside = self._split(key)
        per_node = self.devices_per_node
        span = sum((getattr(self, a) - 1) * self._strides[a] for a in inside)
        if span == 0:
            return 0
        if span >= per_node:
            return self.num_groups(key)
        residues = {0: 1}
        for axis in outside:
            size, stride = getattr(self, axis), self._strides[axis]
            period = per_node // gcd(stride, per_node)
            full, rest = divmod(size, period)
            steps = [((c * stride) % per_node, full + (c < rest)) for c in range(min(size, period))]
            merged: dict[int, int] = {}
            for r, n in residues.items():
                for step, m in steps:
                    if m:
                        key_r = (r + step) % per_node
                        merged[key_r] = merged.get(key_r, 0) + n * m
            residues = merged
        return sum(n for r, n in residues.items() if r + span >= per_node)

    def to_dict(self) -> dict:
        """The layout as the plain mapping a layout file holds."""
        return {
            "name": self.name,
            "world_size": self.world_size,
            "devices_per_node": self.devices_per_node,
            "tp": self.tp,
            "cp": self.cp,
            "dp": self.dp,
            "pp": self.pp,
            "order": "-".join(self.axes),
            "backend": self.backend,
        }
