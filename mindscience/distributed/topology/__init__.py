"""Pure rank arithmetic for parallel layouts (no MindSpore import).

    >>> from mindscience.distributed.topology import Layout
    >>> Layout(world_size=8, tp=2, pp=2).groups("dp")
    [[0, 2], [1, 3], [4, 6], [5, 7]]
"""

from .errors import LayoutError, LayoutFileError
from .layout import AXES, AXIS_NAMES, BACKENDS, DEFAULT_ORDER, Layout, parse_axis_key, parse_order
from .layout_file import load_layout, layout_from_mapping

__all__ = [
    "AXES",
    "AXIS_NAMES",
    "BACKENDS",
    "DEFAULT_ORDER",
    "Layout",
    "LayoutError",
    "LayoutFileError",
    "layout_from_mapping",
    "load_layout",
    "parse_axis_key",
    "parse_order",
]
