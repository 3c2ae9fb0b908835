"""Upstream's names in the exported text: no ``torch_patches`` outside the provenance trailer.

The generator rewrites every code reference to our modules into upstream's (the module a
mirror stands for, the module a satellite moved into, ``torch._functorch.config`` knobs).
What it cannot see are names in prose and strings: docstrings and comments that point at
``torch_patches.config.lossy_min_bytes`` or ``torch_patches/hooks/numerics.py``, a log artifact
called ``torch_patches``, a warning that starts with ``torch_patches:``. :func:`upstream_names`
rewrites those, in this order:

* ``torch_patches.config.KNOB`` -> ``torch._functorch.config.<upstream knob>`` (the knob map);
* ``torch_patches.hooks...`` and ``torch_patches/hooks/X.py`` -> :data:`HOOKS_HOME`, the
  proposed upstream home of the hooks library, whose modules are private there
  (``_compress.py``): the package is the API (the markers ``inlineable``, ``select``,
  ``cache_hash``, ``budget`` and the ready-made pairs);
* ``torch_patches.<module>[.<name>]`` and ``torch_patches/<module path>.py`` -> the upstream
  module the module mirrors or was moved into;
* ``torch_patches.apply()`` / ``unapply()`` -> ``apply()`` / ``unapply()``;
* a ``torch_patches:`` message prefix is dropped (upstream messages have none);
* ``TORCH_LOGS="torch_patches"`` and the artifact's name -> :data:`ARTIFACT`;
* any other ``torch_patches`` (the feature's name in prose) -> "saved tensors hooks".

Upstream's own text never says ``torch_patches``, so the rewrite runs over whole files.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection

#: Proposed upstream home of ``torch_patches.hooks`` (beside ``torch.utils.checkpoint``).
HOOKS_HOME = "torch.utils.saved_tensors_hooks"
#: Upstream name of the ``torch_patches`` log artifact (``TORCH_LOGS="saved_tensors_hooks"``).
ARTIFACT = "saved_tensors_hooks"
#: The line of a commit message that says where it came from (the one place our name stays).
PROVENANCE = "Exported-from:"

_TP = "torch_patches"
_DOTTED = re.compile(r"\btorch_patches(?!\w)((?:\.[A-Za-z_]\w*)*)")
_PATH = re.compile(r"\btorch_patches(?!\w)((?:/[A-Za-z_]\w*)*)(?:\.py|/)?")


def upstream_names(
    text: str,
    module_home: Callable[[str], str | None],
    knob_name: Callable[[str], str | None],
    api: Collection[str] = (),
) -> str:
    """``text`` with our names replaced by upstream's.

    ``module_home(tp_module)``: the upstream module a module of ours stands for or was moved
    into (None: unknown); ``knob_name(knob)``: a knob's upstream name (None: not a knob);
    ``api``: the names the hooks package exports (``torch_patches.hooks.select`` is the
    function, not the module of that name)."""
    if _TP not in text:
        return text
    text = re.sub(r"\btorch_patches\.(apply|unapply)\(\)", r"\1()", text)
    text = re.sub(r"(TORCH_LOGS=[\"']?[+-]?)torch_patches\b", rf"\g<1>{ARTIFACT}", text)
    text = re.sub(r"([\"'])torch_patches\1", rf"\g<1>{ARTIFACT}\g<1>", text)
    text = re.sub(r"``torch_patches``(?= (?:log )?artifact)", f"``{ARTIFACT}``", text)
    text = re.sub(r"([\"'(]|``|^|\s)torch_patches: ", r"\1", text, flags=re.M)

    def dotted(m: re.Match[str]) -> str:
        parts = [p for p in m.group(1).split(".") if p]
        if parts[:1] == ["config"] and len(parts) >= 2:
            name = knob_name(parts[1])
            if name is not None:
                return ".".join(["torch._functorch.config", name, *parts[2:]])
            return ".".join(["torch._functorch.config", *parts[1:]])
        if parts[:1] == ["hooks"]:
            if len(parts) == 2 and parts[1] not in api:
                home = module_home(".".join([_TP, *parts]))
                if home is not None:  # a module of the library (private upstream)
                    return home
            rest = [p for p in parts[1:] if not p.startswith("_")]
            return ".".join([HOOKS_HOME, *rest[-1:]])
        for n in range(len(parts), 0, -1):
            home = module_home(".".join([_TP, *parts[:n]]))
            if home is not None:
                return ".".join([home, *parts[n:]])
        return "saved tensors hooks" if not parts else ".".join(["torch", *parts])

    def path(m: re.Match[str]) -> str:
        parts = [p for p in m.group(1).split("/") if p]
        if not parts:
            return m.group(0)
        if parts[0] == "hooks":
            return HOOKS_HOME.replace(".", "/") + "/" + ("_" + parts[1].lstrip("_") + ".py" if len(parts) > 1 else "")
        home = module_home(".".join([_TP, *parts]))
        return (home or ".".join(["torch", *parts])).replace(".", "/") + ".py"

    text = _PATH.sub(lambda m: path(m) if "/" in m.group(0) else m.group(0), text)
    text = _DOTTED.sub(dotted, text)
    return text


def leftovers(text: str) -> list[str]:
    """Lines of exported text that still say ``torch_patches`` (the provenance line aside)."""
    return [line for line in text.splitlines() if _TP in line and not line.lstrip("+- ").startswith(PROVENANCE)]
