"""A parallel layout: the sizes of the tp, cp, dp and pp axes (and the expert axes ep, etp, edp)
and how ranks map onto them.

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

Expert axes (Megatron's "MoE parallel folding"): expert layers run on the same ranks as the
dense ones, split as ``etp x ep x edp x pp`` instead of ``tp x cp x dp x pp``, with
``edp = world / (etp * ep * pp)`` and the same pipeline groups. ``order`` may name ``ep``
(``tp-cp-ep-dp-pp``); an order of the four dense axes places ep just before dp. The dense
axes ignore ep; the expert groups come from the same order with cp of size 1, tp of size
etp and dp of size edp. Keys of expert groups use ``etp``, ``ep``, ``edp`` (and ``pp``):
``"ep"``, ``"etp-ep"`` (the token-dispatch group), ``"edp"``. With ep = 1 and etp = tp the
expert layers are dense layers in all but name and their groups are the dense ones in any
order (``etp`` = ``tp``, ``edp`` = ``dp-cp``, ``ep`` of size 1).

Example: 8 ranks, tp=2, ep=4 (so dp=4, etp=2, edp=1), order ``tp-cp-ep-dp-pp``::

    tp groups [0,1] [2,3] [4,5] [6,7]     ep groups     [0,2,4,6] [1,3,5,7]
    dp groups [0,2,4,6] [1,3,5,7]         etp-ep groups [0,1,...,7]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import gcd, prod

from .errors import LayoutError

AXES = ("tp", "cp", "dp", "pp")
EXPERT_AXES = ("etp", "ep", "edp", "pp")
# Every name a group key may use; tp/cp/dp (dense) and etp/ep/edp (expert) never mix.
KEY_AXES = ("tp", "cp", "dp", "pp", "etp", "ep", "edp")
_DENSE_ONLY = frozenset(("tp", "cp", "dp"))
_EXPERT_ONLY = frozenset(("etp", "ep", "edp"))
AXIS_NAMES = {"tp": "tensor", "cp": "context", "dp": "data", "pp": "pipeline",
              "ep": "expert", "etp": "expert tensor", "edp": "expert data"}
DEFAULT_ORDER = "tp-cp-dp-pp"
# Megatron's default, with ep; an order of the four dense axes means the same placement.
DEFAULT_EXPERT_ORDER = "tp-cp-ep-dp-pp"
BACKENDS = ("cpu", "ascend", "gpu")
# The order's axis that each expert axis takes the place of (cp has no expert twin: size 1).
_EXPERT_TWIN = {"tp": "etp", "ep": "ep", "dp": "edp", "pp": "pp"}


def _check_positive_int(name: str, value, fix: str) -> None:
    # bool is an int subclass; `tp: true` in YAML must not pass as 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(
            f"{name}={value!r} is invalid: expected a positive integer, got {type(value).__name__}. {fix}"
        )
    if value < 1:
        raise LayoutError(f"{name}={value} is invalid: expected a positive integer (>= 1). {fix}")


def parse_order(order: str) -> tuple[str, ...]:
    """Split and validate an order string such as ``"tp-cp-dp-pp"`` or ``"tp-cp-ep-dp-pp"``.

    Returns:
        The axes as written: the four dense axes, optionally with ``ep`` among them.

    Raises:
        LayoutError: the order is not a string, names an unknown axis, repeats one or
            leaves one of tp, cp, dp, pp out.
    """
    if not isinstance(order, str):
        raise LayoutError(
            f"order={order!r} is invalid: expected a string such as {DEFAULT_ORDER!r}."
        )
    parts = tuple(p.strip() for p in order.split("-"))
    expected = (f"expected each of {', '.join(AXES)} exactly once (and optionally ep), joined by '-', "
                f"e.g. {DEFAULT_ORDER!r} or {DEFAULT_EXPERT_ORDER!r}.")
    unknown = [p for p in parts if p not in AXES and p != "ep"]
    if unknown:
        raise LayoutError(f"order={order!r} names unknown axis {unknown[0]!r}: {expected}")
    dupes = sorted({p for p in parts if parts.count(p) > 1})
    if dupes:
        raise LayoutError(f"order={order!r} repeats axis {dupes[0]!r}: {expected}")
    missing = [a for a in AXES if a not in parts]
    if missing:
        raise LayoutError(f"order={order!r} is missing axis {missing[0]!r}: {expected}")
    return parts


def full_order(axes) -> tuple[str, ...]:
    """The five-axis order: ``axes`` as given, ep placed just before dp when absent."""
    axes = tuple(axes)
    if "ep" in axes:
        return axes
    i = axes.index("dp")
    return axes[:i] + ("ep",) + axes[i:]


def parse_axis_key(key: str) -> tuple[str, ...]:
    """Split and validate a group key such as ``"tp"``, ``"dp-cp"`` or ``"etp-ep"``.

    Returns:
        The axes in the key's own spelling order.

    Raises:
        LayoutError: empty key, unknown or repeated axis, or dense axes (tp, cp, dp)
            mixed with expert axes (etp, ep, edp).
    """
    example = "e.g. 'tp', 'dp-cp' or 'etp-ep'"
    if not isinstance(key, str) or not key.strip():
        raise LayoutError(
            f"group key {key!r} is invalid: expected one or more of {', '.join(KEY_AXES)} "
            f"joined by '-', {example}."
        )
    parts = tuple(p.strip() for p in key.split("-"))
    for p in parts:
        if p not in KEY_AXES:
            raise LayoutError(
                f"group key {key!r} names unknown axis {p!r}: expected one or more of "
                f"{', '.join(KEY_AXES)} joined by '-', {example}."
            )
    if len(set(parts)) != len(parts):
        raise LayoutError(
            f"group key {key!r} repeats an axis: name each axis at most once, e.g. 'dp-cp'."
        )
    dense = [p for p in parts if p in _DENSE_ONLY]
    expert = [p for p in parts if p in _EXPERT_ONLY]
    if dense and expert:
        raise LayoutError(
            f"group key {key!r} mixes dense axis {dense[0]!r} with expert axis {expert[0]!r}: a key "
            "names dense axes (tp, cp, dp, pp) or expert axes (etp, ep, edp, pp), e.g. 'dp-cp' or 'etp-ep'."
        )
    return parts


def is_expert_key(key: str) -> bool:
    """True when ``key`` names an expert axis (etp, ep or edp)."""
    return any(p in _EXPERT_ONLY for p in parse_axis_key(key))


@dataclass(frozen=True)
class _Frame:
    """A mixed-radix numbering of the ranks: primitive axes in order (first fastest).

    ``alias`` maps each axis a key may name to the primitive axes it stands for (with
    ep = 1 and etp = tp, ``edp`` stands for cp and dp).
    """

    axes: tuple
    sizes: dict
    strides: dict
    alias: dict


def _frame(axes, sizes: dict, alias: dict | None = None) -> _Frame:
    strides, stride = {}, 1
    for axis in axes:
        strides[axis] = stride
        stride *= sizes[axis]
    return _Frame(tuple(axes), dict(sizes), strides, alias or {a: (a,) for a in axes})


@dataclass(frozen=True)
class Layout:
    """Sizes of the parallel axes over a world of ranks, validated at construction.

    Args:
        world_size: Number of ranks. May be omitted when ``dp`` is given (then it is
            ``tp*cp*dp*pp``).
        tp: Tensor-parallel size.
        cp: Context (sequence) parallel size.
        pp: Pipeline-parallel size.
        dp: Data-parallel size; derived as ``world_size // (tp*cp*pp)`` when omitted,
            and must agree with it when given.
        order: The four axes joined by ``-``, first varying fastest; may also name ``ep``
            (e.g. ``tp-cp-ep-dp-pp``), else ep sits just before dp.
        devices_per_node: Ranks per node; defaults to ``world_size`` (one node).
        name: Optional label.
        backend: ``cpu``, ``ascend`` or ``gpu`` (used by ``msdist verify``).
        ep: Expert-model-parallel size (experts split over ep ranks); default 1.
        etp: Expert tensor-parallel size; defaults to ``tp``. After construction
            ``layout.etp`` is an int and ``layout.edp = world_size // (etp*ep*pp)``.

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
    ep: int = 1
    etp: int | None = None
    axes: tuple = field(init=False, repr=False, compare=False)
    order_axes: tuple = field(init=False, repr=False, compare=False)
    _strides: dict = field(init=False, repr=False, compare=False)
    _dense: _Frame = field(init=False, repr=False, compare=False)
    _expert: _Frame = field(init=False, repr=False, compare=False)

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
        order_axes = full_order(parse_order(self.order))
        axes = tuple(a for a in order_axes if a != "ep")
        dense = _frame(axes, self.sizes)
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "order_axes", order_axes)
        object.__setattr__(self, "_strides", dense.strides)
        object.__setattr__(self, "_dense", dense)
        self._init_expert(order_axes, dense)
        # One spelling per layout: the dense order while ep == 1 (where ep sits changes nothing).
        object.__setattr__(self, "order", "-".join(order_axes if self.ep > 1 else axes))

    def _init_expert(self, order_axes: tuple, dense: _Frame) -> None:
        """Validate ep and etp and build the expert layers' numbering of the ranks."""
        _check_positive_int("ep", self.ep, "Set ep to 1 to keep every expert on every rank.")
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        _check_positive_int("etp", self.etp, "Remove etp to use tp's size.")
        world, ep, etp, pp = self.world_size, self.ep, self.etp, self.pp
        model = etp * ep * pp
        if world % model:
            raise LayoutError(
                f"ep={ep} does not fit: etp*ep*pp = {etp}*{ep}*{pp} = {model} does not divide "
                f"world_size={world}: expected a divisor of {world}. Change ep or etp (etp defaults to tp)."
            )
        edp = world // model
        if ep == 1 and etp == self.tp:
            # Nothing is split differently: the expert groups are the dense ones, in any order.
            alias = {"etp": ("tp",), "ep": (), "edp": ("cp", "dp"), "pp": ("pp",)}
            object.__setattr__(self, "_expert", _Frame(dense.axes, dense.sizes, dense.strides, alias))
            return
        order = "-".join(order_axes)
        if order_axes[-1] != "pp" and pp > 1 and edp != self.dp:
            raise LayoutError(
                f"ep={ep} with order={order!r} gives expert data-parallel size edp={edp} but dp={self.dp}: "
                "when order does not end in pp, edp must equal dp. Put pp last in order or choose "
                f"etp*ep = tp*cp = {self.tp * self.cp}."
            )
        names = tuple(_EXPERT_TWIN[a] for a in order_axes if a != "cp")
        expert = _frame(names, {"etp": etp, "ep": ep, "edp": edp, "pp": pp})
        if pp > 1 and expert.strides["pp"] != dense.strides["pp"]:
            raise LayoutError(
                f"ep={ep}, etp={etp} with order={order!r} would give the expert layers other pipeline "
                f"groups than the dense ones (pp stride {expert.strides['pp']} vs {dense.strides['pp']}): "
                "expected identical pp groups. Put pp last in order, or make the sizes of the axes before "
                "pp equal for both (etp*ep = tp*cp there)."
            )
        object.__setattr__(self, "_expert", expert)

    # ----------------------------------------------------------------- sizes
    @property
    def sizes(self) -> dict[str, int]:
        """Axis sizes keyed by axis, in the fixed order tp, cp, dp, pp."""
        return {a: getattr(self, a) for a in AXES}

    @property
    def edp(self) -> int:
        """Expert data-parallel size: ``world_size // (etp * ep * pp)``."""
        return self.world_size // (self.etp * self.ep * self.pp)

    @property
    def expert_sizes(self) -> dict[str, int]:
        """Expert axis sizes keyed by axis: etp, ep, edp, pp."""
        return {"etp": self.etp, "ep": self.ep, "edp": self.edp, "pp": self.pp}

    @property
    def has_experts_split(self) -> bool:
        """True when expert layers are split unlike dense ones (ep > 1 or etp != tp)."""
        return self.ep > 1 or self.etp != self.tp

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.devices_per_node

    def _resolve(self, key: str) -> tuple[_Frame, set]:
        # The frame a key lives in and the primitive axes it covers.
        parts = parse_axis_key(key)
        if any(p in _EXPERT_ONLY for p in parts):
            frame = self._expert
            prims = {q for p in parts for q in frame.alias[p]}
            return frame, prims
        return self._dense, set(parts)

    def size(self, key: str) -> int:
        """Size of a group of ``key`` (product of its axes' sizes)."""
        frame, prims = self._resolve(key)
        return prod(frame.sizes[a] for a in prims)

    def num_groups(self, key: str) -> int:
        return self.world_size // self.size(key)

    def stride(self, axis: str) -> int:
        """Distance in global ranks between neighbours along ``axis``.

        For ``edp`` with ep = 1 and etp = tp (then edp is cp x dp) it is the first of them
        of size > 1; for a size-1 ``ep`` there it is 1.
        """
        frame, _ = self._resolve(axis)
        name = parse_axis_key(axis)[0]
        prims = [a for a in frame.axes if a in frame.alias.get(name, (name,))]
        big = [a for a in prims if frame.sizes[a] > 1] or prims
        return frame.strides[big[0]] if big else 1

    def effective_axes(self, key: str) -> tuple[str, ...]:
        """The key's primitive axes whose size is > 1, in ``order``'s order.

        Two keys with the same effective axes have the same groups (``dp-cp`` equals
        ``dp`` when cp == 1), so they can share one communicator. The axes are expert
        ones (etp, ep, edp, pp) for an expert key when ep > 1 or etp != tp, else dense.
        """
        frame, prims = self._resolve(key)
        return tuple(a for a in frame.axes if a in prims and frame.sizes[a] > 1)

    def signature(self, key: str) -> tuple:
        """What determines the ``key`` groups: ``(stride, size)`` runs of its axes of size > 1.

        Adjacent axes merge (``stride2 == stride1 * size1``), so two keys with equal
        signatures have exactly the same groups with the same group ranks, even across the
        dense and expert numberings (``edp`` and ``dp-cp`` in Megatron's default order);
        they can share one communicator. A size-1 key's signature is ``()``.
        """
        frame, prims = self._resolve(key)
        runs: list = []
        for axis in frame.axes:
            if axis in prims and frame.sizes[axis] > 1:
                stride, size = frame.strides[axis], frame.sizes[axis]
                if runs and runs[-1][0] * runs[-1][1] == stride:
                    runs[-1] = (runs[-1][0], runs[-1][1] * size)
                else:
                    runs.append((stride, size))
        return tuple(runs)

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

    def expert_coords(self, rank: int) -> dict[str, int]:
        """This rank's position on the expert axes, e.g. ``{"etp": 0, "ep": 3, "edp": 1, "pp": 0}``."""
        self._check_rank(rank)
        return {a: self.group_rank(rank, a) for a in EXPERT_AXES}

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

    def axis_columns(self, axes=("tp", "cp", "dp", "pp", "ep", "etp", "edp")) -> dict[str, list[int]]:
        """Every rank's coordinate on each of ``axes``, as lists indexed by rank.

        Column-wise list arithmetic: at 65,536 ranks this is ``msdist plan``'s hot path.
        """
        ranks = range(self.world_size)
        columns, by_signature = {}, {}
        for axis in axes:
            signature = self.signature(axis)
            if signature in by_signature:
                # Same signature, same group ranks (etp is tp when the experts are not split).
                columns[axis] = by_signature[signature]
                continue
            frame, prims = self._resolve(axis)
            column = None
            scale = 1
            for prim in (a for a in frame.axes if a in prims):
                stride, size = frame.strides[prim], frame.sizes[prim]
                if size == 1:
                    continue
                part = [(r // stride) % size for r in ranks]
                column = part if column is None else [c + p * scale for c, p in zip(column, part)]
                scale *= size
            columns[axis] = by_signature[signature] = column if column is not None else [0] * self.world_size
        return columns

    # ---------------------------------------------------------------- groups
    def _split(self, key: str) -> tuple[_Frame, list[str], list[str]]:
        frame, prims = self._resolve(key)
        inside = [a for a in frame.axes if a in prims]
        outside = [a for a in frame.axes if a not in prims]
        return frame, inside, outside

    @staticmethod
    def _span(frame: _Frame, axes: list[str]) -> list[int]:
        # Rank offsets covered by all coordinates of `axes`, the first axis fastest.
        values = [0]
        for axis in axes:
            stride = frame.strides[axis]
            values = [v + c * stride for c in range(frame.sizes[axis]) for v in values]
        return values

    def groups(self, key: str) -> list[list[int]]:
        """Every group of ``key``: a list by group index of rank lists by group rank.

        Example: 8 ranks, tp=2, cp=2, pp=1 (dp=2), order tp-cp-dp-pp:
        ``groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]``,
        ``groups("dp-cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]``.
        """
        frame, inside, outside = self._split(key)
        offsets = self._span(frame, inside)
        return [[base + o for o in offsets] for base in self._span(frame, outside)]

    def group_of(self, rank: int, key: str) -> list[int]:
        """The member ranks (by group rank) of the ``key`` group that holds ``rank``."""
        self._check_rank(rank)
        frame, inside, _ = self._split(key)
        base = rank - sum(((rank // frame.strides[a]) % frame.sizes[a]) * frame.strides[a] for a in inside)
        return [base + o for o in self._span(frame, inside)]

    def _enumerate(self, rank: int, frame: _Frame, axes: list[str]) -> int:
        self._check_rank(rank)
        index, scale = 0, 1
        for axis in axes:
            index += ((rank // frame.strides[axis]) % frame.sizes[axis]) * scale
            scale *= frame.sizes[axis]
        return index

    def group_rank(self, rank: int, key: str) -> int:
        """``rank``'s position inside its ``key`` group."""
        frame, inside, _ = self._split(key)
        return self._enumerate(rank, frame, inside)

    def group_index(self, rank: int, key: str) -> int:
        """Index in :meth:`groups` of the ``key`` group that holds ``rank``."""
        frame, _, outside = self._split(key)
        return self._enumerate(rank, frame, outside)

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
        frame, inside, outside = self._split(key)
        per_node = self.devices_per_node
        span = sum((frame.sizes[a] - 1) * frame.strides[a] for a in inside)
        if span == 0:
            return 0
        if span >= per_node:
            return self.num_groups(key)
        residues = {0: 1}
        for axis in outside:
            size, stride = frame.sizes[axis], frame.strides[axis]
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
        """The layout as the plain mapping a layout file holds.

        ``ep`` and ``etp`` appear only when the experts are split unlike the dense layers
        (ep > 1 or etp != tp), so a dense layout's mapping is what it always was.
        """
        data = {
            "name": self.name,
            "world_size": self.world_size,
            "devices_per_node": self.devices_per_node,
            "tp": self.tp,
            "cp": self.cp,
            "dp": self.dp,
            "pp": self.pp,
        }
        if self.has_experts_split:
            data["ep"] = self.ep
            data["etp"] = self.etp
        data["order"] = self.order
        data["backend"] = self.backend
        return data
