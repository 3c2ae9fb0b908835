"""Importing each commit's modules as a fresh interpreter would, without paying for one.

A fresh interpreter per commit spends about four seconds importing torch and torch._dynamo
before it reaches the modules the commit touched; the stack has some sixty commits. An
:class:`ImportChecker` keeps interpreters that have done those imports and forks them:

* the *base* has imported torch (about half the time; the stack touches two of the modules
  it holds);
* the *server*, forked from the base, has also imported torch._dynamo, and forks a child
  for each commit: the child starts from that state (the state a fresh interpreter reaches
  after the same two imports), imports the commit's modules and exits.

A commit that changes a module the server imported (most do) ends the server, and the next
check forks a new one from the base; a commit that changes a module the base imported, or a
file that is not a Python module, restarts both. Other commits leave them valid (each fork
drops the import system's directory caches first, to see the files added since).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence

from tools.export_upstream._model import rel_module

#: The base: imports torch, then reads one JSON request per line. ``{"modules": [...]}``
#: answers ``{"answer": "ok" or the last line of the error, "loaded": the server's modules
#: where this request started it, else null}``; ``{"reset": true}`` ends the server (no
#: answer).
_SERVER = r"""
import importlib, json, os, sys, traceback
import torch
sys.stdout.write(json.dumps(sorted(sys.modules)) + "\n"); sys.stdout.flush()

def last_line():
    return (traceback.format_exc().strip().splitlines() or ["?"])[-1]

def serve(requests, replies):
    # The server: torch._dynamo imported, a child forked per request.
    for line in requests:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            importlib.invalidate_caches()
            try:
                for m in json.loads(line):
                    importlib.import_module(m)
                answer = "ok"
            except BaseException:
                answer = last_line()
            os.write(write, answer.encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as f:
            answer = f.read().decode() or "the importing process died"
        os.waitpid(pid, 0)
        replies.write(json.dumps(answer) + "\n"); replies.flush()

def start():
    requests_read, requests_write = os.pipe()  # base -> server
    replies_read, replies_write = os.pipe()  # server -> base
    pid = os.fork()
    if pid == 0:
        os.close(requests_write); os.close(replies_read)
        replies = os.fdopen(replies_write, "w")
        importlib.invalidate_caches()
        try:
            import torch._dynamo
        except BaseException:
            replies.write(json.dumps({"error": last_line()}) + "\n"); replies.flush()
            os._exit(0)
        replies.write(json.dumps({"loaded": sorted(sys.modules)}) + "\n"); replies.flush()
        serve(os.fdopen(requests_read), replies)
        os._exit(0)
    os.close(requests_read); os.close(replies_write)
    return pid, os.fdopen(requests_write, "w"), os.fdopen(replies_read)

def stop(server):
    pid, requests, replies = server
    requests.close(); replies.close()
    os.waitpid(pid, 0)

server = None
for line in sys.stdin:
    request = json.loads(line)
    if request.get("reset"):
        if server is not None:
            stop(server)
            server = None
        continue
    loaded = None
    if server is None:
        server = start()
        started = json.loads(server[2].readline() or '{"error": "the server died"}')
        if "error" in started:
            stop(server)
            server = None
            sys.stdout.write(json.dumps({"answer": started["error"], "loaded": None}) + "\n"); sys.stdout.flush()
            continue
        loaded = started["loaded"]
    server[1].write(json.dumps(request["modules"]) + "\n"); server[1].flush()
    reply = server[2].readline()
    if reply:
        answer = json.loads(reply)
    else:
        answer = "the importing interpreter died"
        stop(server)
        server = None
    sys.stdout.write(json.dumps({"answer": answer, "loaded": loaded}) + "\n"); sys.stdout.flush()
"""


class ImportChecker:
    """Imports modules as ``python -c "import torch, torch._dynamo, <modules>"`` would, in
    ``cwd`` with ``env``; :meth:`before_commit` ends the interpreters a commit would leave
    stale."""

    def __init__(self, python: str, cwd: str, env: dict[str, str]) -> None:
        self.python, self.cwd, self.env = python, cwd, env
        self.proc: subprocess.Popen[str] | None = None  # the base
        self.loaded: set[str] = set()  # the modules the base holds
        self.server_loaded: set[str] | None = None  # the server's (None: no server)
        self.stderr = tempfile.TemporaryFile(mode="w+")  # what torch warns, read on failure

    def before_commit(self, files: Sequence[str], root: str) -> None:
        """Called before a commit touching ``files`` (paths under ``root``) is applied."""
        for rel in files:
            if not os.path.exists(os.path.join(root, rel)):
                continue  # added: nothing imported it yet
            if not rel.endswith(".py") or rel_module(rel) in self.loaded:
                self.restart()
                return
            if self.server_loaded is not None and rel_module(rel) in self.server_loaded:
                self._request({"reset": True})
                self.server_loaded = None

    def restart(self) -> None:
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait()
            self.proc = None
        self.loaded = set()
        self.server_loaded = None

    def close(self) -> None:
        self.restart()
        self.stderr.close()

    def __enter__(self) -> ImportChecker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _base(self) -> subprocess.Popen[str] | None:
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

    def _request(self, request: dict[str, object]) -> None:
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()

    def check(self, modules: Sequence[str]) -> str | None:
        """None where ``modules`` import; else the last line of the error."""
        proc = self._base()
        if proc is None:
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            self.stderr.seek(0)
            return (self.stderr.read().strip().splitlines() or ["?"])[-1]
        assert proc.stdout is not None
        self._request({"modules": list(modules)})
        line = proc.stdout.readline()
        if not line:
            self.restart()
            return "the importing interpreter died"
        reply = json.loads(line)
        if reply["loaded"] is not None:
            self.server_loaded = set(reply["loaded"])
        answer = reply["answer"]
        return None if answer == "ok" else answer


__all__ = ["ImportChecker"]
