"""Step time of the chunked loss head against the same step with the head left whole.

An HF Llama (``torch_patches.testing.models.hf_llama``) called as HF Trainer calls it
(``labels=``, defaults) or with the loss inside the compiled step and no logits returned
(``--call bench``), compiled (Inductor, ``--backend``) in one process as three rows: no hooks;
``budget(F)`` with the head chunked (``config.chunked_loss_head = "on"``); ``budget(F)``
with the head whole (``"off"``). Each row is its own copy of the model (the same weights) and
its own compiled code; their steps alternate (ABC, CBA, ...), so a shared machine's slow
phases fall on every row alike. Prints the median step of each row and the ratios of the
medians; ``--json`` writes them.

    python -m benchmarks.loss_head_time --vocab 65536 --fraction 0.3 --steps 20
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import warnings
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.loss_head_time", description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--fraction", type=float, default=0.3)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per row (after three warm-up steps)")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    parser.add_argument("--call", choices=("hf_default", "bench"), default="hf_default")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not 0 < args.fraction <= 1 or args.steps < 1:
        parser.error("--fraction in (0, 1], --steps >= 1")

    import torch

    import torch_patches
    from benchmarks import interleaved_times
    from torch_patches import config
    from torch_patches.hooks import budget
    from torch_patches.testing.models import causal_lm_loss, hf_llama

    torch.set_num_threads(args.threads)
    torch_patches.apply()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    lm = hf_llama(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, seq=args.seq).train()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    #: Row name -> (hooks or None, chunked_loss_head).
    rows: dict[str, tuple[Any, str]] = {
        "no hooks": (None, "auto"),
        f"budget({args.fraction:g}), head chunked": (budget(args.fraction), "on"),
        f"budget({args.fraction:g}), head whole": (budget(args.fraction), "off"),
    }
    models = {name: causal_lm_loss(copy.deepcopy(lm), args.call) for name in rows}
    compiled = {name: torch.compile(model, backend=args.backend) for name, model in models.items()}

    def step(name: str) -> float:
        hooks, head = rows[name]
        start = time.perf_counter()
        with config.patch(chunked_loss_head=head):
            if hooks is None:
                loss = compiled[name](ids)
            else:
                with torch.autograd.graph.saved_tensors_hooks(*hooks):
                    loss = compiled[name](ids)
            loss.backward()
        elapsed = time.perf_counter() - start
        models[name].zero_grad(set_to_none=True)
        return elapsed

    order = list(rows)
    times = interleaved_times(step, order, args.steps)
    median = {name: statistics.median(t) for name, t in times.items()}
    chunked, whole = order[1], order[2]
    print(
        f"torch {torch.__version__}, {args.threads} thread(s); HF Llama {args.layers} x {args.dim}, vocab {args.vocab}, "
        f"batch {args.batch} x {args.seq}, call {args.call}, {args.backend}; {args.steps} steps a row, interleaved"
    )
    for name, t in times.items():
        print(f"  {name}: median step {1000 * median[name]:.1f} ms (fastest {1000 * min(t):.1f} ms)")
    ratio = median[chunked] / median[whole]
    print(f"chunked / whole: {ratio:.3f}; chunked / no hooks: {median[chunked] / median['no hooks']:.3f}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(
                {
                    "torch": torch.__version__,
                    "args": {k: v for k, v in vars(args).items() if k != "json"},
                    "times_s": times,
                    "median_s": median,
                    "chunked_over_whole": ratio,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
