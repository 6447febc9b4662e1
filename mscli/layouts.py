"""Find layout and model files: a path, or the name of a file bundled in ``layouts/``.

Layouts are ``layouts/*.yaml``; model presets (``msdist plan --model``, ``msdist suggest``)
are ``layouts/models/*.yaml``.
"""

from __future__ import annotations

import os
from pathlib import Path

from mindscience.distributed.topology import Layout, LayoutFileError, layout_from_mapping, load_layout
from mindscience.distributed.topology.layout_file import SECTIONS, read_yaml_mapping

DEFAULT_LAYOUT = "cpu-4"


def bundled_dir() -> Path:
    """The ``layouts/`` folder of this checkout (override with MSDIST_LAYOUTS_DIR)."""
    override = os.environ.get("MSDIST_LAYOUTS_DIR")
    if override:
        return Path(override)
    return Path(__file__).resolve().parent.parent / "layouts"


def _yaml_files(folder: Path) -> dict[str, Path]:
    if not folder.is_dir():
        return {}
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def bundled_layouts() -> dict[str, Path]:
    """Bundled layout names (file stems) mapped to their files."""
    return _yaml_files(bundled_dir())


def bundled_models() -> dict[str, Path]:
    """Bundled model presets (``layouts/models/*.yaml``) by name."""
    return _yaml_files(bundled_dir() / "models")


def _find(spec: str, bundled: dict[str, Path], kind: str) -> Path:
    path = Path(spec)
    if path.exists():
        return path
    name = path.stem if path.suffix in (".yaml", ".yml") and path.parent == Path(".") else spec
    if name in bundled:
        return bundled[name]
    names = ", ".join(bundled) or "(none found)"
    raise LayoutFileError(
        f"{spec}: no such {kind} file or bundled {kind}: pass a YAML path or one of: {names}.",
        str(spec),
    )


def resolve(spec: str | None) -> Path:
    """The file meant by ``spec``: None = the default layout, a path, or a bundled name.

    Raises:
        LayoutFileError: nothing matches.
    """
    return _find(DEFAULT_LAYOUT if spec is None else spec, bundled_layouts(), "layout")


def resolve_model(spec: str) -> Path:
    """The model file meant by ``spec``: a path or a preset name such as ``gpt3-175b``.

    Raises:
        LayoutFileError: nothing matches.
    """
    return _find(spec, bundled_models(), "model")


def load(spec: str | None) -> tuple[Layout, Path]:
    path = resolve(spec)
    return load_layout(path), path


def load_with_sections(spec: str | None) -> tuple[Layout, Path, dict]:
    """The layout, its file and the file's cost-model sections (``model``, ``training``, ``cluster``)."""
    path = resolve(spec)
    data = read_yaml_mapping(path)
    layout = layout_from_mapping(data, str(path))
    return layout, path, {k: data[k] for k in SECTIONS if k in data}
