"""Errors of the cost model: bad model/training/cluster values and broken model constraints.

Both are :class:`~mindscience.distributed.topology.LayoutError` subclasses (so
``ValueError`` s): the CLI prints them as one line and exits with code 2, as it does for
layout keys.
"""

from __future__ import annotations

from ..topology.errors import LayoutError, LayoutFileError


class ModelError(LayoutError):
    """A model, training or cluster value is invalid (out of range, unknown choice)."""


class ModelFileError(ModelError, LayoutFileError):
    """A model file or section is missing, malformed or holds a bad key or value.

    Attributes:
        path: The file the error is about.
        key: The offending dotted key (``"model.num_layers"``), or None.
    """

    def __init__(self, message: str, path: str = "", key: str | None = None):
        LayoutFileError.__init__(self, message, path, key)


class ModelConstraintError(LayoutError):
    """A layout breaks a constraint of the model (``num_attention_heads % tp``, ...).

    Attributes:
        constraint: The constraint's name, e.g. ``"num_layers % pp"``.
    """

    def __init__(self, message: str, constraint: str):
        super().__init__(message)
        self.constraint = constraint
