"""``msdist suggest --write``: the layout's ``backend:`` follows the device model."""

import pytest
from typer.testing import CliRunner

from mindscience.distributed.topology import load_layout
from mscli.commands.suggest import DEVICE_BACKENDS, device_backend
from mscli.main import app

runner = CliRunner()


def _write(tmp_path, *args):
    out = tmp_path / "x.yaml"
    result = runner.invoke(app, ["suggest", "--model", "tiny-gpt", "--world", "4", *args, "--write", str(out)])
    assert result.exit_code == 0, result.output
    return load_layout(out)


@pytest.mark.parametrize("device,backend", [("cpu", "cpu"), ("h100-80gb", "gpu"), ("ascend-910b", "ascend")])
def test_write_takes_the_backend_of_the_device_model(tmp_path, device, backend):
    assert _write(tmp_path, "--device", device).backend == backend


def test_write_without_a_device_keeps_ascend_and_backend_wins(tmp_path):
    assert _write(tmp_path).backend == "ascend"  # the generic accelerator
    assert _write(tmp_path, "--device", "cpu", "--backend", "gpu").backend == "gpu"


def test_every_device_preset_has_a_backend():
    from mindscience.distributed.costmodel.devices import DEVICE_PRESETS
    from mindscience.distributed.topology import BACKENDS

    assert set(DEVICE_BACKENDS) == set(DEVICE_PRESETS)
    assert {device_backend(d) for d in DEVICE_PRESETS} <= set(BACKENDS)
