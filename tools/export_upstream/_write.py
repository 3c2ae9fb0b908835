"""Output of the upstream export: commit messages, patch files, the git stack, overlays."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import textwrap
from collections.abc import Sequence

from tools.export_upstream import _names
from tools.export_upstream._generate import PatchExport, Exporter

#: Fixed author date: the output is deterministic.
DATE = "Thu, 1 Jan 1970 00:00:00 +0000"
AUTHOR = "saved tensors hooks export <torch-patches@users.noreply.github.com>"


# ------------------------------------------------------------------ git helpers


def git(*args: str, cwd: str, env: dict[str, str] | None = None, input: str | None = None) -> str:
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run(
        ["git", *args], cwd=cwd, env=full_env, input=input, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {cwd}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def check_applies(diff: str, files: dict[str, str]) -> str | None:
    """None if ``git apply --check`` accepts ``diff`` on ``files`` (relpath -> text)."""
    with tempfile.TemporaryDirectory(prefix="tp-export-check-") as tmp:
        for rel, text in files.items():
            path = os.path.join(tmp, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        proc = subprocess.run(
            ["git", "apply", "--check", "-"],
            cwd=tmp, input=diff, capture_output=True, text=True, env=_no_repo_env(tmp),
        )
        if proc.returncode != 0:
            return proc.stderr.strip() or f"git apply exited {proc.returncode}"
    return None


def _no_repo_env(path: str) -> dict[str, str]:
    """Environment in which git treats ``path`` as outside any repository."""
    env = dict(os.environ)
    env["GIT_CEILING_DIRECTORIES"] = os.path.dirname(os.path.abspath(path))
    return env


# --------------------------------------------------------------- commit message


def torch_version_of(root: str) -> str:
    try:
        with open(os.path.join(root, "torch", "version.py")) as f:
            m = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)", f.read(), re.M)
        return m.group(1) if m else "unknown"
    except OSError:
        return "unknown"


def find_tests(repo_root: str, e: PatchExport) -> list[str]:
    """Our test files that exercise the patch: the record's ``tests``, else (a record
    without them) the files that mention the names it touches."""
    p = e.patch
    if p.tests:
        return [t for t in p.tests if os.path.exists(os.path.join(repo_root, t))]
    tokens = {p.name, p.target.rpartition(".")[2].rpartition(":")[2], p.replacement.rpartition(":")[2]}
    tokens |= set(e.knobs)
    for added in e.added:
        name = added.rpartition(":")[2]
        if not name.startswith("_") and len(name) > 6:
            tokens.add(name)
    test_dir = os.path.join(repo_root, "test")
    found = []
    if os.path.isdir(test_dir):
        for fn in sorted(os.listdir(test_dir)):
            if not (fn.startswith("test_") and fn.endswith(".py")) or fn == "test_export_upstream.py":
                continue
            with open(os.path.join(test_dir, fn), encoding="utf-8") as f:
                text = f.read()
            if any(re.search(rf"\b{re.escape(t)}\b", text) for t in tokens):
                found.append(f"test/{fn}")
    return found


def _module_doc(exporter: Exporter, patch_replacement: str) -> str:
    module = patch_replacement.partition(":")[0]
    try:
        src = exporter.tp_source(module)
    except Exception:  # noqa: BLE001
        return ""
    import ast

    doc = ast.get_docstring(src.tree) or ""
    return doc.strip()


def commit_message(exporter: Exporter, e: PatchExport, by_name: dict[str, PatchExport], version: str) -> str:
    p = e.patch
    t_module, _, t_qual = p.target.partition(":")
    lines = [_KEEP + p.summary, ""]
    doc = _module_doc(exporter, p.replacement)
    if doc:
        lines += [_KEEP + line for line in doc.splitlines()] + [""]
    how = "wraps" if p.wraps else "replaces"
    lines.append(f"This {how} `{t_qual}` in `{t_module}`.")
    if e.added:
        lines.append("Adds: " + ", ".join(f"`{a}`" for a in e.added) + ".")
    if e.knobs:
        lines.append(
            "Config: " + ", ".join(f"`{v}`" for v in e.knobs.values()) + "."
        )
    lines.append("")
    lines.append(f"Upstream: {p.upstream}")
    lines.append(f"Retire when: {p.retire_when}")
    if p.after:
        lines.append("Builds on: " + "; ".join(
            f"{a} ({by_name[a].patch.summary})" if a in by_name else a for a in p.after
        ))
    for note in e.notes:
        lines.append(f"Note: {note}")
    lines += ["", "Test Plan:"]
    tests = e.tests or []
    if tests:
        lines.append(f"Tests of the exporting project exercising it: python -m pytest {' '.join(tests)}")
    lines.append(
        "Equivalence: python -m pytest test/test_export_upstream.py (this stack, applied to "
        "torch's sources, passes the exporting project's golden-graph tests with none of its "
        "runtime patches applied)"
    )
    body = exporter.upstream_names("\n".join(lines), exporter.state).split("\n")
    issue = f", issue #{p.issue}" if p.issue is not None else ""
    body += ["", f"{_names.PROVENANCE} torch_patches patch `{p.name}`{issue}, against torch {version}"]
    return "\n".join(_wrap(line) for line in body).rstrip() + "\n"


_KEEP = "\0"  # marks lines that are not re-wrapped


def _wrap(line: str) -> str:
    if line.startswith(_KEEP):
        return line[1:]
    if len(line) <= 88 or line.startswith(("    ", "http")):
        return line
    return "\n".join(textwrap.wrap(line, 88, break_long_words=False, break_on_hyphens=False)) or line


def format_patch(e: PatchExport, total: int) -> str:
    subject, _, body = e.message.partition("\n")
    stat = "".join(f" {rel}\n" for rel in e.files)
    return (
        "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
        f"From: {AUTHOR}\n"
        f"Date: {DATE}\n"
        f"Subject: [PATCH {e.number:02d}/{total:02d}] {subject}\n"
        f"{body.rstrip()}\n"
        "---\n"
        f"{stat}\n"
        f"{e.diff}"
        "-- \n"
        "saved tensors hooks export\n"
    )


# ----------------------------------------------------------------------- export


def run_export(torch_root: str, patches: Sequence, repo_root: str | None = None) -> tuple[Exporter, list[PatchExport]]:
    exporter = Exporter(torch_root, repo_root)
    results = exporter.export(patches)
    by_name = {r.patch.name: r for r in results}
    version = torch_version_of(torch_root)
    for r in results:
        r.tests = find_tests(exporter.repo_root, r)
        r.message = commit_message(exporter, r, by_name, version)
    return exporter, results


def knob_map(results: Sequence[PatchExport]) -> dict[str, str]:
    out: dict[str, str] = {}
    for r in results:
        if r.status == "exported":
            out.update(r.knobs)
    return dict(sorted(out.items()))


def write_out(out_dir: str, torch_root: str, results: Sequence[PatchExport]) -> dict:
    """Patch files, summary.json, SUMMARY.md and config-map.json under ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    for fn in os.listdir(out_dir):
        if fn.endswith(".patch") and re.match(r"\d\d-", fn):
            os.remove(os.path.join(out_dir, fn))
    exported = [r for r in results if r.status == "exported"]
    for i, r in enumerate(exported, 1):
        r.number = i
        with open(os.path.join(out_dir, r.filename), "w", encoding="utf-8") as f:
            f.write(format_patch(r, len(exported)))
    summary = {
        "torch_root": os.path.abspath(torch_root),
        "torch_version": torch_version_of(torch_root),
        "patches": [
            {
                "name": r.patch.name,
                "status": r.status,
                "file": r.filename if r.status == "exported" else None,
                "reason": r.reason or None,
                "files": r.files,
                "added": r.added,
                "knobs": r.knobs,
                "notes": r.notes,
                "tests": r.tests,
                "summary": r.patch.summary,
            }
            for r in results
        ],
        "config_map": knob_map(results),
    }
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, sort_keys=True)
        f.write("\n")
    with open(os.path.join(out_dir, "config-map.json"), "w", encoding="utf-8") as f:
        json.dump(summary["config_map"], f, indent=2, sort_keys=True)
        f.write("\n")
    with open(os.path.join(out_dir, "SUMMARY.md"), "w", encoding="utf-8") as f:
        f.write(summary_text(results, torch_version_of(torch_root)))
    return summary


def summary_text(results: Sequence[PatchExport], version: str) -> str:
    lines = [f"# Upstream export against torch {version}", ""]
    for r in results:
        if r.status == "exported":
            lines.append(f"* {r.filename}: {r.patch.summary} ({', '.join(r.files)})")
            for note in r.notes:
                lines.append(f"  * note: {note}")
        else:
            lines.append(f"* {r.patch.name}: skipped: {r.reason}")
    n = sum(r.status == "exported" for r in results)
    lines += ["", f"{n} exported, {len(results) - n} skipped"]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------ stack


def make_stack(stack_dir: str, exporter: Exporter, results: Sequence[PatchExport]) -> list[str]:
    """One commit per exported patch in ``stack_dir`` (a new or existing git repository).

    A new directory (or one that is not a git repository) gets ``git init`` and a base
    commit holding the pristine upstream files the stack touches. An existing repository
    (a pytorch checkout) must have a clean tree; the commits go on top of its HEAD.
    Nothing is pushed. Returns the commit ids, oldest first.
    """
    exported = [r for r in results if r.status == "exported"]
    os.makedirs(stack_dir, exist_ok=True)
    is_repo = os.path.isdir(os.path.join(stack_dir, ".git"))
    if not is_repo:
        git("init", "-q", cwd=stack_dir)
    has_head = subprocess.run(
        ["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=stack_dir, capture_output=True
    ).returncode == 0
    if has_head and git("status", "--porcelain", cwd=stack_dir).strip():
        raise RuntimeError(f"{stack_dir} has uncommitted changes; commit or clean them first")
    touched = sorted({rel for r in exported for rel in r.files})
    missing = [rel for rel in touched if not os.path.exists(os.path.join(stack_dir, rel))]
    if missing:
        if has_head and len(missing) != len(touched):
            raise RuntimeError(f"{stack_dir} lacks {', '.join(missing)}")
        for rel in touched:
            dst = os.path.join(stack_dir, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with open(dst, "w", encoding="utf-8") as f:
                f.write(exporter.base[rel])
        git("add", "--", *touched, cwd=stack_dir)
        git(
            "commit", "-q", "-m",
            f"Base: torch {torch_version_of(exporter.root)} sources the torch_patches stack changes",
            cwd=stack_dir, env=_dates(),
        )
    commits = []
    for r in exported:
        git("apply", "--check", "-", cwd=stack_dir, input=r.diff)
        git("apply", "-", cwd=stack_dir, input=r.diff)
        git("add", "--", *r.files, cwd=stack_dir)
        git("commit", "-q", "-F", "-", cwd=stack_dir, input=r.message, env=_dates())
        commits.append(git("rev-parse", "HEAD", cwd=stack_dir).strip())
    return commits


def _dates() -> dict[str, str]:
    return {"GIT_AUTHOR_DATE": "1970-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "1970-01-01T00:00:00+0000"}


# ---------------------------------------------------------------------- overlay


def make_overlay(dest: str, torch_root: str, files: dict[str, str]) -> str:
    """A ``torch`` package under ``dest`` that is ``torch_root``'s with ``files`` replaced.

    Every directory on the way to a replaced file is a real directory; everything else is
    a symlink into the installed torch (no copy of the shared libraries). ``files``:
    relpath (``torch/...``) -> text. Returns ``dest`` (put it first on PYTHONPATH).
    """
    real_dirs: set[str] = set()
    for rel in files:
        parts = rel.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            real_dirs.add("/".join(parts[:i]))
    for d in sorted(real_dirs, key=lambda x: x.count("/")):
        os.makedirs(os.path.join(dest, d), exist_ok=True)
        src_dir = os.path.join(torch_root, d)
        for entry in sorted(os.listdir(src_dir)):
            rel = f"{d}/{entry}"
            if rel in real_dirs or rel in files or entry == "__pycache__":
                continue
            link = os.path.join(dest, rel)
            if not os.path.lexists(link):
                os.symlink(os.path.join(src_dir, entry), link)
    for rel, text in files.items():
        path = os.path.join(dest, rel)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    # Other top-level packages of the install (functorch, torchgen...) resolve as usual.
    return dest


def apply_to_overlay(dest: str, torch_root: str, results: Sequence[PatchExport]) -> str:
    """Overlay of the pristine touched files, then every diff applied with ``git apply``."""
    exported = [r for r in results if r.status == "exported"]
    touched = sorted({rel for r in exported for rel in r.files})
    pristine = {}
    for rel in touched:
        with open(os.path.join(torch_root, rel), encoding="utf-8") as f:
            pristine[rel] = f.read()
    make_overlay(dest, torch_root, pristine)
    for r in exported:
        for rel in r.files:  # git apply must not follow symlinks out of the overlay
            if os.path.islink(os.path.join(dest, rel)):
                raise RuntimeError(f"{rel} is a symlink in the overlay")
        for args in (["--check"], []):
            proc = subprocess.run(
                ["git", "apply", *args, "-"],
                cwd=dest, input=r.diff, text=True, capture_output=True, env=_no_repo_env(dest),
            )
            if proc.returncode != 0:
                raise RuntimeError(f"git apply {' '.join(args)} {r.filename}: {proc.stderr.strip()}")
    return dest


def copy_tree_texts(results: Sequence[PatchExport]) -> dict[str, str]:
    out: dict[str, str] = {}
    for r in results:
        out.update(r.after)
    return out


__all__ = [
    "apply_to_overlay",
    "check_applies",
    "commit_message",
    "format_patch",
    "knob_map",
    "make_overlay",
    "make_stack",
    "run_export",
    "write_out",
]
