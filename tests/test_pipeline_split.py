"""pipeline.split.stage_layers: the layers of every model stage (pure), against hand-cut values."""

from __future__ import annotations

import sys

import pytest

from mindscience.distributed.costmodel.errors import ModelConstraintError, ModelError
from mindscience.distributed.pipeline.split import model_stage_of, stage_layer_offsets, stage_layers


def test_even_cut_and_one_stage():
    assert stage_layers(8, 4) == [2, 2, 2, 2]
    assert stage_layers(8, 2, 2) == [2, 2, 2, 2]  # 2 ranks x 2 chunks
    assert stage_layers(5, 1) == [5]
    assert stage_layers(5, 1, first_stage_layers=5) == [5]


def test_first_and_last_stage_layers():
    assert stage_layers(10, 4, first_stage_layers=4, last_stage_layers=4) == [4, 1, 1, 4]
    assert stage_layers(5, 2, first_stage_layers=2) == [2, 3]
    assert stage_layers(10, 4, first_stage_layers=1, last_stage_layers=3) == [1, 3, 3, 3]
    assert stage_layers(10, 3, last_stage_layers=2) == [4, 4, 2]
    # With chunks: model stage k = chunk c of rank i with k = c * pp + i; the first is rank 0's chunk 0.
    assert stage_layers(11, 2, 2, first_stage_layers=2) == [2, 3, 3, 3]


def test_embedding_and_loss_counted_as_layers():
    # Llama 3 405B: 126 + 2 = 128 slots on 16 stages, the first and last hold 7 layers.
    assert stage_layers(126, 16, account_for_embedding_in_pipeline_split=True,
                        account_for_loss_in_pipeline_split=True) == [7] + [8] * 14 + [7]
    # BLOOM 176B: 70 + 2 = 72 on 12 stages.
    assert stage_layers(70, 12, account_for_embedding_in_pipeline_split=True,
                        account_for_loss_in_pipeline_split=True) == [5] + [6] * 10 + [5]
    assert stage_layers(7, 4, account_for_embedding_in_pipeline_split=True) == [1, 2, 2, 2]
    assert stage_layers(7, 4, account_for_loss_in_pipeline_split=True) == [2, 2, 2, 1]


def test_offsets_and_model_stage_of():
    assert stage_layer_offsets([2, 3]) == [0, 2]
    assert stage_layer_offsets([7, 8, 8, 7]) == [0, 7, 15, 23]
    assert [model_stage_of(i, c, 4) for c in range(2) for i in range(4)] == list(range(8))
    assert model_stage_of(1, 1, 4) == 5


@pytest.mark.parametrize("args,kwargs,fragments", [
    ((5, 2), {}, ["num_layers=5 cannot be cut into 2 model stages", "first_stage_layers=1"]),
    ((10, 4), dict(first_stage_layers=5, last_stage_layers=4), ["the other 2 stage(s) would share 1 layers"]),
    ((6, 2), dict(first_stage_layers=6), ["would share 0 layers"]),
    ((126, 5), dict(account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True),
     ["= 128 does not split evenly over 5 model stages"]),
    ((3, 1), dict(first_stage_layers=2), ["first_stage_layers=2 with a single stage"]),
])
def test_impossible_cuts_name_the_values_and_the_fix(args, kwargs, fragments):
    with pytest.raises(ModelConstraintError) as err:
        stage_layers(*args, **kwargs)
    assert err.value.constraint in ("num_layers % pp", "stage layers")
    for fragment in fragments:
        assert fragment in str(err.value)


def test_bad_values_and_mixed_options():
    with pytest.raises(ModelError, match="cannot be combined"):
        stage_layers(8, 2, first_stage_layers=3, account_for_loss_in_pipeline_split=True)
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ModelError, match="num_layers"):
            stage_layers(bad, 2)
    with pytest.raises(ModelError, match="first_stage_layers=0"):
        stage_layers(4, 2, first_stage_layers=0)


def test_split_is_pure():
    import subprocess

    code = ("import sys; from mindscience.distributed.pipeline.split import stage_layers; "
            "stage_layers(4, 2); print('mindspore' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
