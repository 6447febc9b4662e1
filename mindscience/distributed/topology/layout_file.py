"""Read a parallel layout from a YAML file.

Schema (every key but ``world_size`` is optional)::

    name: tp2-cp2            # label
    description: ...         # free text
    world_size: 16
    devices_per_node: 8      # default: world_size (one node)
    tp: 2
    cp: 2
    pp: 2
    dp: 2                    # default: world_size / (tp*cp*pp)
    order: tp-cp-dp-pp       # first axis varies fastest
    backend: cpu             # cpu | ascend | gpu

Every error names the file and the key, so a CLI can print it as one line.
"""

from __future__ import annotations

import os

from .errors import LayoutError, LayoutFileError
from .layout import Layout

# key -> (accepted Python types, human name of the type)
_SCHEMA = {
    "name": ((str,), "a string"),
    "description": ((str,), "a string"),
    "world_size": ((int,), "an integer"),
    "devices_per_node": ((int,), "an integer"),
    "tp": ((int,), "an integer"),
    "cp": ((int,), "an integer"),
    "pp": ((int,), "an integer"),
    "dp": ((int,), "an integer"),
    "order": ((str,), "a string such as tp-cp-dp-pp"),
    "backend": ((str,), "one of cpu, ascend, gpu"),
}


def layout_from_mapping(data, source: str = "<layout>") -> Layout:
    """Build a :class:`Layout` from a parsed mapping, checking keys and types.

    Args:
        data: The mapping read from YAML (or built by hand).
        source: Where it came from, for error messages.

    Raises:
        LayoutFileError: not a mapping, unknown key, wrong type, or an invalid layout.
    """
    if not isinstance(data, dict):
        raise LayoutFileError(
            f"{source}: expected a mapping of layout keys (world_size, tp, cp, pp, ...), "
            f"got {type(data).__name__}.",
            source,
        )
    for key, value in data.items():
        if key not in _SCHEMA:
            raise LayoutFileError(
                f"{source}: unknown key {key!r}: expected one of {', '.join(_SCHEMA)}. "
                "Remove it or fix its spelling.",
                source,
                str(key),
            )
        types, expected = _SCHEMA[key]
        if value is None and key in ("dp", "devices_per_node", "name", "description"):
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            raise LayoutFileError(
                f"{source}: key {key!r} has value {value!r} ({type(value).__name__}): "
                f"expected {expected}.",
                source,
                key,
            )
    if "world_size" not in data and data.get("dp") is None:
        raise LayoutFileError(
            f"{source}: key 'world_size' is missing: expected the number of ranks. "
            "Add e.g. 'world_size: 8'.",
            source,
            "world_size",
        )
    kwargs = {k: v for k, v in data.items() if k != "description"}
    if "backend" in kwargs:
        kwargs["backend"] = kwargs["backend"].lower()
    try:
        return Layout(**kwargs)
    except LayoutFileError:
        raise
    except LayoutError as err:
        raise LayoutFileError(f"{source}: {err}", source) from None


def load_layout(path: str | os.PathLike) -> Layout:
    """Read and validate a layout file.

    Raises:
        LayoutFileError: the file is missing or unreadable, is not valid YAML, or holds
            an invalid layout.
    """
    import yaml  # only the file path needs it

    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise LayoutFileError(
            f"{path}: no such layout file. Pass the path of a YAML layout, or one of the "
            "bundled names (see 'msdist plan --list').",
            path,
        ) from None
    except OSError as err:
        raise LayoutFileError(f"{path}: cannot read the layout file: {err.strerror}.", path) from None
    try:
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        data = yaml.load(text, Loader=loader)
    except yaml.YAMLError as err:
        where = ""
        mark = getattr(err, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise LayoutFileError(
            f"{path}: malformed YAML{where}: {problem}. Fix the syntax (key: value per line).",
            path,
        ) from None
    if data is None:
        raise LayoutFileError(f"{path}: the layout file is empty: expected at least 'world_size'.", path)
    return layout_from_mapping(data, path)
