"""Find layout files: a path, or the name of a layout bundled in ``layouts/``."""

from __future__ import annotations

import os
from pathlib import Path

from mindscience.distributed.topology import Layout, LayoutFileError, load_layout

DEFAULT_LAYOUT = "cpu-4"


def bundled_dir() -> Path:
    """The ``layouts/`` folder of this checkout (override with MSDIST_LAYOUTS_DIR)."""
    override = os.environ.get("MSDIST_LAYOUTS_DIR")
    if override:
        return Path(override)
    return Path(__file__).resolve().parent.parent / "layouts"


def bundled_layouts() -> dict[str, Path]:
    """Bundled layout names (file stems) mapped to their files."""
    folder = bundled_dir()
    if not folder.is_dir():
        return {}
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def resolve(spec: str | None) -> Path:
    """The file meant by ``spec``: None = the default layout, a path, or a bundled name.

    Raises:
        LayoutFileError: nothing matches.
    """
    if spec is None:
        spec = DEFAULT_LAYOUT
    path = Path(spec)
    if path.exists():
        return path
    bundled = bundled_layouts()
    name = path.stem if path.suffix in (".yaml", ".yml") and path.parent == Path(".") else spec
    if name in bundled:
        return bundled[name]
    names = ", ".join(bundled) or "(none found)"
    raise LayoutFileError(
        f"{spec}: no such layout file or bundled layout: pass a YAML path or one of: {names}.",
        str(spec),
    )


def load(spec: str | None) -> tuple[Layout, Path]:
    path = resolve(spec)
    return load_layout(path), path
