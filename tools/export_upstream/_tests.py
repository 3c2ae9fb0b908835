"""Our tests as upstream test files, carried by the commit that brings what they test.

A test of ours that needs nothing but the code of one commit (and the commits before it) is
rewritten into upstream's form - imports of our modules become imports of the upstream modules
they were exported to, our ``TestCase`` upstream's (``torch._dynamo.test_case``), the names
pass of ``_names.py`` over the rest, an ``Owner(s)`` line on top - and added to that commit as
a new file under upstream's ``test/`` tree.  ``import_each_commit`` runs each commit's files
on the overlay right after applying it, with every later commit still absent.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

#: Commit name -> (our test file, the upstream test file it becomes, upstream owner label).
UPSTREAM_TESTS: dict[str, list[tuple[str, str, str]]] = {
    "add-solver": [
        ("test/test_budget_solver.py", "test/functorch/test_activation_budget_solver.py", "module: functorch"),
    ],
}

#: Our test helpers -> upstream's.
_TEST_IMPORTS = {
    "from torch_patches.testing import TestCase": "from torch._dynamo.test_case import TestCase",
}


def upstream_test(text: str, owner: str, rename: Callable[[str], str]) -> str:
    """Our test module ``text`` in upstream's form (``rename``: the names pass)."""
    for ours, theirs in _TEST_IMPORTS.items():
        text = text.replace(ours, theirs)
    text = rename(text)
    if re.search(r"^\s*(from|import) torch_patches\b", text, re.M):
        raise ValueError("the test still imports torch_patches: it needs more than upstream code")
    return f'# Owner(s): ["{owner}"]\n\n' + text


def tests_for(name: str, repo_root: str, rename: Callable[[str], str]) -> dict[str, str]:
    """The upstream test files (relpath -> text) the commit ``name`` carries."""
    out = {}
    for ours, theirs, owner in UPSTREAM_TESTS.get(name, ()):
        with open(os.path.join(repo_root, ours), encoding="utf-8") as f:
            out[theirs] = upstream_test(f.read(), owner, rename)
    return out
