"""Importing each commit's modules as a fresh interpreter would, without paying for one.

A fresh interpreter per commit spends about three seconds importing torch and torch._dynamo
before it reaches the modules the commit touched; the stack has some fifty commits. An
:class:`ImportChecker` keeps one interpreter that has imported torch and torch._dynamo, and
forks it for each commit: the child starts from that state (the state a fresh interpreter
reaches after the same two imports), imports the commit's modules and exits. The parent is
restarted before a commit that changes a module it imported (or a file that is not a Python
module), since what it holds would be stale; other commits leave it valid (the child drops
the import system's directory caches first, to see the files added since).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence

from tools.export_upstream._model import rel_module

#: The interpreter that forks: reads a JSON list of modules per line, answers one line each
#: ("ok", or the last line of the child's error).
_SERVER = r"""
import importlib, json, os, sys, traceback
import torch
import torch._dynamo
sys.stdout.write(json.dumps(sorted(sys.modules)) + "\n"); sys.stdout.flush()
for line in sys.stdin:
    modules = json.loads(line)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        importlib.invalidate_caches()
        try:
            for m in modules:
                importlib.import_module(m)
            answer = "ok"
        except BaseException:
            answer = (traceback.format_exc().strip().splitlines() or ["?"])[-1]
        os.write(write, answer.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        answer = f.read().decode() or "the importing process died"
    os.waitpid(pid, 0)
    sys.stdout.write(json.dumps(answer) + "\n"); sys.stdout.flush()
"""


class ImportChecker:
    """Imports modules as ``python -c "import torch, torch._dynamo, <modules>"`` would, in
    ``cwd`` with ``env``; :meth:`before_commit` restarts it where a commit would leave what
    it imported stale."""

    def __init__(self, python: str, cwd: str, env: dict[str, str]) -> None:
        self.python, self.cwd, self.env = python, cwd, env
        self.proc: subprocess.Popen[str] | None = None
        self.loaded: set[str] = set()  # the modules the forking interpreter holds
        self.stderr = tempfile.TemporaryFile(mode="w+")  # what torch warns, read on failure

    def before_commit(self, files: Sequence[str], root: str) -> None:
        """Called before a commit touching ``files`` (paths under ``root``) is applied."""
        for rel in files:
            if not os.path.exists(os.path.join(root, rel)):
                continue  # added: nothing imported it yet
            if not rel.endswith(".py") or rel_module(rel) in self.loaded:
                self.restart()
                return

    def restart(self) -> None:
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait()
            self.proc = None
        self.loaded = set()

    def close(self) -> None:
        self.restart()
        self.stderr.close()

    def __enter__(self) -> ImportChecker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _server(self) -> subprocess.Popen[str] | None:
        if self.proc is None:
            self.proc = subprocess.Popen(
                [self.python, "-c", _SERVER],
                cwd=self.cwd,
                env=self.env,
                text=True,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.stderr,
            )
            assert self.proc.stdout is not None
            line = self.proc.stdout.readline()
            if not line:  # torch itself does not import
                return None
            self.loaded = set(json.loads(line))
        return self.proc

    def check(self, modules: Sequence[str]) -> str | None:
        """None where ``modules`` import; else the last line of the error."""
        proc = self._server()
        if proc is None:
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            self.stderr.seek(0)
            return (self.stderr.read().strip().splitlines() or ["?"])[-1]
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(list(modules)) + "\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        if not line:
            self.restart()
            return "the importing interpreter died"
        answer = json.loads(line)
        return None if answer == "ok" else answer


__all__ = ["ImportChecker"]
