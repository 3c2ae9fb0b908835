"""Where each definition of ours goes upstream, for one patch's job.

:class:`Workspace` holds what one job changes (the upstream files it touches, what it adds,
and what each added definition needs); :class:`Placer` decides where a definition of ours
lives upstream (``place``) and queues the ones the job must emit.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable

from tools.export_upstream._model import (
    CONFIG_HOME,
    CONFIG_MODULE_API,
    TP,
    FileWork,
    StackState,
    knob_upstream_name,
)
from tools.export_upstream._pysrc import ExportError, Source, stmt_binds
from tools.export_upstream._trees import Trees
from torch_patches._registry import find_definition, fingerprint_source

#: ``Workspace.edges``' key for the patch's replacement itself.
ROOT = ("", "")


class Workspace:
    """What one job changes: the upstream files it touches (``work``), the names it adds,
    the knobs, the notes for its commit message, and what each emitted definition needs."""

    def __init__(self, trees: Trees, state: StackState) -> None:
        self.trees, self.state = trees, state
        self.work: dict[str, FileWork] = {}
        self.added: list[str] = []
        self.knobs: dict[str, str] = {}
        self.notes: list[str] = []
        #: What each emitted definition (upstream module, name) needs that this job adds:
        #: definitions, and top-level imports as (module, "import NAME"). ``ROOT`` is the
        #: patch's replacement itself. A new module's commit takes what its definitions reach.
        self.edges: dict[tuple[str, str], set[tuple[str, str]]] = {}
        #: The definition being emitted (whose needs ``need`` records).
        self.ctx: tuple[str, str] = ROOT

    def need(self, key: tuple[str, str]) -> None:
        self.edges.setdefault(self.ctx, set()).add(key)

    def reach(self, roots: Iterable[tuple[str, str]]) -> set[tuple[str, str]]:
        seen: set[tuple[str, str]] = set()
        todo = list(roots)
        while todo:
            key = todo.pop()
            if key not in seen:
                seen.add(key)
                todo.extend(self.edges.get(key, ()))
        return seen

    @property
    def files(self) -> list[str]:
        return [self.trees.upstream_rel(m) for m in self.work]

    def file(self, module: str) -> FileWork:
        if module not in self.work:
            self.work[module] = FileWork(self.trees.upstream_source(self.state, module), module)
            parent = module.rpartition(".")[0]
            if parent in self.trees.new_modules and not self.state.texts.get(self.trees.new_modules[parent]):
                self.file(parent)  # a new package is created with its first module
        return self.work[module]

    def fresh(self, module: str, base: str) -> str:
        fw = self.file(module)
        name = base
        i = 2
        while fw.binds(name):
            name = f"{base}{i}"
            i += 1
        fw.bound.add(name)
        return name


class Placer:
    """Where (upstream module, name) each definition of ours lives (``place``), and the
    queue of those the job emits; ``requester`` is the upstream module whose code is being
    written (a module of ours without an upstream counterpart moves next to it)."""

    def __init__(self, ws: Workspace, requester: str) -> None:
        self.ws, self.trees, self.state = ws, ws.trees, ws.state
        self.requester = requester
        self.queue: list[tuple[str, str]] = []

    def place(self, tp_module: str, name: str) -> tuple[str, str]:
        """Where (upstream module, name) our definition ``tp_module.name`` lives; queue it."""
        key = (tp_module, name)
        if key in self.state.placed:
            self.ws.need(self.state.placed[key])
            return self.state.placed[key]
        src = self.trees.tp_source(tp_module)
        b = src.bindings.get(name)
        if b is None and name in CONFIG_MODULE_API and self.trees.is_config_module(tp_module):
            # The config-module API (a snapshot of every knob...): upstream's config module
            # has the same methods, over a superset of our knobs.
            self.state.placed[key] = (CONFIG_HOME, name)
            return self.state.placed[key]
        if b is None:
            raise ExportError(f"{tp_module} has no top-level definition {name!r}")
        if b.kind == "import":
            assert b.dotted is not None
            if b.dotted.startswith(TP + ".") or b.dotted == TP:
                mod, nm = self.trees.resolve_tp(b.dotted)
                if nm is None:
                    raise ExportError(f"{tp_module}.{name} is a module; use it by its own name")
                loc = self.place(mod, nm)
                self.state.placed[key] = loc
                return loc
            raise ExportError(f"{tp_module}.{name} is imported there from {b.dotted}; import it from where it is defined")
        dest = self.dest_module(tp_module)
        is_knob = self.trees.is_config_module(tp_module)
        final = knob_upstream_name(name) if is_knob else name
        up = self.trees.upstream_source(self.state, dest)
        existing = up.bindings.get(final)
        if existing is not None and not existing.type_checking and not is_knob:
            if existing.kind != "import" and _same_definition(src, b.stmt, up, existing.stmt):
                for n in stmt_binds(b.stmt):
                    self.state.placed[(tp_module, n)] = (dest, n)
                return self.state.placed[key]
            final = self.ws.fresh(dest, f"_{name.lstrip('_')}_saved_tensors_hooks")
            self.ws.notes.append(f"{dest} already defines {name} differently; ours is added as {final}")
        elif existing is not None and is_knob:
            raise ExportError(f"{dest} already has a knob {final}")
        names = stmt_binds(b.stmt)
        if len(names) > 1 and final != name:
            raise ExportError(f"{tp_module}.{name} is bound with other names and collides upstream")
        for n in names:
            self.state.placed[(tp_module, n)] = (dest, final if n == name else n)
        self.ws.need((dest, final))
        self.queue.append((tp_module, name))
        if is_knob:
            self.ws.knobs[name] = f"{dest}.{final}"
        if (
            dest in self.trees.new_modules
            and self.trees.new_module_sources.get(dest) == tp_module
            and not self.state.texts.get(self.trees.new_modules[dest])
        ):
            # A new module comes whole, as ours is (its own tests use all of it), in the
            # commit that creates it; a satellite of ours moved into it brings only what
            # is used.
            for other, b in sorted(src.bindings.items(), key=lambda kv: kv[1].index):
                if b.kind != "import" and not b.type_checking and (tp_module, other) not in self.state.placed:
                    self.place(tp_module, other)
        return dest, final

    def dest_module(self, tp_module: str) -> str:
        mirror = self.trees.mirror_of(tp_module)
        if mirror is not None:
            return mirror
        home = self.trees.new_home(tp_module)
        if home is not None:
            self.state.homes[tp_module] = home
            return home
        # Ours only (no upstream counterpart): moved next to the code that needs it first.
        return self.state.homes.setdefault(tp_module, self.requester)


def _same_definition(a_src: Source, a: ast.stmt, b_src: Source, b: ast.stmt) -> bool:
    """Same code, ignoring comments, docstrings, annotations and formatting."""
    try:
        if isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            sa = find_definition(a_src.text, a.name, a_src.tree)  # type: ignore[union-attr]
            sb = find_definition(b_src.text, b.name, b_src.tree)  # type: ignore[union-attr]
            return fingerprint_source(sa) == fingerprint_source(sb)
    except Exception:  # noqa: BLE001
        return False
    return ast.dump(a) == ast.dump(b) if type(a) is type(b) else False
