"""What the export reads and where it puts it: torch's source tree and ours, the upstream
module each module of ours stands for or moves into, and the stack's state so far.

:class:`Trees` answers the questions every step of the export asks (the text of an upstream
file as the stack leaves it, our module's parsed source, where our module goes upstream,
what a dotted name of ours resolves to); the exporter's driver (``_generate.py``) and one
patch's job (``_job.py``) read it and commit to its :class:`~tools.export_upstream._model.StackState`.
"""

from __future__ import annotations

import ast
import importlib.util
import os

from tools.export_upstream import _names
from tools.export_upstream._model import (
    CONFIG_HOME,
    CONFIG_MARK,
    HOOKS_PACKAGE,
    TP,
    StackState,
    is_tp,
    knob_upstream_name,
    module_relpath,
)
from tools.export_upstream._pysrc import ExportError, Source
from torch_patches import config as tp_config


def _tp_root() -> str:
    spec = importlib.util.find_spec(TP)
    if spec is None or not spec.submodule_search_locations:
        raise ExportError("torch_patches is not importable")
    return os.path.dirname(list(spec.submodule_search_locations)[0])


class Trees:
    """torch's source tree (``root``) and ours, and where each module of ours goes upstream."""

    def __init__(self, torch_root: str, repo_root: str | None = None) -> None:
        self.root = torch_root
        self.tp_root = _tp_root()
        self.repo_root = repo_root or os.path.dirname(self.tp_root)
        #: Pristine upstream texts read so far (relpath -> text; "" for a new module).
        self.base: dict[str, str] = {}
        #: The stack as the patches exported so far leave it.
        self.state = StackState()
        self._tp_sources: dict[str, Source] = {}
        self._up_sources: dict[str, Source] = {}
        self._import_ranks: dict[str, int] = {}
        #: Where each satellite module went in a previous pass (prose may name one before
        #: the code that moves it is exported).
        self.home_hints: dict[str, str] = {}
        #: Satellite modules prose named before the stack put them anywhere.
        self.unknown_homes: set[str] = set()
        #: New upstream modules (:meth:`new_home`): module -> relpath, and the module of
        #: ours each stands for.
        self.new_modules: dict[str, str] = {}
        self.new_module_sources: dict[str, str] = {}

    def read_upstream(self, rel: str) -> str:
        if rel not in self.base:
            with open(os.path.join(self.root, rel), encoding="utf-8") as f:
                self.base[rel] = f.read()
        return self.base[rel]

    def upstream_source(self, state: StackState, module: str) -> Source:
        rel = self.upstream_rel(module)
        text = state.texts.get(rel) or self.read_upstream(rel)
        if not text and module in self.new_modules:
            text = self.new_module_skeleton(module)
        key = f"{rel}\0{hash(text)}"
        if key not in self._up_sources:
            self._up_sources[key] = Source(text, module, rel.endswith("__init__.py"))
        return self._up_sources[key]

    def upstream_rel(self, module: str) -> str:
        rel = module_relpath(self.root, module)
        if rel is None and module in self.new_modules:
            return self.new_modules[module]
        if rel is None:
            raise ExportError(f"upstream module {module} has no source file under {self.root}")
        return rel

    def new_home(self, tp_module: str) -> str | None:
        """The new upstream module our ``tp_module`` becomes (None: it moves instead)."""
        if tp_module == TP + ".hooks":
            home = HOOKS_PACKAGE
        elif tp_module.startswith(TP + ".hooks."):
            # Private modules: the package is the API (its ``select`` and ``budget`` are
            # functions; a submodule of the same name would be shadowed by them).
            home = f"{HOOKS_PACKAGE}._{tp_module.rpartition('.')[2].lstrip('_')}"
        elif tp_module.count(".") >= 2 and module_relpath(self.root, "torch" + tp_module[len(TP) :]) is None:
            home = "torch" + tp_module[len(TP) :]
        else:
            return None
        if home not in self.new_modules:
            is_package = module_relpath(self.tp_root, tp_module).endswith("__init__.py")  # type: ignore[union-attr]
            rel = home.replace(".", "/") + ("/__init__.py" if is_package else ".py")
            self.new_modules[home] = rel
            self.new_module_sources[home] = tp_module
            self.base.setdefault(rel, "")
            parent = tp_module.rpartition(".")[0]
            if module_relpath(self.root, home.rpartition(".")[0]) is None and self.is_tp_module(parent):
                self.new_home(parent)  # a new package: its __init__.py comes with it
        return home

    def new_module_skeleton(self, module: str) -> str:
        """The text a new upstream module starts from: our module's docstring, and
        ``from __future__ import annotations`` (our code is written for it)."""
        src = self.tp_source(self.new_module_sources[module])
        first = src.tree.body[0] if src.tree.body else None
        is_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
        head = src.segment(first) + "\n\n" if is_doc else ""  # as written (r-strings...)
        return head + "from __future__ import annotations\n"

    def tp_source(self, module: str) -> Source:
        if module not in self._tp_sources:
            rel = module_relpath(self.tp_root, module)
            if rel is None:
                raise ExportError(f"{module} is not a torch_patches source module")
            with open(os.path.join(self.tp_root, rel), encoding="utf-8") as f:
                self._tp_sources[module] = Source(f.read(), module, rel.endswith("__init__.py"))
        return self._tp_sources[module]

    def import_rank(self, module: str) -> int:
        """How deep our ``module`` sits in our modules' top-level imports: 0 if it imports
        none of ours, else one more than the deepest it imports.  Helpers moved from several
        of our modules into one upstream file are written in this order (then by module and
        line), the order Python runs them in: a definition never comes before one of another
        module that it uses when it is defined (an annotation, a base class, a default)."""
        if module not in self._import_ranks:
            self._import_ranks[module] = 0  # an import cycle stops here
            deps = set()
            for b in self.tp_source(module).bindings.values():
                if b.kind != "import" or b.type_checking or b.dotted is None or not is_tp(b.dotted):
                    continue
                try:
                    dep = self.resolve_tp(b.dotted)[0]
                except ExportError:
                    continue
                if dep != module:
                    deps.add(dep)
            self._import_ranks[module] = max((self.import_rank(d) + 1 for d in sorted(deps)), default=0)
        return self._import_ranks[module]

    def is_tp_module(self, dotted: str) -> bool:
        return (dotted == TP or dotted.startswith(TP + ".")) and module_relpath(self.tp_root, dotted) is not None

    def mirror_of(self, tp_module: str) -> str | None:
        """The upstream module a torch_patches module mirrors (None: a satellite)."""
        if self.is_config_module(tp_module):
            return CONFIG_HOME
        # Mirrors live in packages (torch_patches/_functorch/..., _dynamo/...); top-level
        # modules (_errors, _logging, hooks, testing...) are ours only.
        if tp_module.count(".") < 2:
            return None
        up = "torch" + tp_module[len(TP) :]
        return up if module_relpath(self.root, up) else None

    def is_config_module(self, tp_module: str) -> bool:
        return CONFIG_MARK in self.tp_source(tp_module).text

    def resolve_tp(self, dotted: str) -> tuple[str, str | None]:
        """``torch_patches...`` dotted path -> (tp module, None) or (defining tp module, name)."""
        if self.is_tp_module(dotted):
            return dotted, None
        module, _, name = dotted.rpartition(".")
        for _ in range(8):
            if not self.is_tp_module(module):
                raise ExportError(f"cannot resolve {dotted}: {module} is not a torch_patches module")
            b = self.tp_source(module).bindings.get(name)
            if b is None:
                raise ExportError(f"{module} does not define {name}")
            if b.kind != "import":
                return module, name
            assert b.dotted is not None
            if not (b.dotted == TP or b.dotted.startswith(TP + ".")):
                raise ExportError(f"{module}.{name} re-exports {b.dotted}, which is not ours")
            if self.is_tp_module(b.dotted):
                return b.dotted, None
            module, _, name = b.dotted.rpartition(".")
        raise ExportError(f"cannot resolve {dotted}: re-export chain too long")

    # ---------------------------------------------------------------- homes

    def module_home(self, tp_module: str, state: StackState | None = None) -> str | None:
        """The upstream module our module stands for (a mirror) or was moved into."""
        if not self.is_tp_module(tp_module):
            return None
        mirror = self.mirror_of(tp_module)
        if mirror is not None:
            return mirror
        home = (state or self.state).homes.get(tp_module) or self.new_home(tp_module) or self.home_hints.get(tp_module)
        if home is None:
            self.unknown_homes.add(tp_module)
        return home

    def knob_name(self, name: str) -> str | None:
        return knob_upstream_name(name) if name in tp_config.get_config_copy() else None

    def upstream_names(self, text: str, state: StackState) -> str:
        api = self.tp_source(TP + ".hooks").bindings
        return _names.upstream_names(text, lambda m: self.module_home(m, state), self.knob_name, api)
