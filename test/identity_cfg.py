"""A plain module whose attributes the identity tests' hooks read (``identity_cfg.SCALE``)."""

import os
import sys
import types

SCALE = 1.0

nested = types.SimpleNamespace(inner=types.SimpleNamespace(scale=1.0))


def call(fn, t):
    # A hook calls a function through another module's function: both codes count.
    return fn(t)


DYNAMIC_SCALE = 1.0
_PARTS = ("DYNAMIC", "_SCALE")
_THIS = sys.modules[__name__]


def computed_getattr_unpack(t):
    # The attribute's name is computed: the key must cover every attribute of this module.
    return t / 2 * getattr(_THIS, "".join(_PARTS))


def imported_in_body_unpack(t):
    # The module is imported in the body, not a global of this module.
    import identity_imported

    return t / 2 * identity_imported.SCALE


def environ_unpack(t):
    return t / 2 * float(os.environ.get("TORCH_PATCHES_TEST_SCALE", "1.0"))


def getenv_unpack(t):
    return t / 2 * float(os.getenv("TORCH_PATCHES_TEST_SCALE", "1.0"))
