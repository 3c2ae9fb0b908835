"""Fingerprints of upstream definitions: a hash of a function's (or class's) source with
comments, docstrings, annotations and formatting stripped, and the recorded ones
(``fingerprints.json``, per patch and torch release).  A recorded fingerprint means "this
patch was checked against this upstream code" (CONTRIBUTING.md, "Writing a patch")."""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import json
import os
import textwrap
from collections.abc import Iterable, Mapping
from typing import Any


class _Normalize(ast.NodeTransformer):
    """Drop what cannot change behaviour: docstrings and type annotations."""

    def _strip_docstring(self, node: Any) -> None:
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]

    def visit_FunctionDef(self, node: Any) -> Any:
        self._strip_docstring(node)
        node.returns = None
        return self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> Any:
        self._strip_docstring(node)
        return self.generic_visit(node)

    def visit_arg(self, node: ast.arg) -> Any:
        node.annotation = None
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> Any:
        if node.value is None:
            return None
        return ast.Assign(targets=[node.target], value=self.visit(node.value))


def _canon(node: Any) -> str:
    """A serialisation of an AST that is stable across Python versions.

    Fields that are empty or None are skipped, so fields newer Pythons add with empty
    defaults (``type_params``...) do not change the result.
    """
    if isinstance(node, ast.AST):
        parts = []
        for field in node._fields:
            if field == "type_comment":
                continue
            value = getattr(node, field, None)
            if value is None or value == []:
                continue
            parts.append(f"{field}={_canon(value)}")
        return f"{type(node).__name__}({','.join(parts)})"
    if isinstance(node, list):
        return "[" + ",".join(_canon(v) for v in node) + "]"
    return f"{type(node).__name__}:{node!r}"


def _def_node(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return node
    raise ValueError("no function or class definition in source")


def fingerprint_source(source: str) -> str:
    """Fingerprint of the first function/class definition in ``source``.

    Comments, docstrings, type annotations and formatting do not count; everything
    else in the definition (its body, defaults, decorators) does.
    """
    node = _Normalize().visit(_def_node(ast.parse(textwrap.dedent(source))))
    return hashlib.sha256(_canon(node).encode()).hexdigest()[:16]


def find_definition(module_source: str, qualname: str, tree: ast.Module | None = None) -> str:
    """Source text of ``qualname`` (``Class.method`` or ``function``) in a module (``tree``:
    the module's source already parsed, for a caller that looks up several names in it)."""
    tree = ast.parse(module_source) if tree is None else tree
    body: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for part in qualname.split("."):
        node = next(
            (n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part),
            None,
        )
        if node is None:
            raise LookupError(f"{qualname} not defined at top level of the module")
        body = node.body
    lines = module_source.splitlines(keepends=True)
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])  # type: ignore[union-attr]
    return "".join(lines[start - 1 : node.end_lineno])  # type: ignore[union-attr]


def combine_fingerprints(parts: Iterable[str]) -> str:
    parts = list(parts)
    if len(parts) == 1:
        return parts[0]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _function_of(raw: Any) -> Any:
    if isinstance(raw, (staticmethod, classmethod)):
        return raw.__func__
    if isinstance(raw, property):
        return raw.fget
    return raw


#: Fingerprints of live definitions, by definition site and code object: apply() checks the
#: same originals at every call (a process may apply and unapply many times), and reading and
#: parsing their source again each time cost most of an apply.
_DEFINITION_FINGERPRINTS: dict[tuple[str, Any], str] = {}


def _definition_fingerprint(fn: Any) -> str:
    code = getattr(inspect.unwrap(fn), "__code__", None)  # getsource reads the unwrapped function
    if code is None:  # a class: no code object to key on
        return fingerprint_source(inspect.getsource(fn))
    key = (code.co_filename, code)  # a new definition (or a reassigned __code__) is a new key
    if key not in _DEFINITION_FINGERPRINTS:
        _DEFINITION_FINGERPRINTS[key] = fingerprint_source(inspect.getsource(fn))
    return _DEFINITION_FINGERPRINTS[key]


#: The recorded fingerprints: patch name -> torch release -> fingerprint.
FINGERPRINTS_FILE = os.path.join(os.path.dirname(__file__), "fingerprints.json")


@functools.lru_cache(maxsize=1)
def _recorded() -> dict[str, dict[str, str]]:
    with open(FINGERPRINTS_FILE) as f:
        return json.load(f)


def recorded(name: str) -> Mapping[str, str]:
    """The fingerprints recorded for the patch ``name`` (torch release -> fingerprint)."""
    return dict(_recorded().get(name, {}))
