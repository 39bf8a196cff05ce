"""`dflash-train demo`: the whole path on the embedded default target, ending with numbers.

regen (SmolLM2 writes the answers to ShareGPT prompts) -> prepare -> train -> eval (held-out
ShareGPT, MT-Bench, HumanEval; block and DDTree) -> export, plus plots. Every stage is resumable:
a second run reuses what is done. Sized for a 2-core CPU; larger when a GPU is present.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@dataclass
class DemoSize:
    prompts: int
    max_prompt_tokens: int
    max_new_tokens: int
    train_steps: int
    eval_prompts: int
    eval_new_tokens: int
    tree_budget: int

    @classmethod
    def for_machine(cls) -> "DemoSize":
        if torch.cuda.is_available():
            return cls(prompts=2000, max_prompt_tokens=512, max_new_tokens=256, train_steps=800, eval_prompts=20,
                       eval_new_tokens=256, tree_budget=32)
        return cls(prompts=96, max_prompt_tokens=192, max_new_tokens=128, train_steps=120, eval_prompts=2,
                   eval_new_tokens=32, tree_budget=16)


def demo_config(size: DemoSize, data_dir: Path, overrides: list[str]):
    from .config import config_from_dict

    gpu = torch.cuda.is_available()
    tree = {
        "target": {"path": "smollm2"},
        "drafter": {"num_draft_layers": 5 if gpu else 2, "block_size": 16 if gpu else 8},
        "data": {"train_files": [str(data_dir)], "max_length": 1024 if gpu else 384,
                 "token_budget": 16384 if gpu else 1536, "max_batch_size": 16 if gpu else 4},
        "objective": {"max_anchors": 512 if gpu else 48, "gamma": 7.0 if gpu else 4.0},
        "optim": {"lr": 6e-4 if gpu else 1e-3, "epochs": 100, "max_steps": size.train_steps, "warmup_ratio": 0.05},
        "run": {"log_every": 5, "save_every": 50, "eval_every": max(size.train_steps // 4, 1), "eval_prompts": 1,
                "eval_batches": 2, "eval_max_new_tokens": 32},
    }
    return config_from_dict(tree, overrides)


def _stage(name: str, times: dict, fn):
    t0 = time.time()
    print(f"[demo] {name} ...", flush=True)
    result = fn()
    times[name] = time.time() - t0
    print(f"[demo] {name} done in {times[name]:.0f} s", flush=True)
    return result


def plot_run(run_dir: Path, eval_report: dict, out_dir: Path) -> list[Path]:
    """Training curves and the acceptance histogram as PNG (matplotlib, if installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plots")
        return []
    from .rundir import read_metrics

    records = read_metrics(run_dir)
    train = [r for r in records if r.get("kind") != "validation"]
    val = [r for r in records if r.get("kind") == "validation"]
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train])
    axes[0].set(title="training loss", xlabel="step")
    last = train[-1]["accuracy_per_position"]
    axes[1].bar(range(1, len(last) + 1), [a or 0 for a in last])
    axes[1].set(title=f"accuracy per block position (step {train[-1]['step']})", xlabel="position")
    axes[2].plot([r["step"] for r in train], [r["tau_estimate"] for r in train], label="train (teacher-forced)")
    if val:
        axes[2].plot([r["step"] for r in val], [r.get("val_tau", r.get("val_tau_estimate")) for r in val], "o-",
                     label="validation")
    axes[2].set(title="acceptance length", xlabel="step")
    axes[2].legend()
    fig.tight_layout()
    paths.append(out_dir / "training_curves.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for ds, body in eval_report["datasets"].items():
        hist = body["modes"]["block"]["histogram"]
        ks = sorted(int(k) for k in hist)
        total = sum(hist.values())
        ax.plot(ks, [hist[str(k)] / total if str(k) in hist else hist[k] / total for k in ks], "o-", label=ds)
    ax.set(title="accepted tokens per step (block verification)", xlabel="tokens", ylabel="share of steps")
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "acceptance_histogram.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    return paths


def run_demo(root: Path, overrides: list[str]) -> int:
    from . import assets
    from .data.prepare import PrepareConfig, prepare
    from .data.regen import RegenSettings, regenerate
    from .infer.evaluate import evaluate, load_eval_models, markdown_table, update_model_card
    from .model.target import load_tokenizer
    from .train.checkpoint import list_checkpoints
    from .train.trainer import resolve_device, resolve_dtype, train

    size = DemoSize.for_machine()
    root.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    t_all = time.time()
    target = str(assets.resolve_target("smollm2"))
    regen_out, data_dir, run_dir = root / "regen.jsonl", root / "prepared", root / "run"

    _stage("regen", times, lambda: regenerate(target, ["sharegpt"], regen_out, RegenSettings(
        max_new_tokens=size.max_new_tokens, limit=size.prompts, max_prompt_tokens=size.max_prompt_tokens,
        batch_size=16, progress=False)))

    def do_prepare():
        if (data_dir / "manifest.json").is_file():
            return json.loads((data_dir / "manifest.json").read_text())
        return prepare(load_tokenizer(target), target, [str(regen_out)], data_dir,
                       PrepareConfig(max_length=1024, block_size=8, val_fraction=0.05))

    _stage("prepare", times, do_prepare)
    cfg = demo_config(size, data_dir, overrides)

    def do_train():
        if (run_dir / "export" / "model.safetensors").is_file():
            return run_dir / "export"
        return train(cfg, run_dir, resume=bool(list_checkpoints(run_dir / "checkpoints")))

    _stage("train", times, do_train)
    eval_json = root / "eval.json"

    def do_eval():
        if eval_json.is_file():
            return json.loads(eval_json.read_text())
        device = resolve_device("auto")
        models = load_eval_models(target, str(run_dir / "export"), device, resolve_dtype("float32", device))
        tgt, tok, drafter, stops = models
        with torch.no_grad():
            report = evaluate(tgt, tok, drafter, ["sharegpt", "mt-bench", "humaneval"],
                              max_new_tokens=size.eval_new_tokens, tree_budgets=(size.tree_budget,),
                              limit=size.eval_prompts, stop_token_ids=stops)
        eval_json.write_text(json.dumps(report, indent=1))
        return report

    report = _stage("eval", times, do_eval)
    pngs = plot_run(run_dir, report, run_dir / "export")
    update_model_card(run_dir / "export", report)
    if pngs:
        card = run_dir / "export" / "README.md"
        card.write_text(card.read_text() + "\n" + "".join(f"![{p.stem}]({p.name})\n" for p in pngs))
    from .rundir import read_metrics

    train_records = [r for r in read_metrics(run_dir) if r.get("kind") != "validation"]
    tok_s = sum(r["tokens_per_s"] for r in train_records) / max(len(train_records), 1)
    print("\n" + markdown_table(report))
    print(f"\ntraining: {len(train_records) and train_records[-1]['step']} steps, {tok_s:,.0f} target tokens/s")
    print("wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()) + f"; total {time.time() - t_all:.0f} s")
    print(f"run directory: {run_dir}\nexported drafter: {run_dir / 'export'} (model card with plots)")
    return 0
