"""Hidden dependencies of saved-tensor hooks, one per kind, for the identity tests.

Every kind builds the same hook pair -- ``pack(t) = t * 2``, ``unpack(t) = t / 2 * s`` --
where ``s`` is read through one hidden dependency: a closure cell, a global, an attribute
of a module / class / instance / namespace / nn.Module, a parameter or buffer, the code of a
function, staticmethod or ``forward`` the hook calls, a default argument, the state of a
``functools.partial`` / bound method / callable instance, a captured tensor, an fx.wrap leaf.
``s`` scales the gradients, so a stale compiled graph shows as wrong gradients.

``KINDS[name].set(value)`` changes only that dependency; ``KINDS[name].hooks()`` builds the
pair anew (recreated hooks must not recompile when nothing changed). Values are 1.0, 2.0, 3.0.
Used in-process by test_hook_identity.py and in fresh processes by identity_worker.py.
"""

import dataclasses
import functools
import os
import types
from collections.abc import Callable

import identity_cfg  # a plain module whose attributes hooks read
import identity_imported  # imported again inside a hook's body
import torch
import torch.fx

from torch_patches.hooks import inlineable

VALUES = (1.0, 2.0, 3.0)


def pack(t):
    return t * 2


# ------------------------------------------------------------------------ kinds

_cell = {"s": 1.0}


def _closure_hooks():
    s = _cell["s"]  # a new closure per value; recreated per step

    def unpack(t):
        return t / 2 * s

    return inlineable(pack, unpack)


GLOBAL_S = 1.0


def _global_unpack(t):
    return t / 2 * GLOBAL_S


def _module_attr_unpack(t):
    return t / 2 * identity_cfg.SCALE


def _nested_attr_unpack(t):
    return t / 2 * identity_cfg.nested.inner.scale


class Cfg:
    SCALE = 1.0

    @staticmethod
    def scale_of(t):
        return t * 1.0


def _class_attr_unpack(t):
    return t / 2 * Cfg.SCALE


def _staticmethod_unpack(t):
    return Cfg.scale_of(t / 2)


class Holder:
    def __init__(self):
        self.scale = 1.0


OBJ = Holder()
NS = types.SimpleNamespace(scale=1.0)


def _object_attr_unpack(t):
    return t / 2 * OBJ.scale


def _namespace_unpack(t):
    return t / 2 * NS.scale


class Scaler(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = 1.0
        self.register_buffer("buf", torch.tensor(1.0))
        self.weight = torch.nn.Parameter(torch.tensor(1.0))

    def forward(self, t):
        return t * 1.0


MOD = Scaler()


def _nn_attr_unpack(t):
    return t / 2 * MOD.scale


def _nn_buffer_unpack(t):
    return t / 2 * MOD.buf


def _nn_param_unpack(t):
    return t / 2 * MOD.weight.detach()


def _nn_forward_unpack(t):
    return MOD(t / 2)


def helper(t):
    return t * 1.0


def _helper_1(t):
    return t * 1.0


def _helper_2(t):
    return t * 2.0


def _helper_3(t):
    return t * 3.0


_CODES = {1.0: _helper_1.__code__, 2.0: _helper_2.__code__, 3.0: _helper_3.__code__}


def _forward_1(self, t):
    return t * 1.0


def _forward_2(self, t):
    return t * 2.0


def _forward_3(self, t):
    return t * 3.0


_FORWARDS = {1.0: _forward_1, 2.0: _forward_2, 3.0: _forward_3}


def _function_code_unpack(t):
    return identity_cfg.call(helper, t / 2)


def _default_unpack(t, s=1.0):
    return t / 2 * s


BIG = torch.ones(5000)  # above the by-value size: keyed by identity and version


def _big_tensor_unpack(t):
    return t / 2 * BIG[0]


SMALL = torch.tensor(1.0)


def _small_tensor_unpack(t):
    return t / 2 * SMALL


def _scaled(t, s):
    return t / 2 * s


_partial_s = {"s": 1.0}


class MethodHolder:
    def __init__(self, s):
        self.s = s

    def unpack(self, t):
        return t / 2 * self.s


class CallableUnpack:
    def __init__(self, s):
        self.s = s

    def __call__(self, t):
        return t / 2 * self.s


_gm_s = {"s": 1.0}


class _GmUnpack(torch.nn.Module):
    def __init__(self, s):
        super().__init__()
        self.register_buffer("s", torch.tensor(s))

    def forward(self, t):
        return t / 2 * self.s


def leaf_scale(t):
    return t * 1.0


torch.fx.wrap("leaf_scale")


def _leaf_unpack(t):
    return leaf_scale(t / 2)


def _gm_leaf_hooks():
    return torch.fx.symbolic_trace(pack), torch.fx.symbolic_trace(_leaf_unpack)


# ------------------------------------------------------------------------ table


@dataclasses.dataclass
class Kind:
    set: Callable[[float], None]
    hooks: Callable[[], tuple]
    #: "a": keyed by value (a cross-process cache hit for equal values); "b": process-local.
    outcome: str = "a"
    #: A tensor the hooks read: as ambient hooks, a runtime input of the graphs (guarded by
    #: its metadata), so changing its values recompiles nothing (torch_patches/_functorch/_aot_autograd/hook_inputs.py, find_inputs).
    lifted: bool = False


def _setter(obj, name):
    return lambda v: setattr(obj, name, v)


def _fill(t):
    def set_value(v):
        with torch.no_grad():
            t.fill_(v)

    return set_value


def _set_environ(v):
    os.environ["TORCH_PATCHES_TEST_SCALE"] = str(v)


def _marked(unpack):
    return lambda: inlineable(pack, unpack)


KINDS = {
    "closure": Kind(lambda v: _cell.__setitem__("s", v), _closure_hooks),
    "global": Kind(lambda v: globals().__setitem__("GLOBAL_S", v), _marked(_global_unpack)),
    "module_attr": Kind(_setter(identity_cfg, "SCALE"), _marked(_module_attr_unpack)),
    "nested_attr": Kind(_setter(identity_cfg.nested.inner, "scale"), _marked(_nested_attr_unpack)),
    "class_attr": Kind(_setter(Cfg, "SCALE"), _marked(_class_attr_unpack)),
    "staticmethod_code": Kind(
        lambda v: setattr(Cfg, "scale_of", staticmethod(types.FunctionType(_CODES[v], globals()))),
        _marked(_staticmethod_unpack),
    ),
    "object_attr": Kind(_setter(OBJ, "scale"), _marked(_object_attr_unpack)),
    "namespace_attr": Kind(_setter(NS, "scale"), _marked(_namespace_unpack)),
    "nn_module_attr": Kind(_setter(MOD, "scale"), _marked(_nn_attr_unpack)),
    "nn_module_buffer": Kind(_fill(MOD.buf), _marked(_nn_buffer_unpack), lifted=True),
    "nn_module_parameter": Kind(_fill(MOD.weight), _marked(_nn_param_unpack), lifted=True),
    "nn_module_forward_code": Kind(
        lambda v: setattr(Scaler, "forward", _FORWARDS[v]),
        _marked(_nn_forward_unpack),
    ),
    "called_function_code": Kind(lambda v: setattr(helper, "__code__", _CODES[v]), _marked(_function_code_unpack)),
    "default_argument": Kind(lambda v: setattr(_default_unpack, "__defaults__", (v,)), _marked(_default_unpack)),
    "small_tensor_inplace": Kind(_fill(SMALL), _marked(_small_tensor_unpack), lifted=True),
    "big_tensor_inplace": Kind(_fill(BIG), _marked(_big_tensor_unpack), outcome="b", lifted=True),
    "partial": Kind(
        lambda v: _partial_s.__setitem__("s", v),
        lambda: inlineable(pack, functools.partial(_scaled, s=_partial_s["s"])),
    ),
    "bound_method": Kind(
        lambda v: _partial_s.__setitem__("s", v),
        lambda: inlineable(pack, MethodHolder(_partial_s["s"]).unpack),
    ),
    "callable_instance": Kind(
        lambda v: _partial_s.__setitem__("s", v),
        lambda: inlineable(pack, CallableUnpack(_partial_s["s"])),
    ),
    "graph_module_buffer": Kind(
        lambda v: _gm_s.__setitem__("s", v),
        lambda: (torch.fx.symbolic_trace(pack), torch.fx.symbolic_trace(_GmUnpack(_gm_s["s"]))),
    ),
    "fx_wrap_leaf_code": Kind(lambda v: setattr(leaf_scale, "__code__", _CODES[v]), _gm_leaf_hooks),
    "computed_attribute_name": Kind(_setter(identity_cfg, "DYNAMIC_SCALE"), _marked(identity_cfg.computed_getattr_unpack)),
    "module_imported_in_body": Kind(_setter(identity_imported, "SCALE"), _marked(identity_cfg.imported_in_body_unpack)),
    "environ": Kind(_set_environ, _marked(identity_cfg.environ_unpack)),
    "getenv": Kind(_set_environ, _marked(identity_cfg.getenv_unpack)),
}


def set_all(value):
    """Every dependency to ``value`` (a known state before a test changes one)."""
    for kind in KINDS.values():
        kind.set(value)
