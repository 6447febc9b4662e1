"""Topology core: validation, rank arithmetic, and a brute-force cross-check of groups."""

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from mindscience.distributed.topology import (
    AXES,
    Layout,
    LayoutError,
    load_layout,
    parse_axis_key,
    parse_order,
)

ALL_KEYS = ["-".join(c) for n in range(1, 5) for c in itertools.combinations(AXES, n)]
ALL_ORDERS = ["-".join(p) for p in itertools.permutations(AXES)]


def brute_force_groups(sizes: dict, order: str, key: str) -> list[list[int]]:
    """Groups by exhaustive enumeration, written independently of Layout.

    Walks every coordinate tuple with the LAST axis of `order` slowest (itertools.product
    over the reversed order), numbering ranks 0, 1, 2, ...; then buckets ranks by their
    coordinates outside `key` and sorts buckets and members lexicographically on the
    reversed-order coordinates (slowest first), i.e. the first axis varies fastest.
    """
    axes = order.split("-")
    slow_first = list(reversed(axes))
    inside = set(key.split("-"))
    buckets = {}
    for rank, coord in enumerate(itertools.product(*(range(sizes[a]) for a in slow_first))):
        named = dict(zip(slow_first, coord))
        outer = tuple(named[a] for a in slow_first if a not in inside)
        inner = tuple(named[a] for a in slow_first if a in inside)
        buckets.setdefault(outer, []).append((inner, rank))
    return [[r for _, r in sorted(members)] for _, members in sorted(buckets.items())]


def factorizations(world: int, limit: int):
    """(tp, cp, pp) triples dividing world, at most `limit` of them, spread out."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    triples = [
        (tp, cp, pp)
        for tp in divisors
        for cp in divisors
        for pp in divisors
        if world % (tp * cp * pp) == 0
    ]
    step = max(1, len(triples) // limit)
    return triples[::step]


# --------------------------------------------------------------------------- groups
@pytest.mark.parametrize("world", [1, 2, 4, 6, 8, 12, 16, 24, 64])
def test_groups_match_brute_force_every_order_and_key_small_worlds(world):
    for tp, cp, pp in factorizations(world, 12):
        for order in ALL_ORDERS:
            layout = Layout(world_size=world, tp=tp, cp=cp, pp=pp, order=order)
            for key in ALL_KEYS:
                assert layout.groups(key) == brute_force_groups(layout.sizes, order, key), (
                    world, tp, cp, pp, order, key)


@pytest.mark.parametrize(
    "world,tp,cp,pp,order",
    [
        (10752, 8, 2, 4, "tp-cp-dp-pp"),  # Megatron's largest golden world
        (10752, 4, 4, 8, "tp-cp-pp-dp"),
        (10752, 2, 8, 3, "cp-tp-dp-pp"),
        (12288, 8, 4, 16, "pp-dp-cp-tp"),
        (16384, 8, 2, 16, "tp-dp-cp-pp"),
    ],
)
def test_groups_match_brute_force_large_worlds(world, tp, cp, pp, order):
    layout = Layout(world_size=world, tp=tp, cp=cp, pp=pp, order=order)
    for key in ("tp", "cp", "dp", "pp", "dp-cp", "tp-cp", "tp-dp-cp", "tp-cp-dp-pp"):
        assert layout.groups(key) == brute_force_groups(layout.sizes, order, key), key


def test_groups_partition_the_world_and_are_orthogonal():
    layout = Layout(world_size=64, tp=4, cp=2, pp=2, order="cp-tp-pp-dp")
    for key in ALL_KEYS:
        flat = sorted(r for g in layout.groups(key) for r in g)
        assert flat == list(range(64))
    # A tp group and a dp group share exactly one rank when they meet.
    tp_groups = [set(g) for g in layout.groups("tp")]
    dp_groups = [set(g) for g in layout.groups("dp")]
    assert all(len(a & b) <= 1 for a in tp_groups for b in dp_groups)


def test_key_spelling_does_not_change_groups():
    layout = Layout(world_size=16, tp=2, cp=2, pp=2)
    assert layout.groups("dp-cp") == layout.groups("cp-dp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]


def test_documented_example_eight_ranks():
    layout = Layout(world_size=8, tp=2, pp=2)
    assert layout.dp == 2
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.coords(5) == {"tp": 1, "cp": 0, "dp": 0, "pp": 1}


def test_group_of_rank_index_agree_with_groups_everywhere():
    layout = Layout(world_size=48, tp=2, cp=3, pp=2, order="dp-tp-pp-cp", devices_per_node=8)
    for key in ALL_KEYS:
        groups = layout.groups(key)
        for rank in range(48):
            idx = layout.group_index(rank, key)
            assert layout.group_of(rank, key) == groups[idx]
            assert groups[idx][layout.group_rank(rank, key)] == rank


def test_coords_round_trip_node_and_local_rank():
    layout = Layout(world_size=64, tp=4, cp=2, pp=2, devices_per_node=8, order="pp-tp-dp-cp")
    for rank in range(64):
        assert layout.rank_of(**layout.coords(rank)) == rank
        assert layout.node_of(rank) == rank // 8
        assert layout.local_rank_of(rank) == rank % 8
    assert layout.num_nodes == 8


def test_crossing_groups_differ_within_one_key():
    layout = Layout(world_size=6, tp=2, devices_per_node=3)
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5]]
    assert layout.crossing_groups("tp") == [1]


def test_effective_axes_drop_size_one_axes():
    layout = Layout(world_size=8, tp=2, cp=1, pp=2)
    assert layout.effective_axes("dp-cp") == ("dp",)
    assert layout.effective_axes("cp") == ()
    assert layout.size("tp-dp") == 4


def test_dp_derived_or_checked_and_world_from_dp():
    assert Layout(world_size=16, tp=2, cp=2).dp == 4
    assert Layout(world_size=16, tp=2, cp=2, dp=4).dp == 4
    assert Layout(tp=2, dp=3).world_size == 6


# ------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"world_size": 8, "tp": 0}, "tp=0 is invalid"),
        ({"world_size": 8, "cp": -2}, "cp=-2 is invalid"),
        ({"world_size": 8, "tp": 2.0}, "expected a positive integer, got float"),
        ({"world_size": 8, "pp": True}, "got bool"),
        ({"world_size": "8"}, "world_size='8' is invalid"),
        ({"world_size": 0}, "world_size=0 is invalid"),
        ({"world_size": 8, "tp": 3}, "does not divide world_size=8"),
        ({"world_size": 8, "tp": 2, "dp": 2}, "dp=2 disagrees with world_size=8"),
        ({"world_size": 8, "dp": 0}, "dp=0 is invalid"),
        ({}, "world_size is missing"),
        ({"world_size": 8, "devices_per_node": 3}, "devices_per_node=3 does not divide world_size=8"),
        ({"world_size": 8, "devices_per_node": 0}, "devices_per_node=0 is invalid"),
        ({"world_size": 8, "order": "tp-cp-dp"}, "missing axis 'pp'"),
        ({"world_size": 8, "order": "tp-cp-dp-pp-xp"}, "unknown axis 'xp'"),
        ({"world_size": 8, "order": "tp-ep-cp-ep-dp-pp"}, "repeats axis 'ep'"),
        ({"world_size": 8, "order": "tp-tp-dp-pp"}, "repeats axis 'tp'"),
        ({"world_size": 8, "order": 5}, "expected a string"),
        ({"world_size": 8, "backend": "tpu"}, "backend='tpu' is invalid"),
    ],
)
def test_invalid_layouts_raise_one_clear_error(kwargs, fragment):
    with pytest.raises(LayoutError) as info:
        Layout(**kwargs)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


def test_errors_say_how_to_fix():
    with pytest.raises(LayoutError, match="Set dp=4 or remove dp"):
        Layout(world_size=16, tp=2, cp=2, dp=2)


@pytest.mark.parametrize("key", ["", "tp-", "xp", "tp-tp", "dp--cp", None])
def test_bad_axis_keys(key):
    with pytest.raises(LayoutError):
        parse_axis_key(key)
    with pytest.raises(LayoutError):
        Layout(world_size=4, tp=2).groups(key)


def test_parse_order_returns_axes():
    assert parse_order("pp-dp-cp-tp") == ("pp", "dp", "cp", "tp")


@pytest.mark.parametrize("rank", [-1, 8, 2.0, "1"])
def test_bad_ranks(rank):
    with pytest.raises(LayoutError, match="outside the world"):
        Layout(world_size=8).coords(rank)


def test_rank_of_rejects_out_of_range_coordinate():
    with pytest.raises(LayoutError, match="tp coordinate 2 is out of range"):
        Layout(world_size=8, tp=2).rank_of(tp=2)


# ------------------------------------------------------------------ node crossing
@pytest.mark.parametrize("world", [6, 12, 16, 24, 48, 64])
def test_crossing_group_count_matches_the_listed_groups(world):
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    for per_node in divisors:
        for tp, cp, pp in factorizations(world, 10):
            for order in ALL_ORDERS[::5]:
                layout = Layout(world_size=world, tp=tp, cp=cp, pp=pp, order=order, devices_per_node=per_node)
                for key in ALL_KEYS:
                    assert layout.crossing_group_count(key) == len(layout.crossing_groups(key)), (
                        world, per_node, tp, cp, pp, order, key)


def test_crossing_group_count_large_world_is_fast_and_right():
    layout = Layout(world_size=65536, tp=8, cp=2, pp=16, devices_per_node=16, order="dp-tp-cp-pp")
    for key in ("tp", "cp", "dp", "pp", "dp-cp"):
        assert layout.crossing_group_count(key) == len(layout.crossing_groups(key))


# ------------------------------------------------------------------ layout files with sections
def test_layout_files_carry_cost_model_sections_and_round_trip(tmp_path):
    from mindscience.distributed.topology.layout_file import layout_to_yaml

    layout = Layout(world_size=16, tp=2, cp=2, pp=2, devices_per_node=8, order="pp-tp-cp-dp", name="x",
                    backend="ascend")
    sections = {"model": {"num_layers": 2}, "cluster": {"device_memory_gb": 32}}
    path = tmp_path / "x.yaml"
    path.write_text(layout_to_yaml(layout, description="d", sections=sections, comment="one\ntwo"))
    text = path.read_text()
    assert text.startswith("# one\n# two\nname: x\ndescription: d\n")
    assert load_layout(path) == layout
    with pytest.raises(LayoutError, match="section 'extra'"):
        layout_to_yaml(layout, sections={"extra": {}})


# ------------------------------------------------------------------ purity
def test_topology_and_plan_never_import_mindspore():
    code = (
        "import sys\n"
        "import mindscience.distributed.topology as t\n"
        "import mindscience.distributed.topology.plan as p\n"
        "import mindscience.distributed.group\n"
        "import mindscience.distributed.costmodel as c\n"
        "from mindscience.distributed import initialize_parallel\n"
        "import mscli.main, mscli.commands.suggest, mscli.render_cost\n"
        "l = t.Layout(world_size=64, tp=4, cp=2, pp=2, devices_per_node=8)\n"
        "p.build_plan(l)\n"
        "w = c.load_workload('layouts/models/gqa-7b.yaml')\n"
        "c.estimate(l, w)\n"
        "c.suggest(w, 64)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'mindspore']\n"
        "assert not bad, bad\n"
        "print('clean')\n"
    )
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "clean"


# ------------------------------------------------------------------ expert axes (ep, etp, edp)
EXPERT_KEYS = ["-".join(c) for n in range(1, 5) for c in itertools.combinations(("etp", "ep", "edp", "pp"), n)]
FULL_ORDERS = ["-".join(p) for p in itertools.permutations(("tp", "cp", "ep", "dp", "pp"))]


def megatron_expert_groups(world, tp, cp, pp, ep, etp, order5, key):
    """Expert groups the way Megatron's RankGenerator makes them, written apart from Layout.

    The expert generator is the dense one run again with cp of size 1, tp of size etp and
    dp of size edp (``edp = world / (etp*ep*pp)``), over the same five-axis order; then
    the groups are found by enumerating every coordinate in a nested loop.
    """
    edp = world // (etp * ep * pp)
    twin = {"tp": "etp", "ep": "ep", "dp": "edp", "pp": "pp"}
    order = "-".join(twin[a] for a in order5.split("-") if a != "cp")
    return brute_force_groups({"etp": etp, "ep": ep, "edp": edp, "pp": pp}, order, key)


def expert_cases(world):
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    for tp, cp, pp in factorizations(world, 6):
        for ep in divisors[1:4]:
            for etp in sorted({1, tp}):
                if world % (etp * ep * pp) == 0 and (ep > 1 or etp != tp):
                    yield tp, cp, pp, ep, etp


@pytest.mark.parametrize("world", [4, 8, 12, 32])
def test_expert_groups_match_megatron_brute_force_or_fail_its_rules(world):
    """Every valid layout's expert groups equal Megatron's; every rejected one breaks a rule."""
    checked = rejected = 0
    for tp, cp, pp, ep, etp in expert_cases(world):
        for order in FULL_ORDERS[::9]:
            dense_pp = brute_force_groups({"tp": tp, "cp": cp, "dp": world // (tp * cp * pp), "pp": pp},
                                          order.replace("ep-", "").replace("-ep", ""), "pp")
            expert_pp = megatron_expert_groups(world, tp, cp, pp, ep, etp, order, "pp")
            edp, dp = world // (etp * ep * pp), world // (tp * cp * pp)
            breaks_rules = dense_pp != expert_pp or (not order.endswith("pp") and pp > 1 and edp != dp)
            try:
                layout = Layout(world_size=world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order)
            except LayoutError as err:
                assert breaks_rules, (world, tp, cp, pp, ep, etp, order, str(err))
                rejected += 1
                continue
            assert not breaks_rules, (world, tp, cp, pp, ep, etp, order)
            assert (layout.ep, layout.etp, layout.edp) == (ep, etp, edp)
            for key in EXPERT_KEYS:
                assert layout.groups(key) == megatron_expert_groups(world, tp, cp, pp, ep, etp, order, key), (
                    world, tp, cp, pp, ep, etp, order, key)
            checked += 1
    assert checked > 0 and (world < 8 or rejected > 0)


@pytest.mark.parametrize(
    "world,tp,cp,pp,ep,etp,order",
    [
        (2048, 1, 1, 16, 64, 1, "tp-cp-ep-dp-pp"),  # DeepSeek-V3's run: 2048 GPUs, pp16, ep64
        (1024, 4, 2, 4, 8, 1, "tp-cp-ep-dp-pp"),   # Megatron "MoE parallel folding": etp 1 under tp 4
        (4096, 8, 1, 8, 16, 2, "tp-ep-cp-dp-pp"),
        (3072, 2, 2, 3, 4, 4, "tp-cp-dp-ep-pp"),
    ],
)
def test_expert_groups_match_megatron_brute_force_large_worlds(world, tp, cp, pp, ep, etp, order):
    layout = Layout(world_size=world, tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, order=order)
    for key in ("ep", "etp", "edp", "etp-ep", "pp", "edp-ep"):
        assert layout.groups(key) == megatron_expert_groups(world, tp, cp, pp, ep, etp, order, key), key
    assert layout.groups("pp") == brute_force_groups(layout.sizes, "-".join(layout.axes), "pp")


def test_expert_groups_without_expert_split_are_the_dense_ones_in_any_order():
    # ep = 1 and etp = tp: today's layouts, even in orders Megatron's expert rules would reject.
    for order in ALL_ORDERS:
        layout = Layout(world_size=24, tp=2, cp=3, pp=2, order=order)
        assert (layout.ep, layout.etp, layout.edp) == (1, 2, 6)
        assert layout.groups("etp") == layout.groups("tp")
        assert layout.groups("edp") == layout.groups("dp-cp")
        assert layout.groups("etp-ep") == layout.groups("tp")
        assert layout.groups("ep") == [[r] for r in range(24)]
        assert layout.signature("edp") == layout.signature("dp-cp")
        assert layout.order == order and layout.to_dict()["order"] == order and "ep" not in layout.to_dict()


def test_documented_expert_example_and_coords():
    layout = Layout(world_size=8, tp=2, ep=4)
    assert (layout.dp, layout.etp, layout.edp, layout.order) == (4, 2, 1, "tp-cp-ep-dp-pp")
    assert layout.groups("ep") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.groups("etp") == layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("etp-ep") == [list(range(8))]
    assert layout.groups("edp") == [[r] for r in range(8)]
    assert layout.expert_coords(5) == {"etp": 1, "ep": 2, "edp": 0, "pp": 0}
    # Megatron's folding: etp 1 under tp 2, ep 4 on 8 ranks -> edp 2.
    fold = Layout(world_size=8, tp=2, ep=4, etp=1)
    assert fold.edp == 2
    assert fold.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert fold.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert fold.groups("etp") == [[r] for r in range(8)]


def test_expert_group_of_rank_index_coords_agree_with_groups():
    layout = Layout(world_size=48, tp=2, cp=3, pp=2, ep=4, etp=1, order="tp-ep-cp-dp-pp", devices_per_node=8)
    columns = layout.axis_columns(("ep", "etp", "edp"))
    for key in EXPERT_KEYS:
        groups = layout.groups(key)
        for rank in range(48):
            idx = layout.group_index(rank, key)
            assert layout.group_of(rank, key) == groups[idx]
            assert groups[idx][layout.group_rank(rank, key)] == rank
            assert layout.crossing_group_count(key) == len(layout.crossing_groups(key))
    for rank in range(48):
        coords = layout.expert_coords(rank)
        assert [columns[a][rank] for a in ("ep", "etp", "edp")] == [coords[a] for a in ("ep", "etp", "edp")]
        assert coords["pp"] == layout.coords(rank)["pp"]


def test_equal_signatures_mean_equal_groups():
    for layout in (Layout(world_size=16, tp=2, cp=2, pp=2, ep=2, etp=2),
                   Layout(world_size=16, tp=2, cp=2, pp=2, ep=4, etp=1),
                   Layout(world_size=16, tp=4, ep=2, etp=2, order="tp-cp-dp-ep-pp")):
        keys = ALL_KEYS + EXPERT_KEYS
        for a in keys:
            for b in keys:
                if layout.signature(a) == layout.signature(b):
                    assert layout.groups(a) == layout.groups(b), (layout, a, b)
                elif layout.size(a) > 1 and layout.size(b) > 1:
                    assert layout.groups(a) != layout.groups(b), (layout, a, b)


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"world_size": 8, "ep": 3}, "ep=3 does not fit: etp*ep*pp = 1*3*1 = 3 does not divide world_size=8"),
        ({"world_size": 8, "tp": 2, "pp": 2, "ep": 4}, "ep=4 does not fit: etp*ep*pp = 2*4*2 = 16"),
        ({"world_size": 8, "ep": 0}, "ep=0 is invalid"),
        ({"world_size": 8, "ep": True}, "ep=True is invalid"),
        ({"world_size": 8, "etp": 0}, "etp=0 is invalid"),
        ({"world_size": 8, "etp": 2.0}, "etp=2.0 is invalid"),
        ({"world_size": 16, "cp": 2, "pp": 2, "ep": 4, "order": "tp-cp-ep-pp-dp"},
         "edp must equal dp"),
        ({"world_size": 16, "tp": 2, "pp": 2, "ep": 2, "etp": 1, "order": "tp-pp-cp-ep-dp"},
         "other pipeline groups than the dense ones"),
    ],
)
def test_invalid_expert_layouts_raise_one_line_naming_the_key(kwargs, fragment):
    with pytest.raises(LayoutError) as info:
        Layout(**kwargs)
    message = str(info.value)
    assert fragment in message and "\n" not in message
    assert message.split("=")[0] in ("ep", "etp")


@pytest.mark.parametrize("key,fragment", [("tp-ep", "mixes dense axis 'tp' with expert axis 'ep'"),
                                          ("edp-cp", "mixes dense axis 'cp' with expert axis 'edp'"),
                                          ("ep-xp", "unknown axis 'xp'"), ("ep-ep", "repeats an axis")])
def test_bad_expert_keys(key, fragment):
    with pytest.raises(LayoutError, match=fragment):
        Layout(world_size=8, ep=2).groups(key)


def test_order_naming_ep_and_its_default_place():
    assert parse_order("tp-cp-ep-dp-pp") == ("tp", "cp", "ep", "dp", "pp")
    layout = Layout(world_size=16, tp=2, ep=2, order="pp-tp-dp-cp")
    assert layout.order_axes == ("pp", "tp", "ep", "dp", "cp") and layout.axes == ("pp", "tp", "dp", "cp")
    assert layout == Layout(world_size=16, tp=2, ep=2, order="pp-tp-ep-dp-cp")
    # ep's place changes the expert groups, never the dense ones.
    other = Layout(world_size=16, tp=2, ep=2, order="pp-ep-tp-dp-cp")
    assert other.groups("ep") != layout.groups("ep")
    assert all(other.groups(k) == layout.groups(k) for k in ALL_KEYS)
    # ep = 1: where ep sits changes nothing, so the order is spelled with the dense axes.
    assert Layout(world_size=8, tp=2, order="tp-ep-cp-dp-pp") == Layout(world_size=8, tp=2)


def test_expert_layout_files_round_trip_and_keep_ep(tmp_path):
    from mindscience.distributed.topology.layout_file import layout_to_yaml

    layout = Layout(world_size=64, tp=4, pp=2, ep=8, etp=1, devices_per_node=8, name="e", backend="ascend")
    path = tmp_path / "e.yaml"
    path.write_text(layout_to_yaml(layout))
    assert "ep: 8\netp: 1\norder: tp-cp-ep-dp-pp\n" in path.read_text()
    assert load_layout(path) == layout
    for rank in (0, 37, 63):
        assert load_layout(path).expert_coords(rank) == layout.expert_coords(rank)
