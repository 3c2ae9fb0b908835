"""Compute (and record) the upstream fingerprints each patch depends on.

    python -m tools.fingerprints                       # installed torch: check every patch
    python -m tools.fingerprints --root DIR --version 2.14 [--write]

``--root`` is a directory holding a ``torch/`` source tree (a site-packages directory, or
a wheel unpacked with ``unzip torch-*.whl 'torch/*.py'``); nothing is imported from it.
``--write`` records the fingerprints under ``--version`` in
``torch_patches/_registry/fingerprints.json``.  Only record after re-reading the upstream change
the new fingerprint stands for: a fingerprint says "this patch was checked against this
upstream code".
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from collections.abc import Callable, Iterable

from torch_patches import _registry
from torch_patches._registry.fingerprints import FINGERPRINTS_FILE as _FINGERPRINTS_FILE
from torch_patches._registry.patches import PATCHES


def fingerprint_of(targets: Iterable[str], source_of: Callable[[str], tuple[str, ast.Module]]) -> str:
    """The fingerprint of ``targets`` (``module:Qual.name``), each module's text and tree
    given by ``source_of(module)``."""
    parts = []
    for target in targets:
        module, _, qual = target.partition(":")
        source, tree = source_of(module)
        parts.append(_registry.fingerprint_source(_registry.find_definition(source, qual, tree)))
    return _registry.combine_fingerprints(parts)


def from_source_tree(root: str, targets: tuple[str, ...]) -> str:
    def read(module: str) -> tuple[str, ast.Module]:
        path = os.path.join(root, *module.split(".")) + ".py"
        if not os.path.exists(path):
            path = os.path.join(root, *module.split("."), "__init__.py")
        with open(path) as f:
            source = f.read()
        return source, ast.parse(source)

    return fingerprint_of(targets, read)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", help="directory containing a torch/ source tree")
    parser.add_argument("--version", help="torch major.minor the tree is (with --root)")
    parser.add_argument("--write", action="store_true", help="record into fingerprints.json")
    args = parser.parse_args(argv)

    if args.root and not args.version:
        parser.error("--root needs --version")
    if args.root:
        version = args.version
    else:
        major, minor = _registry.parse_version(_registry.torch_version())
        version = f"{major}.{minor}"

    with open(_FINGERPRINTS_FILE) as f:
        recorded: dict[str, dict[str, str]] = json.load(f)
    status = 0
    for patch in PATCHES:
        targets = (patch.target, *patch.depends_on)
        try:
            if args.root:
                fp = from_source_tree(args.root, targets)
            else:
                fp = _registry.live_fingerprint(targets)
        except Exception as e:  # noqa: BLE001
            print(f"{patch.name:50s} ERROR {e}")
            status = 1
            continue
        known = recorded.get(patch.name, {})
        mark = "ok" if fp in known.values() else "NEW"
        print(f"{patch.name:50s} {version:5s} {fp} {mark}")
        if args.write:
            recorded.setdefault(patch.name, {})[version] = fp
    if args.write:
        with open(_FINGERPRINTS_FILE, "w") as f:
            json.dump(recorded, f, indent=2, sort_keys=True)
            f.write("\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
