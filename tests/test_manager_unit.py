"""The runtime manager in one process, with the MindSpore backend replaced by a recorder.

The real backend is exercised in test_mappings.py (msrun ranks); here the seams
(`_communication_initialized`, `_world`, `_create_backend_group`) let us play any rank of
any world size, e.g. rank 65,535 of 65,536, which no machine here could launch.
"""

import pytest

from mindscience.distributed import manager
from mindscience.distributed.group import GroupNotCreatedError
from mindscience.distributed.topology import Layout


@pytest.fixture
def fake_backend(monkeypatch):
    created = {}

    def setup(rank, world, initialized=True):
        monkeypatch.setattr(manager, "_communication_initialized", lambda: initialized)
        monkeypatch.setattr(manager, "_world", lambda: (rank, world))

    def create(name, ranks):
        assert name not in created or created[name] == ranks, f"name {name} reused for other ranks"
        created[name] = list(ranks)

    monkeypatch.setattr(manager, "_create_backend_group", create)
    manager.destroy_parallel()
    yield setup, created
    manager.destroy_parallel()


def test_rank5_of_8_with_pipeline(fake_backend):
    setup, created = fake_backend
    setup(rank=5, world=8)
    layout = manager.initialize_parallel(tensor_parallel_size=2, pipeline_parallel_size=2)
    assert layout.sizes == {"tp": 2, "cp": 1, "dp": 2, "pp": 2}
    assert manager.get_tensor_parallel_group().ranks == (4, 5)
    assert manager.get_tensor_parallel_rank() == 1
    assert manager.get_data_parallel_group().ranks == (5, 7)
    assert manager.get_data_parallel_rank() == 0
    assert manager.get_pipeline_parallel_group().ranks == (1, 5)
    assert manager.get_pipeline_parallel_world_size() == 2
    assert manager.is_pipeline_last_stage() and not manager.is_pipeline_first_stage()
    assert manager.get_pipeline_parallel_prev_rank() == 1
    assert manager.get_pipeline_parallel_next_rank() == 1  # ring: last -> first
    assert manager.get_context_parallel_world_size() == 1
    assert manager.get_data_context_parallel_group().ranks == (5, 7)
    # dp-cp shares dp's communicator when cp == 1; cp (size 1) gets none.
    assert manager.get_data_context_parallel_group_name() == manager.get_data_parallel_group_name()
    assert manager.get_created_group_count() == 3
    assert sorted(created.values()) == [[1, 5], [4, 5], [5, 7]]
    with pytest.raises(RuntimeError, match="size 1"):
        manager.get_context_parallel_group_name()
    with pytest.raises(GroupNotCreatedError):
        manager.get_context_parallel_group().group_name


def test_pipeline_ring_neighbours_on_four_stages(fake_backend):
    setup, _ = fake_backend
    setup(rank=2, world=4)
    manager.initialize_parallel(pipeline_parallel_size=4)
    assert manager.get_pipeline_parallel_group().ranks == (0, 1, 2, 3)
    assert (manager.get_pipeline_parallel_prev_rank(), manager.get_pipeline_parallel_next_rank()) == (1, 3)
    manager.destroy_parallel()
    setup(rank=0, world=4)
    manager.initialize_parallel(pipeline_parallel_size=4)
    assert manager.is_pipeline_first_stage()
    assert manager.get_pipeline_parallel_prev_rank() == 3


def test_huge_world_names_are_short_unique_and_match_the_plan(fake_backend):
    setup, created = fake_backend
    world = 65536
    layout = Layout(world_size=world, tp=8, cp=2, pp=16)
    for rank in (0, 12345, world - 1):
        setup(rank=rank, world=world)
        manager.initialize_parallel(8, 2, 16)
        for key in ("tp", "cp", "dp", "pp", "dp-cp"):
            group = manager.get_group(key)
            assert list(group.ranks) == layout.group_of(rank, key)
            assert group.rank == layout.group_rank(rank, key)
            assert len(group.group_name) <= 64
        extra = manager.get_group("tp-cp")
        assert list(extra.ranks) == layout.group_of(rank, "tp-cp")
        manager.destroy_parallel()
    assert max(len(n) for n in created) <= 64


def test_reinit_with_other_sizes_uses_fresh_names(fake_backend):
    setup, created = fake_backend
    setup(rank=1, world=4)
    manager.initialize_parallel(tensor_parallel_size=2, context_parallel_size=2)
    first = set(manager.created_group_names())
    manager.destroy_parallel()
    manager.initialize_parallel(tensor_parallel_size=4, order="cp-tp-dp-pp")
    second = set(manager.created_group_names())
    assert first and second and not first & second
    assert manager.get_tensor_parallel_group().ranks == (0, 1, 2, 3)


def test_getters_before_init_raise(fake_backend):
    assert not manager.is_initialized()
    for getter in (manager.get_tensor_parallel_group, manager.get_data_parallel_rank,
                   manager.get_context_parallel_world_size, manager.get_data_context_parallel_group_name,
                   manager.get_pipeline_parallel_next_rank, manager.get_layout):
        with pytest.raises(RuntimeError, match="initialize_parallel"):
            getter()


def test_not_initialized_communication(fake_backend):
    setup, created = fake_backend
    setup(rank=0, world=4, initialized=False)
    with pytest.raises(RuntimeError, match=r"communication.init\(\)"):
        manager.initialize_parallel(2)
    assert not manager.is_initialized() and not created


def test_double_init_and_bad_sizes(fake_backend):
    setup, _ = fake_backend
    setup(rank=0, world=8)
    with pytest.raises(RuntimeError, match="does not divide"):
        manager.initialize_parallel(tensor_parallel_size=3)
    with pytest.raises(ValueError, match="missing axis 'pp'"):
        manager.initialize_parallel(order="tp-cp-dp")
    with pytest.raises(RuntimeError, match="tp=0 is invalid"):
        manager.initialize_parallel(tensor_parallel_size=0)
    assert not manager.is_initialized()
    manager.initialize_parallel(2)
    with pytest.raises(RuntimeError, match="already called"):
        manager.initialize_parallel(2)
    with pytest.raises(ValueError, match="unknown axis"):
        manager.get_group("tp-xp")
    with pytest.raises(ValueError, match="mixes dense axis 'tp' with expert axis 'ep'"):
        manager.get_group("tp-ep")


def test_package_level_exports_are_the_module_functions():
    """``from mindscience.distributed import initialize_parallel`` works as upstream's does."""
    import mindscience.distributed as dist
    from mindscience.distributed import initialize_parallel, modules

    assert initialize_parallel is manager.initialize_parallel
    assert dist.ColumnParallelLinear is modules.ColumnParallelLinear
    assert dist.RowParallelLinear is modules.RowParallelLinear
    assert dist.initialize_affine_weight is modules.initialize_affine_weight
    assert {"initialize_parallel", "ColumnParallelLinear", "mappings"} <= set(dir(dist))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        dist.nope


def test_expert_groups_and_getters(fake_backend):
    setup, created = fake_backend
    # 16 ranks: tp2 x pp2 (dp4) for the dense layers; etp1 x ep4 x pp2 (edp2) for the experts.
    layout = Layout(world_size=16, tp=2, pp=2, ep=4, etp=1)
    setup(rank=13, world=16)
    manager.initialize_parallel(tensor_parallel_size=2, pipeline_parallel_size=2,
                                expert_model_parallel_size=4, expert_tensor_parallel_size=1)
    assert manager.get_layout() == layout and manager.get_layout().edp == 2
    assert manager.get_expert_model_parallel_group().ranks == (12, 13, 14, 15)
    assert manager.get_expert_model_parallel_rank() == 1
    assert manager.get_expert_model_parallel_world_size() == 4
    assert manager.get_expert_data_parallel_group().ranks == (9, 13)
    assert manager.get_expert_data_parallel_rank() == 1
    assert manager.get_expert_data_parallel_world_size() == 2
    assert manager.get_expert_tensor_parallel_world_size() == 1
    assert manager.get_expert_tensor_parallel_rank() == 0
    assert manager.get_expert_tensor_and_model_parallel_group().ranks == (12, 13, 14, 15)
    assert manager.get_pipeline_parallel_group().ranks == (5, 13)
    # Dense tp, dp (= dp-cp), pp, then ep (= etp-ep) and edp; etp and cp have size 1.
    assert sorted(created.values()) == [[5, 13], [9, 11, 13, 15], [9, 13], [12, 13], [12, 13, 14, 15]]
    assert manager.get_created_group_count() == 5
    for key in ("ep", "etp", "edp", "etp-ep", "edp-ep"):
        assert list(manager.get_group(key).ranks) == layout.group_of(13, key), key
        assert manager.get_group(key).rank == layout.group_rank(13, key), key
    # ep and etp-ep have the same members here: one communicator.
    assert manager.get_expert_model_parallel_group_name() == \
        manager.get_expert_tensor_and_model_parallel_group().group_name
    assert manager.get_expert_data_parallel_group_name() != manager.get_data_parallel_group_name()
    with pytest.raises(RuntimeError, match="size 1"):
        manager.get_expert_tensor_parallel_group_name()


def test_dense_layout_expert_groups_reuse_dense_communicators(fake_backend):
    setup, created = fake_backend
    setup(rank=6, world=8)
    manager.initialize_parallel(tensor_parallel_size=2, context_parallel_size=2)
    assert manager.get_expert_model_parallel_world_size() == 1
    assert manager.get_expert_tensor_parallel_group_name() == manager.get_tensor_parallel_group_name()
    assert manager.get_expert_data_parallel_group_name() == manager.get_data_context_parallel_group_name()
    assert manager.get_expert_data_parallel_group().ranks == manager.get_data_context_parallel_group().ranks
    # tp, cp, dp, dp-cp: the expert keys add nothing.
    assert manager.get_created_group_count() == 4


def test_bad_expert_sizes_raise_before_any_group(fake_backend):
    setup, created = fake_backend
    setup(rank=0, world=8)
    with pytest.raises(ValueError, match="ep=3 does not fit"):
        manager.initialize_parallel(expert_model_parallel_size=3)
    with pytest.raises(RuntimeError, match="etp=0 is invalid"):
        manager.initialize_parallel(expert_tensor_parallel_size=0)
    assert not manager.is_initialized() and not created


def test_huge_world_expert_groups_match_the_plan(fake_backend):
    setup, created = fake_backend
    world = 65536
    layout = Layout(world_size=world, tp=4, cp=2, pp=16, ep=64, etp=1)
    for rank in (0, 40961, world - 1):
        setup(rank=rank, world=world)
        manager.initialize_parallel(4, 2, 16, expert_model_parallel_size=64, expert_tensor_parallel_size=1)
        for key in ("ep", "etp", "edp", "etp-ep", "pp"):
            group = manager.get_group(key)
            assert list(group.ranks) == layout.group_of(rank, key)
            assert group.rank == layout.group_rank(rank, key)
        manager.destroy_parallel()
    assert max(len(n) for n in created) <= 64
