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
    ep: 8                    # expert-parallel size (default 1)
    etp: 1                   # expert tensor-parallel size (default: tp)
    order: tp-cp-ep-dp-pp    # first axis varies fastest; ep optional (then just before dp)
    backend: cpu             # cpu | ascend | gpu
    model: {...}             # optional sections for the cost model
    training: {...}          # (mindscience.distributed.costmodel reads them;
    cluster: {...}           #  the layout itself ignores them)

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
    "ep": ((int,), "an integer"),
    "etp": ((int,), "an integer"),
    "order": ((str,), "a string such as tp-cp-dp-pp or tp-cp-ep-dp-pp"),
    "backend": ((str,), "one of cpu, ascend, gpu"),
}
LAYOUT_KEYS = tuple(_SCHEMA)
# Sections a layout file may carry for the cost model (a mapping each).
SECTIONS = ("model", "training", "cluster")


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
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise LayoutFileError(
                    f"{source}: section {key!r} has value {value!r} ({type(value).__name__}): "
                    f"expected a mapping of {key} keys (indented 'key: value' lines).",
                    source,
                    key,
                )
            continue
        if key not in _SCHEMA:
            raise LayoutFileError(
                f"{source}: unknown key {key!r}: expected one of {', '.join(LAYOUT_KEYS + SECTIONS)}. "
                "Remove it or fix its spelling.",
                source,
                str(key),
            )
        types, expected = _SCHEMA[key]
        if value is None and key in ("dp", "etp", "devices_per_node", "name", "description"):
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
    kwargs = {k: v for k, v in data.items() if k != "description" and k not in SECTIONS}
    if "backend" in kwargs:
        kwargs["backend"] = kwargs["backend"].lower()
    try:
        return Layout(**kwargs)
    except LayoutFileError:
        raise
    except LayoutError as err:
        message = str(err)
        # Layout's messages start with the offending key ("ep=3 does not fit: ...").
        key = next((k for k in LAYOUT_KEYS if message.startswith(f"{k}=")), None)
        raise LayoutFileError(f"{source}: {message}", source, key) from None


def read_yaml_mapping(path: str | os.PathLike, what: str = "layout") -> dict:
    """Read a YAML file that must hold a non-empty document (layout or model file).

    Args:
        path: The file.
        what: ``"layout"`` or ``"model"``, for the messages.

    Raises:
        LayoutFileError: the file is missing or unreadable, is not valid YAML, or is
            empty.
    """
    import yaml  # only the file path needs it

    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise LayoutFileError(
            f"{path}: no such {what} file. Pass the path of a YAML {what} file, or one of the "
            f"bundled names (see 'msdist {'layouts' if what == 'layout' else 'suggest --help'}').",
            path,
        ) from None
    except OSError as err:
        raise LayoutFileError(f"{path}: cannot read the {what} file: {err.strerror}.", path) from None
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
        needed = "'world_size'" if what == "layout" else "a 'model' section"
        raise LayoutFileError(f"{path}: the {what} file is empty: expected at least {needed}.", path)
    return data


def layout_to_yaml(layout: Layout, description: str | None = None, sections: dict | None = None,
                   comment: str | None = None) -> str:
    """The text of a layout file that :func:`load_layout` reads back as ``layout``.

    Args:
        layout: The layout.
        description: Its ``description:``.
        sections: Extra sections (``model``, ``training``, ``cluster``) to append.
        comment: Lines written as ``#`` comments at the top.
    """
    import yaml

    data = {k: v for k, v in layout.to_dict().items() if v is not None}
    if description:
        data = {**({"name": data.pop("name")} if "name" in data else {}), "description": description, **data}
    head = "".join(f"# {line}\n" for line in (comment or "").splitlines())
    body = yaml.safe_dump(data, sort_keys=False)
    for key, section in (sections or {}).items():
        if key not in SECTIONS:
            raise LayoutError(f"section {key!r} is invalid: expected one of {', '.join(SECTIONS)}.")
        body += yaml.safe_dump({key: section}, sort_keys=False)
    return head + body


def load_layout(path: str | os.PathLike) -> Layout:
    """Read and validate a layout file.

    Raises:
        LayoutFileError: the file is missing or unreadable, is not valid YAML, or holds
            an invalid layout.
    """
    return layout_from_mapping(read_yaml_mapping(path), os.fspath(path))
