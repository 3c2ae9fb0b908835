"""git for the upstream export: running it, its diff format, and whether a diff applies.

A leaf: it knows nothing of patches, only of files and diffs.
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import tempfile


def git(*args: str, cwd: str, env: dict[str, str] | None = None, input: str | None = None) -> str:
    """``git args`` in ``cwd`` (``env`` over the process's); its output, or RuntimeError."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    proc = subprocess.run(["git", *args], cwd=cwd, env=full_env, input=input, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {cwd}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def no_repo_env(path: str) -> dict[str, str]:
    """Environment in which git treats ``path`` as outside any repository."""
    env = dict(os.environ)
    env["GIT_CEILING_DIRECTORIES"] = os.path.dirname(os.path.abspath(path))
    return env


def check_applies(diff: str, files: dict[str, str]) -> str | None:
    """None if ``git apply --check`` accepts ``diff`` on ``files`` (relpath -> text)."""
    with tempfile.TemporaryDirectory(prefix="tp-export-check-") as tmp:
        for rel, text in files.items():
            if not text:  # a file the diff creates
                continue
            path = os.path.join(tmp, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        proc = subprocess.run(
            ["git", "apply", "--check", "-"],
            cwd=tmp,
            input=diff,
            capture_output=True,
            text=True,
            env=no_repo_env(tmp),
        )
        if proc.returncode != 0:
            return proc.stderr.strip() or f"git apply exited {proc.returncode}"
    return None


def unified_diff(rel: str, before: str, after: str) -> str:
    """git's diff of ``rel``; ``before == ""``: a new file."""
    a = before.splitlines(keepends=True)
    b = after.splitlines(keepends=True)
    for lines in (a, b):
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n\\ No newline at end of file\n"
    new = not before
    body = "".join(difflib.unified_diff(a, b, "/dev/null" if new else f"a/{rel}", f"b/{rel}", n=3))
    return f"diff --git a/{rel} b/{rel}\n" + ("new file mode 100644\n" if new else "") + body


def diff_blocks(diff: str) -> dict[str, str]:
    """A multi-file git diff, by file."""
    blocks: dict[str, str] = {}
    for block in re.split(r"(?m)^(?=diff --git )", diff):
        if block:
            rel = block.split("\n", 1)[0].split(" b/", 1)[1]
            blocks[rel] = block
    return blocks
