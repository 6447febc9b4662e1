"""Checkpoint errors (no MindSpore import)."""


class CheckpointError(ValueError):
    """A checkpoint cannot be saved, loaded or converted as asked (the message says why
    and how to fix it). Nothing was modified."""


class CheckpointIntegrityError(CheckpointError):
    """The checkpoint on disk is incomplete or corrupt: a missing or truncated file, a
    checksum mismatch, elements covered twice or not at all, copies that disagree."""


class CheckpointFormatError(CheckpointError):
    """The directory holds a manifest this msdist cannot read: another format, or a
    format version it does not know (the message names it and the supported ones)."""


class CheckpointExpertCountError(CheckpointError):
    """The checkpoint holds another number of experts than the MoE model loading it (the
    message names both counts and the fix)."""
