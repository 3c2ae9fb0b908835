"""CLI: ``python -m tools.export_upstream export|verify`` (see the package docstring)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

from tools.export_upstream._write import apply_to_overlay, knob_map, make_stack, run_export, write_out
from torch_patches._registry import install

#: Environment variable read by ``torch_patches.testing``: path of a config map; when
#: set, tests run against upstream-form torch instead of calling ``torch_patches.apply()``.
UPSTREAM_FORM_ENV = "TORCH_PATCHES_UPSTREAM_FORM"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: The golden-graph tests the equivalence check runs against the upstream form: the
#: placement goldens (AOT patches) and the in-region scope tests (Dynamo patches); the
#: latter's untraceable-hook tests check torch_patches' own error type, which the upstream
#: form defines in graph_compile.py, so they are left out.
DEFAULT_TESTS = ("test/test_inline_placement.py", "test/test_inscope_hooks.py::TestInScopeHooksCPU")


def installed_torch_root() -> str:
    """The directory holding the installed ``torch/`` package (not imported)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise SystemExit("torch is not installed; pass --torch-root")
    return os.path.dirname(os.path.dirname(spec.origin))


def _patches():
    return install._registered()


def _effects():
    return install._registered_effects()


def _print_report(results) -> None:
    for r in results:
        if r.status == "exported":
            print(f"{r.filename}: {r.subject} ({r.changed_lines()} lines)")
            print(f"    files: {', '.join(r.files)}")
            for note in r.notes:
                print(f"    note: {note}")
        else:
            print(f"{r.name}: skipped: {r.reason}")
    n = sum(r.status == "exported" for r in results)
    print(f"{n} exported, {len(results) - n} skipped")


def cmd_export(args: argparse.Namespace) -> int:
    root = args.torch_root or installed_torch_root()
    exporter, results = run_export(root, _patches(), REPO_ROOT, _effects())
    write_out(args.out, root, results)
    _print_report(results)
    print(f"wrote {args.out}")
    if args.stack:
        commits = make_stack(args.stack, exporter, results)
        print(f"stack: {len(commits)} commits in {args.stack} (ghstack submit from there; nothing pushed)")
    return 0 if all(r.status == "exported" for r in results) else 1


def run_upstream_tests(
    results,
    torch_root: str,
    workdir: str,
    tests: list[str],
    python: str = sys.executable,
    extra_pytest_args: list[str] = (),
) -> subprocess.CompletedProcess:
    """Apply the stack to an overlay of ``torch_root`` in ``workdir``; run ``tests`` on it."""
    overlay = os.path.join(workdir, "site")
    apply_to_overlay(overlay, torch_root, results)
    cmap = os.path.join(workdir, "config-map.json")
    with open(cmap, "w") as f:
        json.dump(knob_map(results), f)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([overlay, REPO_ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env[UPSTREAM_FORM_ENV] = cmap
    env.pop("EXPECTTEST_ACCEPT", None)
    return subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra_pytest_args, *tests],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
    )


def cmd_verify(args: argparse.Namespace) -> int:
    root = args.torch_root or installed_torch_root()
    _, results = run_export(root, _patches(), REPO_ROOT, _effects())
    _print_report(results)
    with tempfile.TemporaryDirectory(prefix="tp-upstream-") as tmp:
        proc = run_upstream_tests(results, root, tmp, args.tests or list(DEFAULT_TESTS))
    print(proc.stdout[-6000:])
    print(proc.stderr[-3000:], file=sys.stderr)
    return proc.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.export_upstream", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("export", help="write one upstream diff per patch (and a git stack)")
    p.add_argument("--out", required=True, help="directory for the .patch files and the summary")
    p.add_argument("--stack", help="git repository to commit the stack into (created if needed)")
    p.add_argument("--torch-root", help="directory holding a torch/ source tree (default: installed torch)")
    p.set_defaults(fn=cmd_export)
    v = sub.add_parser("verify", help="run golden tests against the stack applied to an overlay of torch")
    v.add_argument("--torch-root", help="directory holding the torch/ package to overlay (default: installed)")
    v.add_argument("tests", nargs="*", help=f"test files (default: {' '.join(DEFAULT_TESTS)})")
    v.set_defaults(fn=cmd_verify)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
