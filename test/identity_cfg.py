"""A plain module whose attributes the identity tests' hooks read (``identity_cfg.SCALE``)."""

import types


SCALE = 1.0

nested = types.SimpleNamespace(inner=types.SimpleNamespace(scale=1.0))


def call(fn, t):
    # A hook calls a function through another module's function: both codes count.
    return fn(t)
