"""Pure rank arithmetic for parallel layouts (no MindSpore import).

    >>> from mindscience.distributed.topology import Layout
    >>> Layout(world_size=8, tp=2, pp=2).groups("dp")
    [[0, 2], [1, 3], [4, 6], [5, 7]]
    >>> Layout(world_size=8, tp=2, ep=4).groups("ep")
    [[0, 2, 4, 6], [1, 3, 5, 7]]
"""

from .errors import LayoutError, LayoutFileError
from .layout import (
    AXES,
    AXIS_NAMES,
    BACKENDS,
    DEFAULT_EXPERT_ORDER,
    DEFAULT_ORDER,
    EXPERT_AXES,
    KEY_AXES,
    Layout,
    full_order,
    is_expert_key,
    parse_axis_key,
    parse_order,
)
from .layout_file import load_layout, layout_from_mapping

__all__ = [
    "AXES",
    "AXIS_NAMES",
    "BACKENDS",
    "DEFAULT_EXPERT_ORDER",
    "DEFAULT_ORDER",
    "EXPERT_AXES",
    "KEY_AXES",
    "Layout",
    "full_order",
    "is_expert_key",
    "LayoutError",
    "LayoutFileError",
    "layout_from_mapping",
    "load_layout",
    "parse_axis_key",
    "parse_order",
]
