"""Which groups a check runs on: one entry per distinct set of member ranks.

``dp-cp`` holds the same ranks as ``cp`` when dp == 1; running (or timing) both would
repeat the same communicator, so they run once under the label ``"cp=dp-cp"``. Size-1
groups are kept (each under its own key): mappings check that they are the identity.
"""

from __future__ import annotations

# "world" names the group of every rank: the key of all four axes.
WORLD_KEY = "tp-cp-dp-pp"


def distinct_groups(manager, keys) -> dict:
    """``{label: group}`` for ``keys``, in order, groups with the same ranks merged.

    Example, 4 ranks tp=2 cp=2: ``["tp", "cp", "dp-cp", "world"]`` ->
    ``{"tp": <tp>, "cp=dp-cp": <cp>, "world": <tp-cp-dp-pp>}``.
    """
    labelled: dict = {}
    for key in keys:
        group = manager.get_group(WORLD_KEY if key == "world" else key)
        ident = group.ranks if group.size > 1 else key
        if ident in labelled:
            labelled[ident][0] += f"={key}"
        else:
            labelled[ident] = [key, group]
    return {label: group for label, group in labelled.values()}
