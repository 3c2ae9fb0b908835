"""Output of the upstream export: commit messages, patch files, the git stack, overlays."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import textwrap
from collections.abc import Sequence
from typing import Any

from tools.export_upstream import _names, _tests
from tools.export_upstream._commit_imports import ImportChecker
from tools.export_upstream._generate import Exporter, split_new_modules
from tools.export_upstream._git import git, no_repo_env, unified_diff
from tools.export_upstream._model import API_COMMIT, TP, PatchExport, rel_module

#: Our public package, whose upstream home gets its API in the last commit.
HOOKS_PACKAGE_OURS = TP + ".hooks"

#: Fixed author date: the output is deterministic.
DATE = "Thu, 1 Jan 1970 00:00:00 +0000"
AUTHOR = "saved tensors hooks export <torch-patches@users.noreply.github.com>"


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


def _module_doc(exporter: Exporter, patch_replacement: str, own: bool = False) -> str:
    """The docstring of ``patch_replacement``'s module (``own``: of the definition itself)."""
    module, _, name = patch_replacement.partition(":")
    try:
        src = exporter.trees.tp_source(module)
    except Exception:  # noqa: BLE001
        return ""
    node = src.bindings[name].stmt if own and name in src.bindings else src.tree
    doc = ast.get_docstring(node) or ""  # type: ignore[arg-type]
    return doc.strip()


def _opening(exporter: Exporter, p: Any) -> list[str]:
    """A commit message's title (the record's summary) and the replacement module's
    docstring (an effect's: its upstream form's)."""
    lines = [_KEEP + p.summary, ""]
    doc = _module_doc(exporter, p.replacement, own=p.name in exporter.effects)
    if doc:
        lines += [_KEEP + line for line in doc.splitlines()] + [""]
    return lines


def commit_message(exporter: Exporter, e: PatchExport, by_name: dict[str, PatchExport], version: str) -> str:
    p = e.patch
    if p.name == API_COMMIT:
        return api_message(exporter, e, version)
    if p.name in exporter.effects:
        return effect_message(exporter, e, by_name, version)
    t_module, _, t_qual = p.target.partition(":")
    lines = _opening(exporter, p)
    how = "wraps" if p.wraps else "replaces"
    lines.append(f"This {how} `{t_qual}` in `{t_module}`.")
    if e.added:
        lines.append("Adds: " + ", ".join(f"`{a}`" for a in e.added) + ".")
    if e.knobs:
        lines.append("Config: " + ", ".join(f"`{v}`" for v in e.knobs.values()) + ".")
    lines.append("")
    lines.append(f"Upstream: {p.upstream}")
    lines.append(f"Retire when: {p.retire_when}")
    if p.after:
        lines.append("Builds on: " + "; ".join(f"{a} ({by_name[a].patch.summary})" if a in by_name else a for a in p.after))
    for note in e.notes:
        lines.append(f"Note: {note}")
    equivalence = (
        "Equivalence: python -m pytest test/test_export_upstream.py (this stack, applied to "
        "torch's sources, passes the exporting project's golden-graph tests with none of its "
        "runtime patches applied)"
    )
    issue = f", issue #{p.issue}" if p.issue is not None else ""
    return _finish(exporter, e, lines, equivalence, f"patch `{p.name}`{issue}, against torch {version}")


def api_message(exporter: Exporter, e: PatchExport, version: str) -> str:
    home = e.patch.target.partition(":")[0]
    lines = _opening(exporter, e.patch)
    lines.append(
        f"`{home}` re-exports what the commits before this one added, from where they "
        "live: the hook-pair markers, the ready-made pairs and `SavedTensorInfo`."
    )
    if e.added:
        lines.append("Adds: " + ", ".join(f"`{a}`" for a in e.added) + ".")
    check = "Every name of the package imports (test_each_commit_imports_alone imports it after this commit)."
    return _finish(exporter, e, lines, check, f"the public package `{e.patch.replacement.partition(':')[0]}`, against torch {version}")


def effect_message(exporter: Exporter, e: PatchExport, by_name: dict[str, PatchExport], version: str) -> str:
    """The message of a registry effect's upstream commit: code run at a module's import."""
    p = e.patch
    lines = _opening(exporter, p)
    lines.append(f"This runs when `{p.target.partition(':')[0]}` is imported.")
    if e.added:
        lines.append("Adds: " + ", ".join(f"`{a}`" for a in e.added) + ".")
    if p.after:
        lines += ["", "Builds on: " + "; ".join(f"{by_name[a].patch.summary}" for a in p.after if a in by_name)]
    check = "The stack imports with it (test_each_commit_imports_alone)."
    return _finish(exporter, e, lines, check, f"registry effect `{p.name}`, against torch {version}")


def _finish(exporter: Exporter, e: PatchExport, lines: list[str], check: str, provenance: str) -> str:
    """A commit message from its ``lines``: the Test Plan (the upstream test files it carries,
    our tests, ``check``), upstream's names, the ``Exported-from:`` trailer (``provenance``),
    wrapped."""
    lines = [*lines, "", "Test Plan:", *(f"python {t}" for t in e.upstream_tests)]
    if e.tests:
        lines.append(f"Tests of the exporting project exercising it: python -m pytest {' '.join(e.tests)}")
    lines.append(check)
    body = exporter.trees.upstream_names("\n".join(lines), exporter.trees.state).split("\n")
    body += ["", _KEEP + f"{_names.PROVENANCE} torch_patches {provenance}"]
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


def run_export(
    torch_root: str, patches: Sequence, repo_root: str | None = None, effects: Sequence = ()
) -> tuple[Exporter, list[PatchExport]]:
    exporter = Exporter(torch_root, repo_root)
    results = exporter.export(patches, effects)
    exported = [r.patch.name for r in results if r.status == "exported"]
    if exported:
        results.append(exporter.export_api(HOOKS_PACKAGE_OURS, after=exported[-1:]))
    results = split_new_modules(exporter, results)
    by_name = {r.patch.name: r for r in results if r.module is None}
    version = torch_version_of(torch_root)
    resolver = test_resolver(exporter)
    helpers_added: set[str] = set()
    for r in results:
        r.tests = find_tests(exporter.trees.repo_root, r)
        carried = _tests.tests_for(r.name, exporter.trees.repo_root, resolver, helpers_added)
        for rel, text in sorted(carried.items()):
            r.diff += unified_diff(rel, "", text)
            r.files.append(rel)
            r.before[rel], r.after[rel] = "", text
        r.upstream_tests = sorted(rel for rel in carried if rel.startswith("test/") and os.path.basename(rel).startswith("test_"))
        if r.module is None:
            r.message = commit_message(exporter, r, by_name, version)
        else:
            r.message = new_module_message(exporter, r, by_name[r.patch.name], version)
    return exporter, results


def test_resolver(exporter: Exporter) -> _tests.Resolver:
    """Where the stack put each name of ours, for turning our tests into upstream's."""
    trees = exporter.trees

    def binding(module: str, name: str) -> str | None:
        b = trees.tp_source(module).bindings.get(name)
        return b.dotted if b is not None and b.kind == "import" else None

    def names(text: str) -> str:
        home = _tests.helper_home("torch_patches.testing._internal.common_saved_tensors_hooks")
        text = re.sub(r"\btorch_patches\.testing\b(?!\._internal)", home, text)
        return trees.upstream_names(text, trees.state)

    def module_home(module: str) -> str | None:
        """Where our module went, if the stack exports it (a mirror, a new module, or the
        upstream module a satellite was moved into)."""
        if not trees.is_tp_module(module):
            return None
        mirror = trees.mirror_of(module)
        if mirror is not None:
            return mirror
        for home, ours in trees.new_module_sources.items():
            if ours == module and trees.state.texts.get(trees.new_modules[home]):
                return home
        return trees.state.homes.get(module)

    return _tests.Resolver(
        place=lambda module, name: trees.state.placed.get((module, name)),
        module_home=module_home,
        knob=trees.knob_name,
        binding=binding,
        names=names,
    )


#: Upstream's title tag for a commit adding a module under each tree.
_AREA = (("torch/_dynamo/", "[dynamo]"), ("torch/_inductor/", "[inductor]"), ("torch/_functorch/", "[aotd]"), ("torch/", "[utils]"))


def new_module_message(exporter: Exporter, e: PatchExport, user: PatchExport, version: str) -> str:
    """The message of a commit adding one new module (``split_new_modules``)."""
    rel = next(f for f in e.files if f.startswith("torch/"))
    area = next(tag for prefix, tag in _AREA if rel.startswith(prefix))
    doc = _module_doc(exporter, f"{e.source}:")
    first = doc.split("\n\n", 1)[0].replace("\n", " ").strip().rstrip(".") if doc else e.module
    subject = f"{area} Add {e.module.rpartition('.')[2]}: {first[:1].lower()}{first[1:]}"
    if len(subject) > 100:
        subject = subject[:100].rsplit(" ", 1)[0] + "..."
    lines = [_KEEP + subject, ""]
    if doc:
        lines += [_KEEP + line for line in doc.splitlines()] + [""]
    lines.append(f'New module `{rel}`, used from the commit "{user.patch.summary}" on.')
    own = [a.partition(":")[2] for a in e.added if a.partition(":")[0] == e.module]
    if own:
        lines.append("Defines: " + ", ".join(f"`{a}`" for a in own) + ".")
    elsewhere = [a.replace(":", ".") for a in e.added if a.partition(":")[0] != e.module]
    if elsewhere:
        lines.append("With what it uses of that commit's additions to upstream's modules: " + ", ".join(f"`{a}`" for a in elsewhere) + ".")
    check = f"Imports alone: python -c 'import {e.module}' (nothing uses it before that commit)"
    return _finish(exporter, e, lines, check, f"module `{e.source}` for patch `{e.patch.name}`, against torch {version}")


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
                "name": r.name,
                "patch": r.patch.name,
                "subject": r.subject if r.status == "exported" else None,
                "changed_lines": r.changed_lines(),
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


#: The size a reviewer takes in one commit (changed lines of library code).
REVIEWABLE_LINES = 500


#: Why a commit is bigger than :data:`REVIEWABLE_LINES` (said in ``SUMMARY.md``).
LARGE_REASONS = {
    "add-loss_region_ops": (
        "the rules for every op a loss region may hold and the walk that applies them are one "
        "matcher: each rule moves where the tokens are through its op and writes the chunk's "
        "op, and a rule left out rejects every region that holds its op (the losses users "
        "train with hold most of them: casts, log-sum-exp, gathers, views, the losses)"
    ),
    "add-solver": (
        "the solver's data types (options, spans, choices, the plan with its timeline and the "
        "points it bounds) and the greedy that fits them are one unit: the greedy's constraints "
        "are the plan's timeline, so neither half can be checked without the other"
    ),
    "add-hook_walk": (
        "the walk is one recursive dispatch over every kind of value a hook reaches (code, "
        "functions, modules, classes, instances, containers, tensors, GraphModules), each case "
        "keying what it reads and recording how to re-check it in the walker's shared state: a "
        "case left out makes the hooks that reach that kind unkeyable, not a smaller walk"
    ),
    "add-graph_surgery": (
        "the pack insertion, the unpack insertion and the rewiring of the saved outputs are one "
        "rewrite of the graph pair: any one alone leaves graphs that do not run"
    ),
    "add-inline_phases": (
        "the driver of the inliner's phases over the saved-tensor records (collect, decide, "
        "trace, rewrite, donate), with the knobs and the dtype policy they read: every hook "
        "traced before either graph is touched is one step with the rewrite it feeds, so half "
        "of it is not a smaller inliner but one that leaves graphs half rewritten"
    ),
    "add-saved_tensor_records": (
        "the record every phase fills in, with what reads it (the observers, the log line, the "
        "module and forward-span facts, the copy kept on the runtime metadata for cache hits): "
        "a record without its readers cannot be checked, and a reader without the record has "
        "nothing to read"
    ),
    "add-_offload": (
        "the offload ops (offload, reload_start, reload_wait, with their fake kernels) and the "
        "bookkeeping of the copies in flight they share (tickets, events, the blocks a finished "
        "copy gives back) are one protocol: an op without the others leaves a copy nobody waits "
        "for, and the hooks are those ops' eager form"
    ),
}


def summary_text(results: Sequence[PatchExport], version: str) -> str:
    """``SUMMARY.md``: what a reviewer reads first, one entry per commit."""
    exported = [r for r in results if r.status == "exported"]
    lines = [
        f"# Upstream export against torch {version}",
        "",
        f"{len(exported)} commits. New modules are commits of their own, before the commit that "
        "first uses them, each with what it reads of that commit's additions to upstream's files "
        "(knobs, helpers). The patch set's global effects are code run at an upstream module's "
        "import: "
        + ", ".join(f"{r.number:02d}" for r in exported if r.patch.target.endswith(":<import>"))
        + f". Proposed homes: the hooks library at `{_names.HOOKS_HOME}`, "
        f"knobs under `torch._functorch.config` (`config-map.json`), log artifact "
        f"`{_names.ARTIFACT}`.",
        "",
        f"Tests: {sum(len(r.upstream_tests) for r in exported)} upstream test files (ours, converted: "
        "`tools/export_upstream/_tests.py`), carried by "
        + ", ".join(f"{r.number:02d}" for r in exported if r.upstream_tests)
        + ", each commit's run right after it on an overlay of torch with only the commits "
        "before it applied (`python -m pytest test/test_export_upstream.py -m upstream_stack`); "
        "test helpers under "
        "`torch/testing/_internal/` come with the first commit that needs them. Changed lines "
        "count library code only.",
        "",
        "| # | commit | files | changed lines |",
        "|---|---|---|---|",
    ]
    for r in exported:
        size = r.changed_lines()
        flag = f"**{size}** (over {REVIEWABLE_LINES})" if size > REVIEWABLE_LINES else str(size)
        lines.append(f"| {r.number:02d} | {r.subject} | {', '.join(f'`{f}`' for f in r.files)} | {flag} |")
    lines.append("")
    for r in exported:
        lines.append(f"## {r.number:02d} {r.subject}")
        lines.append("")
        body = r.message.split("\n\n", 1)[1] if "\n\n" in r.message else ""
        motivation = body.split("\n\n", 1)[0].strip()
        if motivation:
            lines += [motivation, ""]
        size = r.changed_lines()
        if size > REVIEWABLE_LINES:
            reason = LARGE_REASONS.get(r.name, "no reason recorded: split it")
            lines.append(f"Size: {size} changed lines, over {REVIEWABLE_LINES}: {reason}.")
        if r.module is not None:
            user = next(u for u in exported if u.module is None and u.patch.name == r.patch.name)
            lines.append(f"Effect and risk: none on its own; nothing imports it before {user.number:02d}.")
        else:
            lines.append(f"Effect: {r.patch.measured or 'not measured'}.")
            lines.append(f"Risk: {r.patch.risk or 'not assessed'}.")
        if r.upstream_tests:
            lines.append("Upstream tests (run right after this commit): " + ", ".join(f"`{t}`" for t in r.upstream_tests))
            for t in _tests.UPSTREAM_TESTS.get(r.name, ()):
                for test, why in t.leave_out:
                    lines.append(f"Left out of `{t.theirs}`: `{test}`: {why}.")
        if r.tests:
            lines.append("Tests of the exporting project: " + ", ".join(f"`{t}`" for t in r.tests))
        for note in r.notes:
            lines.append(f"Note: {note}")
        lines.append("")
    for r in results:
        if r.status != "exported":
            lines.append(f"* {r.name}: skipped: {r.reason}")
    return "\n".join(lines).rstrip() + "\n"


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
    has_head = subprocess.run(["git", "rev-parse", "--verify", "-q", "HEAD"], cwd=stack_dir, capture_output=True).returncode == 0
    if has_head and git("status", "--porcelain", cwd=stack_dir).strip():
        raise RuntimeError(f"{stack_dir} has uncommitted changes; commit or clean them first")
    touched = sorted({rel for r in exported for rel in r.files if exporter.trees.base.get(rel)})
    missing = [rel for rel in touched if not os.path.exists(os.path.join(stack_dir, rel))]
    if missing:
        if has_head and len(missing) != len(touched):
            raise RuntimeError(f"{stack_dir} lacks {', '.join(missing)}")
        for rel in touched:
            dst = os.path.join(stack_dir, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with open(dst, "w", encoding="utf-8") as f:
                f.write(exporter.trees.base[rel])
        git("add", "--", *touched, cwd=stack_dir)
        git(
            "commit",
            "-q",
            "-m",
            f"Base: torch {torch_version_of(exporter.trees.root)} sources the torch_patches stack changes",
            cwd=stack_dir,
            env=_dates(),
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


def make_overlay(dest: str, torch_root: str, files: dict[str, str], new_files: Sequence[str] = ()) -> str:
    """A ``torch`` package under ``dest`` that is ``torch_root``'s with ``files`` replaced.

    Every directory on the way to a replaced file, or to one of ``new_files`` (created
    later, by a diff), is a real directory; everything else is a symlink into the installed
    torch (no copy of the shared libraries). ``files``: relpath (``torch/...``) -> text.
    Returns ``dest`` (put it first on PYTHONPATH).
    """
    real_dirs: set[str] = set()
    for rel in [*files, *new_files]:
        parts = rel.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            real_dirs.add("/".join(parts[:i]))
    for d in sorted(real_dirs, key=lambda x: x.count("/")):
        os.makedirs(os.path.join(dest, d), exist_ok=True)
        src_dir = os.path.join(torch_root, d)
        for entry in sorted(os.listdir(src_dir)) if os.path.isdir(src_dir) else ():
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


def pristine_overlay(dest: str, torch_root: str, exported: Sequence[PatchExport]) -> None:
    """An overlay of ``torch_root`` with the files the stack touches as they are there (the
    directories of the files it creates real, for the diffs to create them in)."""
    touched = sorted({rel for r in exported for rel in r.files})
    pristine = {}
    for rel in touched:
        if os.path.exists(os.path.join(torch_root, rel)):
            with open(os.path.join(torch_root, rel), encoding="utf-8") as f:
                pristine[rel] = f.read()
    make_overlay(dest, torch_root, pristine, [rel for rel in touched if rel not in pristine])


def apply_to_overlay(dest: str, torch_root: str, results: Sequence[PatchExport]) -> str:
    """Overlay of the pristine touched files, then every diff applied with ``git apply``."""
    exported = [r for r in results if r.status == "exported"]
    pristine_overlay(dest, torch_root, exported)
    for r in exported:
        for rel in r.files:  # git apply must not follow symlinks out of the overlay
            if os.path.islink(os.path.join(dest, rel)):
                raise RuntimeError(f"{rel} is a symlink in the overlay")
        for args in (["--check"], []):
            proc = subprocess.run(
                ["git", "apply", *args, "-"],
                cwd=dest,
                input=r.diff,
                text=True,
                capture_output=True,
                env=no_repo_env(dest),
            )
            if proc.returncode != 0:
                raise RuntimeError(f"git apply {' '.join(args)} {r.filename}: {proc.stderr.strip()}")
    return dest


def import_each_commit(
    results: Sequence[PatchExport],
    torch_root: str,
    workdir: str,
    python: str,
    start: int = 0,
    stop: int | None = None,
    tests: bool = True,
) -> list[str]:
    """Apply the stack to an overlay of ``torch_root`` one commit at a time and, after each
    of the commits ``[start, stop)`` (0-based; the ones before are only applied), import
    every module the commit touched as a fresh interpreter would (after torch and
    torch._dynamo; :class:`ImportChecker`), then (``tests``) run the upstream test files it
    carries: a commit that needs a later one to import or to pass its tests is named.
    Returns the failures (empty: each commit builds and passes on its own)."""
    exported = [r for r in results if r.status == "exported"]
    dest = os.path.join(workdir, "site")
    pristine_overlay(dest, torch_root, exported)
    failures = []
    env = dict(os.environ)
    env["PYTHONPATH"] = dest
    with ImportChecker(python, workdir, env) as imports:
        for i, r in enumerate(exported[: len(exported) if stop is None else stop]):
            imports.before_commit(r.files, dest)
            proc = subprocess.run(["git", "apply", "-"], cwd=dest, input=r.diff, text=True, capture_output=True, env=no_repo_env(dest))
            if proc.returncode != 0:
                failures.append(f"{r.filename}: git apply: {proc.stderr.strip()}")
                break
            if i >= start:
                failures += _check_commit(r, imports, python, dest, env, tests)
    return failures


def _check_commit(r: PatchExport, imports: ImportChecker, python: str, dest: str, env: dict[str, str], tests: bool) -> list[str]:
    failures = []
    modules = [rel_module(rel) for rel in r.files if rel.startswith("torch/")]
    # After torch._dynamo, as torch.compile imports it (some of torch's own modules do not
    # import alone, e.g. runtime_wrappers).
    error = imports.check(modules)
    if error is not None:
        failures.append(f"{r.filename}: importing {', '.join(modules)}: {error}")
    if tests and r.upstream_tests:  # its own tests, every later commit still absent
        proc = subprocess.run(
            [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *r.upstream_tests],
            cwd=dest,
            env=env,
            text=True,
            capture_output=True,
        )
        if proc.returncode != 0:
            failures.append(f"{r.filename}: its tests: {proc.stdout.strip()[-2000:]}")
    return failures


def copy_tree_texts(results: Sequence[PatchExport]) -> dict[str, str]:
    out: dict[str, str] = {}
    for r in results:
        out.update(r.after)
    return out


__all__ = [
    "apply_to_overlay",
    "import_each_commit",
    "commit_message",
    "format_patch",
    "knob_map",
    "make_overlay",
    "make_stack",
    "run_export",
    "write_out",
]
