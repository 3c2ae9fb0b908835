"""Rendering one upstream file from its pending changes (:class:`~tools.export_upstream._model.FileWork`):
the replaced definition, the helpers, the knobs, the imports, and what runs at its import.
"""

from __future__ import annotations

import ast
import dataclasses
from typing import Any

from tools.export_upstream._model import CONFIG_MARK, FileWork
from tools.export_upstream._pysrc import ExportError, Source, import_bindings


def render_file(fw: FileWork) -> str:
    """The text of ``fw``'s upstream file with its pending changes made."""
    lines = list(fw.src.lines)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    inserts: list[tuple[int, int, list[str]]] = []  # (line index, priority, lines)
    if fw.replace is not None:
        first, last, text = fw.replace
        lines[first - 1 : last] = [text if text.endswith("\n") else text + "\n"] + [""] * (last - first)
    if fw.helpers:
        block = "\n\n".join(t.rstrip("\n") + "\n" for _, t in sorted(fw.helpers))
        if fw.before_line is not None:
            inserts.append((fw.before_line - 1, 1, [block, "\n\n"]))
        else:
            inserts.append((len(lines), 1, ["\n\n", block]))
    if fw.tail:  # after the helpers (inserts at one line go in reverse priority)
        inserts.append((len(lines), 0, ["\n" if fw.helpers else "", *("\n" + t for t in fw.tail)]))
    if fw.knobs:
        at = _knob_anchor(fw.src)
        block = "".join("\n" + t.rstrip("\n") + "\n" for _, t in sorted(fw.knobs))
        inserts.append((at, 0, [block.lstrip("\n") + "\n"]))
    if fw.imports:
        groups: dict[int, list[tuple[str, str]]] = {}
        for n, d in sorted(fw.imports.items(), key=import_key):
            groups.setdefault(_import_anchor(fw.src, d), []).append((n, d))
        for at, pairs in groups.items():
            chunk = import_lines(pairs)
            if at == _future_line(fw.src) and not fw.src.text.strip().endswith("annotations"):
                chunk.append("\n")  # a new module's first imports, then its code
            elif at == _future_line(fw.src):
                chunk.insert(0, "\n")
            inserts.append((at, 2, chunk))
    for at, _, chunk in sorted(inserts, key=lambda x: (-x[0], x[1])):
        lines[at:at] = chunk
    return "".join(lines)


def stage_file(fw: FileWork, allowed: set[tuple[str, str]]) -> str:
    """``fw``'s existing upstream file with only the additions whose keys are in ``allowed``
    (no replacement, nothing run at import): what a new module's ``Add`` commit changes in it."""

    def pick(entries: list[Any], keys: list[tuple[str, str]]) -> list[Any]:
        return [e for e, k in zip(entries, keys) if k in allowed]

    return render_file(
        dataclasses.replace(
            fw,
            replace=None,
            tail=[],
            helpers=pick(fw.helpers, fw.helper_keys),
            knobs=pick(fw.knobs, fw.knob_keys),
            imports={n: d for n, d in fw.imports.items() if (fw.module, "import " + n) in allowed},
        )
    )


def _import_anchor(src: Source, dotted: str) -> int:
    """Line index after the prologue import a new import of ``dotted`` belongs after.

    Imports of torch go after the last torch import, others after the last non-torch
    import (the standard library block), else after the last import.
    """
    group = dotted.split(".")[0] == "torch"
    last = last_same = future = 0
    for node in src.tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            break
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            future = node.end_lineno  # type: ignore[assignment]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            last = node.end_lineno  # type: ignore[assignment]
            first = next(import_bindings(node, src.package), ("", ""))[1]
            relative = isinstance(node, ast.ImportFrom) and node.level > 0
            if (first.split(".")[0] == "torch" or relative) == group:
                last_same = node.end_lineno  # type: ignore[assignment]
    if last == 0 and future:  # a new module: its imports follow the __future__ import
        return future
    if last == 0:
        raise ExportError(f"{src.module} has no import block to extend")
    return last_same or last


def _future_line(src: Source) -> int | None:
    first = next((n for n in src.tree.body if isinstance(n, ast.ImportFrom) and n.module == "__future__"), None)
    return None if first is None else first.end_lineno


def _knob_anchor(src: Source) -> int:
    """Line index before the config module's closing (TYPE_CHECKING / install call)."""
    body = src.tree.body
    idx = next(
        (i for i, n in enumerate(body) if CONFIG_MARK in (src.segment(n) or "")),
        None,
    )
    if idx is None:
        raise ExportError(f"{src.module} is not a config module ({CONFIG_MARK} not found)")
    while idx > 0 and (
        isinstance(body[idx - 1], (ast.Import, ast.ImportFrom))
        or (isinstance(body[idx - 1], ast.If) and "TYPE_CHECKING" in ast.dump(body[idx - 1].test))
    ):
        idx -= 1
    return src.stmt_lines(body[idx])[0] - 1


def import_line(name: str, dotted: str) -> str:
    if "." not in dotted:
        return f"import {dotted}\n" if name == dotted else f"import {dotted} as {name}\n"
    pkg, _, last = dotted.rpartition(".")
    return f"from {pkg} import {last}\n" if name == last else f"from {pkg} import {last} as {name}\n"


def import_lines(pairs: list[tuple[str, str]]) -> list[str]:
    """Import statements binding each (name, dotted): one ``from`` statement per module."""
    out: list[str] = []
    by_module: dict[str, list[str]] = {}
    for name, dotted in pairs:
        if "." not in dotted:
            out.append(import_line(name, dotted))
            continue
        pkg, _, last = dotted.rpartition(".")
        by_module.setdefault(pkg, []).append(last if name == last else f"{last} as {name}")
    for pkg, names in by_module.items():
        one = f"from {pkg} import {', '.join(names)}\n"
        out.append(one if len(one) <= 89 else f"from {pkg} import (\n" + "".join(f"    {n},\n" for n in names) + ")\n")
    return out


def import_key(item: tuple[str, str]) -> tuple[int, str]:
    line = import_line(*item)
    return (0 if line.startswith("import ") else 1, line)
