"""Check modules that worker ranks import (see ``registry.CHECK_MODULES``).

Each module registers checks with ``@check("area.name")``. ``basic`` holds the harness's
own checks (ping, a world all-reduce) and fault injection used to test the launcher.
"""
