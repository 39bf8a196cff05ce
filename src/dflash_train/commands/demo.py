"""`dflash-train demo`: the whole path on the embedded default target, ending with numbers.

regen (SmolLM2 writes the answers to ShareGPT prompts) -> prepare -> train -> eval (held-out
ShareGPT, MT-Bench, HumanEval; block and DDTree) -> export, plus plots. Every stage is resumable:
a second run reuses what is done. Sized for a 2-core CPU; larger when a GPU is present.

The CPU recipe spends its minutes where they teach the drafter most: many short
regenerated answers (short prompts, 64 new tokens, large generation batches) rather than few long
ones; a 1-layer drafter with block 4 (a drafter this young rarely gets past slot 3, and every slot
costs a full-vocabulary lm_head row); context from target layers 1 and 15 (as good as 1 and 27 here
at half the target's cost per step). Tau is measured by replay (`infer.replay`: the same tau as
greedy decoding, without decoding step by step) on several prompts per dataset, for the trained and
for the untrained drafter, and real decoding runs on one prompt for the timing and lossless check.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import assets
from ..config.load import config_from_dict
from ..data.chat import prompt_ids
from ..data.formats import require_packages
from ..data.regen.inputs import RegenSettings
from ..data.regen.local import regenerate
from ..errors import EXIT_STOPPED
from ..exports.card import link_images, put_eval_table
from ..files.layout import list_checkpoints
from ..infer.evaluate import (HISTOGRAM_HEADER, format_histogram, iter_prompts, load_eval_models, make_modes,
                             replay_reports, run_prompt, summarize_records)
from ..infer.spec_decode import SpeculativeDecoder
from ..run.directory import RunDir
from ..run.metrics import read_metrics
from ..runtime import resolve_device, resolve_dtype
from ..target.capture import load_tokenizer
from ..train.trainer import train
from .pipeline import Stage, StageRunner, Unfinished
from .prepare import PrepareConfig, prepare

log = logging.getLogger(__name__)

DATASETS = ("sharegpt", "mt-bench", "humaneval")
RECIPE_VERSION = 2  # bump when the demo's recipe changes: an old run directory is then refused, not mixed in


@dataclass
class DemoSize:
    prompts: int  # ShareGPT training rows read; rows whose prompt is longer than max_prompt_tokens are skipped
    max_prompt_tokens: int
    max_new_tokens: int
    regen_batch: int
    train_steps: int
    eval_prompts: int  # per dataset, tau by replay
    eval_prompt_tokens: int  # evaluation prompts longer than this (first turn, chat template applied) are skipped
    eval_new_tokens: int
    tree_budget: int
    decode_prompts: int  # held-out ShareGPT prompts decoded for real (timing, speedup, lossless check)
    decode_new_tokens: int

    @classmethod
    def for_machine(cls) -> "DemoSize":
        if torch.cuda.is_available():
            return cls(prompts=2000, max_prompt_tokens=512, max_new_tokens=256, regen_batch=32, train_steps=800,
                       eval_prompts=40, eval_prompt_tokens=1024, eval_new_tokens=256, tree_budget=32,
                       decode_prompts=2, decode_new_tokens=128)
        return cls(prompts=800, max_prompt_tokens=128, max_new_tokens=64, regen_batch=64, train_steps=320,
                   eval_prompts=16, eval_prompt_tokens=256, eval_new_tokens=64, tree_budget=16,
                   decode_prompts=1, decode_new_tokens=32)


def demo_config(size: DemoSize, data_dir: Path, overrides: list[str]):
    gpu = torch.cuda.is_available()
    if gpu:
        drafter = {"num_draft_layers": 5, "block_size": 16}
    else:  # SmolLM2 has 30 layers: 1 and 15 instead of the reference rule's deeper pick halves the capture
        drafter = {"num_draft_layers": 1, "block_size": 4, "target_layer_ids": [1, 15]}
    tree = {
        "target": {"path": "smollm2"},
        "drafter": drafter,
        "data": {"train_files": [str(data_dir)], "max_length": 1024 if gpu else 384,
                 "token_budget": 16384 if gpu else 1536, "max_batch_size": 16 if gpu else 4},
        "objective": {"max_anchors": 512 if gpu else 48, "gamma": 7.0 if gpu else 4.0},
        "optim": {"lr": 6e-4 if gpu else 1e-3, "epochs": 100, "max_steps": size.train_steps, "warmup_ratio": 0.05},
        # Validation without decoding (teacher-forced loss, accuracy and tau estimates): the curve in the plots.
        "run": {"log_every": 5, "save_every": 50 if gpu else 60, "eval_every": max(size.train_steps // 4, 1),
                "eval_prompts": 1 if gpu else 0, "eval_batches": 2, "eval_max_new_tokens": 32},
    }
    return config_from_dict(tree, overrides)


def recipe(size: DemoSize, overrides: list[str]) -> dict:
    """What a run directory's stages were made with: they are reused only by the same recipe and overrides."""
    return {"recipe_version": RECIPE_VERSION, "size": asdict(size), "overrides": list(overrides)}


def open_pipeline(root: Path, size: DemoSize, overrides: list[str]) -> StageRunner:
    """The demo's stage runner on `root` (state in demo.json); refuses a root of another recipe."""
    return StageRunner(root, recipe(size, overrides), state_file="demo.json", label="demo",
                       remedy="remove it or pass --run-dir NEW_DIR", say=lambda msg: print(f"[demo] {msg}", flush=True))


def plot_run(run_dir: Path, eval_report: dict, out_dir: Path) -> list[Path]:
    """Training curves and the acceptance histogram as PNG (matplotlib, if installed)."""
    try:  # an optional dependency (the `plots` extra)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plots")
        return []
    records = read_metrics(run_dir)
    train = [r for r in records if r.get("kind") != "validation"]
    val = [r for r in records if r.get("kind") == "validation"]
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train])
    axes[0].set(title="training loss", xlabel="step")
    last = train[-1]["accuracy_per_position"]
    axes[1].bar(range(1, len(last) + 1), [a or 0 for a in last])
    axes[1].set(title=f"accuracy per block position (step {train[-1]['step']})", xlabel="position",
                xticks=range(1, len(last) + 1))
    axes[2].plot([r["step"] for r in train], [r["tau_estimate"] for r in train], label="train (teacher-forced)")
    walk = [r for r in val if r.get("val_tau_walk") is not None]
    if walk:  # greedy block decoding walked along held-out responses: real decoding's tau on that data
        axes[2].plot([r["step"] for r in walk], [r["val_tau_walk"] for r in walk], "o-", label="validation (greedy walk)")
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
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend()
    fig.tight_layout()
    paths.append(out_dir / "acceptance_histogram.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    return paths


def eval_items(tokenizer, size: DemoSize) -> list[dict]:
    """The first `eval_prompts` prompts of each dataset whose first turn fits `eval_prompt_tokens`."""
    items = []
    for ds in DATASETS:
        taken = 0
        for item in iter_prompts(ds):
            if taken >= size.eval_prompts:
                break
            if len(prompt_ids(tokenizer, [{"role": "user", "content": item["turns"][0]}])) <= size.eval_prompt_tokens:
                items.append({"dataset": ds, **item})
                taken += 1
    return items


def run_eval(target: str, drafter_dir: Path, size: DemoSize, seed: int = 0) -> dict:
    """Tau by replay (block and DDTree) of the trained drafter and of the same drafter untrained (what
    training started from), then real decoding of `decode_prompts` held-out ShareGPT prompts (timing,
    speedup against the target alone, lossless check). The report is `evaluate`'s, plus "untrained" (tau
    per dataset and mode) and "decode" (the real-decoding summary)."""
    device = resolve_device("auto")
    tgt, tok, drafter, stops = load_eval_models(target, str(drafter_dir), device, resolve_dtype("float32", device))
    torch.manual_seed(seed)
    untrained = type(drafter)(drafter.config).to(device=device, dtype=next(drafter.parameters()).dtype).eval()
    items = eval_items(tok, size)
    budgets = (size.tree_budget,)
    with torch.no_grad():
        reports = replay_reports(tgt, tok, {"trained": drafter, "untrained": untrained}, items,
                                 max_new_tokens=size.eval_new_tokens, tree_budgets=budgets, stop_token_ids=stops,
                                 batch_size=size.regen_batch)
        report = reports["trained"]
        report["config"].update(prompts_per_dataset=size.eval_prompts, max_prompt_tokens=size.eval_prompt_tokens)
        report["untrained"] = {ds: {m: s["tau"] for m, s in body["modes"].items()}
                               for ds, body in reports["untrained"]["datasets"].items()}
        decoder = SpeculativeDecoder(tgt, drafter, stops)
        dmodes = make_modes(budgets, measure_speedup=True)
        drecs = [run_prompt(decoder, tok, item, dmodes, size.decode_new_tokens, dataset=item["dataset"])
                 for item in [i for i in items if i["dataset"] == "sharegpt"][: size.decode_prompts]]
        report["decode"] = {"prompts": len(drecs), "max_new_tokens": size.decode_new_tokens,
                            **summarize_records(drecs, [m.name for m in dmodes])}
    return report


def summary_table(report: dict) -> str:
    """tau per dataset and mode (trained and untrained), then the real-decoding line."""
    c = report["config"]
    lines = [f"tau by replay (greedy; {c.get('prompts_per_dataset', '?')} prompts per dataset, "
             f"{c['max_new_tokens']} new tokens, block {c['block_size']}); untrained = the same drafter before training",
             "", f"| dataset | mode | tau | untrained tau | steps | {HISTOGRAM_HEADER} |",
             "|---|---|---|---|---|---|"]
    for ds, body in report["datasets"].items():
        for mode, s in body["modes"].items():
            base = report.get("untrained", {}).get(ds, {}).get(mode)
            hist = format_histogram(s["histogram"])
            lines.append(f"| {ds} | {mode} | {s['tau']:.3f} | {'-' if base is None else f'{base:.3f}'} | "
                         f"{s['steps']} | {hist} |")
    dec = report.get("decode")
    if dec and dec.get("prompts"):
        m = dec["modes"]
        parts = [f"{name} tau {s['tau']:.2f}, {s['decode_tokens_per_s']:.1f} tok/s"
                 + (f" ({s['speedup']:.2f}x)" if "speedup" in s else "")
                 for name, s in m.items() if s.get("decode_tokens_per_s") is not None]
        lossless = "lossless" if not dec["lossless_mismatches"] else f"MISMATCH {dec['lossless_mismatches']}"
        lines += ["", f"real decoding ({dec['prompts']} held-out ShareGPT prompt, {dec['max_new_tokens']} tokens, "
                      f"float32): " + "; ".join(parts) + f"; {lossless}"]
    return "\n".join(lines)


def run_demo(root: Path, overrides: list[str], size: "DemoSize | None" = None) -> int:
    """The whole path into `root`; `size` defaults to the machine's (tests pass a small one). Exit code 0, or
    3 when training stopped before its end (a stop request): the same command continues."""
    size = size or DemoSize.for_machine()
    require_packages(list(DATASETS))  # every set it reads, before the first stage: not at eval, minutes in
    root.mkdir(parents=True, exist_ok=True)
    runner = open_pipeline(root, size, overrides)
    t_all = time.time()
    target = str(assets.resolve_target("smollm2"))
    regen_out, data_dir, run_dir, eval_json = root / "regen.jsonl", root / "prepared", root / "run", root / "eval.json"
    export = run_dir / "export"
    cfg = demo_config(size, data_dir, overrides)

    def do_regen():
        return regenerate(assets.SMOLLM2_SPEC, ["sharegpt"], regen_out, RegenSettings(  # recorded by name
            max_new_tokens=size.max_new_tokens, limit=size.prompts, max_prompt_tokens=size.max_prompt_tokens,
            batch_size=size.regen_batch, progress=False))

    def do_prepare():
        if (data_dir / "manifest.json").is_file():
            return json.loads((data_dir / "manifest.json").read_text())
        return prepare(load_tokenizer(target), target, [str(regen_out)], data_dir,
                       PrepareConfig(max_length=cfg.data.max_length, block_size=cfg.drafter.block_size,
                                     val_fraction=0.05))

    def do_train():
        if (export / "model.safetensors").is_file():
            return export
        resume = bool(list_checkpoints(run_dir / "checkpoints"))
        if not resume and run_dir.is_dir() and RunDir(run_dir).contents():
            print(f"an earlier training attempt never checkpointed; moved aside: {RunDir(run_dir).move_aside()}")
        train(cfg, run_dir, resume=resume)
        if not (export / "model.safetensors").is_file():
            raise Unfinished(f"training stopped before its last step (see {run_dir / 'train.log'}); run the demo "
                             "again to continue it")
        return export

    def do_eval():
        if eval_json.is_file():
            return json.loads(eval_json.read_text())
        report = run_eval(target, export, size, cfg.run.seed)
        eval_json.write_text(json.dumps(report, indent=1))
        return report

    def do_export():  # the plots and the eval table on the exported drafter's model card
        report = json.loads(eval_json.read_text())
        pngs = plot_run(run_dir, report, export)
        put_eval_table(export, report)
        link_images(export, pngs)

    done = runner.run([
        Stage("regen", do_regen, outputs=(regen_out,)),
        Stage("prepare", do_prepare, outputs=(data_dir / "manifest.json",),
              reuse=lambda: json.loads((data_dir / "manifest.json").read_text())),
        Stage("train", do_train, outputs=(export / "model.safetensors",), reuse=lambda: export),
        Stage("eval", do_eval, outputs=(eval_json,), reuse=lambda: json.loads(eval_json.read_text())),
        Stage("export", do_export, outputs=(export / "README.md",)),
    ])
    if not done.finished:
        return EXIT_STOPPED
    report = done.result("eval")
    train_records = [r for r in read_metrics(run_dir) if r.get("kind") != "validation"]
    tok_s = sum(r["tokens_per_s"] for r in train_records) / max(len(train_records), 1)
    print("\n" + summary_table(report))
    print(f"\ntraining: {len(train_records) and train_records[-1]['step']} steps, {tok_s:,.0f} target tokens/s")
    print("wall time: " + ", ".join(f"{o.name} {o.seconds:.0f} s" if o.status == "ran"
                                    else f"{o.name} {o.total_s:.0f} s (an earlier call)" for o in done.outcomes)
          + f"; total {time.time() - t_all:.0f} s")
    print(f"run directory: {run_dir}\nexported drafter: {export} (model card with plots)")
    return 0
