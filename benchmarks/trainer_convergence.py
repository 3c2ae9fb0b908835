"""HF Trainer itself, with gradient checkpointing and ``torch_compile=True``, with and without
the budget: does the budget train the same model, at or below the same peak?

``python -m benchmarks.trainer_convergence`` trains the convergence benchmark's byte-level HF
Llama (:mod:`benchmarks.convergence`: the same model, the same real text, the same held-out
batches) through ``transformers.Trainer`` as a user sets it up: ``gradient_checkpointing=True``,
``torch_compile=True``, AdamW with a linear warm-up and a cosine decay, gradient clipping; the
budget as ``torch_patches.config.activation_memory_budget = F`` around ``trainer.train()``,
with no other change. Each (row, seed) runs in a fresh process (``--worker``). Per row and
seed: the eval loss after training (the plain model, no hooks, no checkpointing), the train
loss (mean of the last tenth of the steps) and the peak CPU memory of one training step after
the compile (the allocator's events, Trainer's whole step: forward, backward, optimizer); the
table gives the eval loss's change against the row without a budget, as a mean over seeds
with its spread, and the peak as a ratio.

Rows (``--rows``): ``none`` (torch_patches applied, no budget) and ``budget:F``.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from benchmarks import worker_env
from benchmarks.convergence import TrainConfig, eval_batches, splits, train_batches

#: The step whose peak is measured (Trainer counts from 0; the compile is behind it).
PEAK_STEP = 5


def _dataset(cfg: TrainConfig, seed: int) -> list[dict[str, Any]]:
    train, _ = splits()
    windows = train_batches(train, cfg, seed).view(-1, cfg.seq)
    return [{"input_ids": w, "labels": w} for w in windows]


def _peak_callback(holder: dict[str, Any]) -> Any:
    import torch.profiler
    import transformers

    from torch_patches.testing import cpu_peak_of

    class PeakOfOneStep(transformers.TrainerCallback):
        prof: Any = None

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == PEAK_STEP:
                self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
                self.prof.__enter__()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.prof is not None:
                self.prof.__exit__(None, None, None)
                holder["peak_bytes"] = cpu_peak_of(self.prof)
                self.prof = None

    return PeakOfOneStep()


def run_one(cfg: TrainConfig, row: str, seed: int) -> dict[str, Any]:
    """One (row, seed) in this process: Trainer's run, its eval loss and peak."""
    import torch
    import transformers

    import torch_patches
    from torch_patches.testing import saved_tensor_records
    from torch_patches.testing.models import hf_llama

    torch_patches.apply()
    torch.manual_seed(seed)
    model = hf_llama(vocab=cfg.vocab, dim=cfg.dim, layers=cfg.layers, heads=cfg.heads, seq=cfg.seq)
    holder: dict[str, Any] = {}
    losses: list[float] = []

    class Losses(transformers.TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    budget = None if row == "none" else float(row.split(":", 1)[1])
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out,
            max_steps=cfg.steps,
            per_device_train_batch_size=cfg.batch,
            learning_rate=cfg.lr,
            lr_scheduler_type="cosine",
            warmup_steps=cfg.warmup,  # a float below 1: a fraction of the steps
            weight_decay=cfg.weight_decay,
            max_grad_norm=cfg.clip,
            gradient_checkpointing=True,
            torch_compile=True,
            torch_compile_backend=cfg.backend,
            seed=seed,
            data_seed=seed,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            dataloader_num_workers=0,
        )
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=_dataset(cfg, seed), callbacks=[_peak_callback(holder), Losses()]
        )
        with torch_patches.config.patch(activation_memory_budget=budget), saved_tensor_records() as compiled:
            trainer.train()
    _, held_out = splits()
    model.eval()
    with torch.no_grad():
        evals = [model(input_ids=b, labels=b).loss.item() for b in eval_batches(held_out, cfg)]
    tail = losses[-max(1, len(losses) // 10) :]
    return {
        "row": row,
        "seed": seed,
        "eval_loss": statistics.fmean(evals),
        "train_loss": statistics.fmean(tail),
        "peak_bytes": holder.get("peak_bytes"),
        "steps": len(losses),
        # What the budget did: the saved tensors of the compiled graphs by decision.
        "decisions": dict(sorted(collections.Counter(str(r.decision) for g in compiled for r in g.records).items())),
    }


def _in_subprocess(cfg: TrainConfig, row: str, seed: int) -> dict[str, Any]:
    job = json.dumps({"cfg": vars(cfg), "row": row, "seed": seed})
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.trainer_convergence", "--worker", job], capture_output=True, text=True, env=worker_env()
    )
    if proc.returncode != 0:
        return {"row": row, "seed": seed, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per row: the eval loss's change against ``none`` of the same seed (mean, min, max, in
    percent) and the peak against ``none``'s (mean of the seeds' ratios)."""
    ref = {r["seed"]: r for r in results if r["row"] == "none" and "error" not in r}
    rows = []
    for name in dict.fromkeys(r["row"] for r in results):
        mine = [r for r in results if r["row"] == name]
        ok = [r for r in mine if "error" not in r and r["seed"] in ref]
        if not ok:
            rows.append({"row": name, "error": next((r["error"] for r in mine if "error" in r), "no reference")})
            continue
        changes = [100 * (r["eval_loss"] / ref[r["seed"]]["eval_loss"] - 1) for r in ok]
        peaks = [r["peak_bytes"] / ref[r["seed"]]["peak_bytes"] for r in ok if r["peak_bytes"] and ref[r["seed"]]["peak_bytes"]]
        rows.append(
            {
                "row": name,
                "seeds": len(ok),
                "eval_loss": statistics.fmean(r["eval_loss"] for r in ok),
                "change_pct": (statistics.fmean(changes), min(changes), max(changes)),
                "peak_x": statistics.fmean(peaks) if peaks else None,
                "peak_mib": statistics.fmean(r["peak_bytes"] for r in ok if r["peak_bytes"]) / 2**20,
            }
        )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| row | seeds | eval loss | change vs none (mean [min, max]) | step peak | x none |", "|---|---:|---:|---|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | error: {r['error']} |||||")
            continue
        mean, lo, hi = r["change_pct"]
        peak_x = "" if r["peak_x"] is None else f"{r['peak_x']:.2f}"
        lines.append(
            f"| {r['row']} | {r['seeds']} | {r['eval_loss']:.4f} | {mean:+.2f}% [{lo:+.2f}, {hi:+.2f}] | {r['peak_mib']:.1f} MiB | {peak_x} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="none,budget:0.5,budget:0.3")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--backend", default="inductor", help="torch_compile_backend (Trainer's default: inductor)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        job = json.loads(a.worker)
        print(json.dumps(run_one(TrainConfig(**job["cfg"]), job["row"], job["seed"])))
        return 0
    cfg = TrainConfig(steps=a.steps, backend=a.backend, gradient_checkpointing=True, call="hf_default")
    results = []
    for seed in (int(s) for s in a.seeds.split(",")):
        for row in a.rows.split(","):
            results.append(_in_subprocess(cfg, row, seed))
            print(f"  seed {seed} {row}: {results[-1]}", file=sys.stderr)
    rows = summarize(results)
    print(format_table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": vars(cfg), "results": results, "rows": rows}, f, indent=1)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
