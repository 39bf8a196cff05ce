"""summary.json and summary.md: per dataset, pooled, per variant, acceptance by slot, the training runs."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

from .pooling import pooled_tau
from .settings import POOLED


def dataset_summaries(report: dict, info: dict) -> dict[str, dict]:
    """The summary's per-dataset entries: what was evaluated and dropped, tau and histogram per mode."""
    datasets = {}
    for name, meta in info.items():
        body = report["datasets"].get(name, {"modes": {}, "lossless_mismatches": []})
        meta = {k: v for k, v in meta.items() if k != "dropped_ids"}
        walls = [r.get("wall_s", 0.0) for r in report["outputs"] if r["dataset"] == name]
        datasets[name] = {**meta, "prompts_done": len(walls),
                          "mean_prompt_wall_s": round(sum(walls) / len(walls), 3) if walls else None,
                          "modes": {m: {k: s[k] for k in ("tau", "steps", "tokens", "histogram", "decode_tokens_per_s",
                                                          "speedup") if k in s}
                                    for m, s in body["modes"].items()},
                          "lossless_mismatches": len(body["lossless_mismatches"])}
    return datasets


def pooled_by_mode(datasets: dict[str, dict], modes: list[str]) -> dict[str, dict]:
    """Tau per mode over the steps of MT-Bench + ShareGPT (the reference's sets) and of every set."""
    pooled: dict[str, dict] = {}
    for mode in modes:
        for label, names in (("mt-bench+sharegpt", [n for n in POOLED if n in datasets]), ("all", list(datasets))):
            stats = [datasets[n]["modes"].get(mode, {}) for n in names]
            steps = sum(s.get("steps", 0) for s in stats)
            gained = sum(s.get("tau", 0) * s.get("steps", 0) for s in stats)
            pooled.setdefault(label, {})[mode] = gained / steps if steps else None
    return pooled


def variant_row(overrides: list[str], failed: Optional[str], report: Optional[dict], train: dict, modes: list[str],
                pooled_names: list[str], train_wall_s: Optional[float], by_slot: Optional[dict] = None) -> dict:
    """One recipe's line of "Recipes at equal steps": the drafter (architecture, drafts per block, whether DDTree
    applies), training, tau per mode pooled and per dataset (None: the mode does not apply to the drafter), and the
    block walk's conditional acceptance per slot over MT-Bench + ShareGPT with, for a confidence head, its mean
    prediction (`by_slot`: the drafter's entry of acceptance_by_slot.json)."""
    if failed is not None:
        return {"overrides": overrides, "failed": failed}
    row = {"overrides": overrides, "steps": train.get("steps"), "accuracy_mean_last": train.get("accuracy_mean_last"),
           "train_wall_s": train_wall_s, "loop_s": train.get("loop_s"),
           "tau_mt-bench+sharegpt": pooled_tau(report, modes, pooled_names), "tau_all": pooled_tau(report, modes),
           "tau_by_dataset": {ds: {m: (b["modes"][m]["tau"] if m in b["modes"] else None) for m in modes}
                              for ds, b in report["datasets"].items()}}
    if by_slot is not None:
        facts = by_slot["drafter"]
        row.update({k: facts[k] for k in ("architecture", "block_size", "drafts_per_block", "confidence_head")})
        row["tree_not_applicable"] = facts["tree"]
        block = by_slot["modes"]["block"]["pooled"]["mt-bench+sharegpt"]
        row["block_by_slot_mt-bench+sharegpt"] = {k: block[k] for k in ("acceptance", "predicted", "reached")}
        # the steps that accepted every draft: what a block one draft shorter would have cut (tau moves by about
        # this share), for comparisons at unequal drafts per block
        row["every_draft_accepted_mt-bench+sharegpt"] = (block["accepted"][-1] / block["reached"][0]
                                                         if block["reached"][0] else None)
    return row


def drafter_block_size(folder: Path) -> int:
    return int(json.loads((Path(folder) / "config.json").read_text())["block_size"])


def drafter_facts(folder: Path) -> dict:
    """What the comparison reads off an exported drafter, from its config.json alone (the drafter built on the meta
    device, no weights read): its architecture, block size, tokens drafted per block (`Drafter.num_drafts`: B - 1,
    or B where the anchor's slot drafts too), whether it has a confidence head, and why DDTree does not apply to
    it (`tree`: the refusal, None where it applies)."""
    import torch

    from dflash_train.architectures import architecture_of_export
    from dflash_train.infer.replay import tree_refusal

    data = json.loads((Path(folder) / "config.json").read_text())
    arch = architecture_of_export(data)
    with torch.device("meta"):
        drafter = arch.drafter_class(arch.config_from_dict(data))
    return {"architecture": drafter.architecture, "block_size": int(drafter.block_size),
            "drafts_per_block": int(drafter.num_drafts()), "confidence_head": bool(drafter.has_confidence),
            "tree": tree_refusal(drafter)}


def acceptance_by_slot(report: dict, modes: list[str], width: int, pooled_names: list[str]) -> dict:
    """Per mode, the conditional acceptance of each drafted slot (`replay.slot_acceptance`: with the mean predicted
    acceptance of a confidence head, block mode) per dataset and pooled over `pooled_names` and over all sets."""
    from dflash_train.infer.replay import slot_acceptance

    out = {}
    for mode in modes:
        by_ds: dict[str, list[dict]] = {}
        for rec in report["outputs"]:
            by_ds.setdefault(rec["dataset"], []).extend(rec["modes"][mode])
        out[mode] = {"datasets": {ds: slot_acceptance(outs, width) for ds, outs in by_ds.items()},
                     "pooled": {"mt-bench+sharegpt": slot_acceptance([o for ds in pooled_names
                                                                          for o in by_ds.get(ds, [])], width),
                                "all": slot_acceptance([o for outs in by_ds.values() for o in outs], width)}}
    return out



def train_summary(run: Path, last_n: int = 10) -> dict:
    """Steps, loss, accuracy per block position (last record, and the mean of the last `last_n` records:
    each record is one training batch, teacher-forced) and timings of a run directory."""
    from dflash_train.run.metrics import read_metrics

    records = []
    if (run / "metrics.jsonl").is_file():
        for r in read_metrics(run):
            if r.get("kind") != "validation":
                records.append(r)
    out: dict = {"records": len(records)}
    if records:
        last, tail = records[-1], records[-last_n:]
        width = len(last["accuracy_per_position"])
        mean_pos = []
        for k in range(width):
            vals = [r["accuracy_per_position"][k] for r in tail if r["accuracy_per_position"][k] is not None]
            mean_pos.append(sum(vals) / len(vals) if vals else None)
        out.update({
            "steps": last["step"], "epoch": last["epoch"], "loss": last["loss"], "accuracy": last["accuracy"],
            "tau_estimate": last["tau_estimate"],
            "tau_estimate_mean_last": sum(r["tau_estimate"] for r in tail) / len(tail),
            "accuracy_mean_last": sum(r["accuracy"] for r in tail) / len(tail),
            "accuracy_per_position": last["accuracy_per_position"],
            "accuracy_per_position_mean_last": mean_pos, "mean_over_last_records": len(tail),
            "tokens_per_s_mean": sum(r["tokens_per_s"] for r in records) / len(records),
        })
    status = run / "status.json"
    if status.is_file():
        st = json.loads(status.read_text())
        out["warmup_s"] = st.get("warmup_s")
        out["phase"] = st.get("phase")
    log = run / "train.log"
    if log.is_file():
        loops = re.findall(r"done: (\d+) steps in (\d+) s", log.read_text(errors="replace"))
        if loops:
            out["loop_s"] = float(loops[-1][1])
    return out


def _mean(values) -> Optional[float]:
    vals = [v for v in values or [] if v is not None]
    return sum(vals) / len(vals) if vals else None


def _fmt(v, nd=3) -> str:
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def _share(v: Optional[float]) -> str:
    return "-" if v is None else f"{100 * v:.3f}%"


def summary_markdown(s: dict) -> str:
    ev, tr = s["eval"], s["train"]
    modes = [m for m in next(iter(ev["datasets"].values()), {}).get("modes", {}) if m != "target"] if ev["datasets"] else []
    lines = ["# DFlash drafter quality", ""]
    if not s["complete"]:
        lines += ["**Incomplete**: some prompts are still to decode (run the same command again).", ""]
    ref = s["reference"]
    dr = s.get("drafter") or {}
    if "train_rows" in s["data"]:
        regen = s["data"].get("regen")
        made = (f", regenerated by the target from the first {regen['conversations'] + regen['rejected']} "
                f"conversations of the built-in ShareGPT training split (greedy, {regen['max_new_tokens']} new tokens "
                f"a turn; {regen['rejected']} rejected)") if regen else f" from `{s['data'].get('file')}`"
        ours = (f"Ours: `{s['config']}` {' '.join(s['overrides'])}; data {s['data']['train_rows']} training rows "
                f"({s['data']['rows_read']} read){made}.")
    else:
        ours = f"Ours: the drafter below, target from `{s['config']}`{''.join(' ' + o for o in s['overrides'])}."
    filtered = ("all prompts after dropping training prompts" if ev["settings"].get("overlap_filter_data", True)
                else "all prompts (NOT filtered against training prompts: the training file was not given)")
    lines += [f"Reference: {ref['trainer']}, {ref['recipe']}: tau ~{ref['tau']} ({ref['tau_on']}).",
              f"{ours} Eval: greedy, {ev['settings']['max_new_tokens']} new tokens, "
              f"{ev['settings']['dtype']}"
              + (", the target in FP8 (every decoder layer, as served)"
                 if ev["settings"].get("target_quantize", "none") == "fp8" else "")
              + f", {filtered}.", ""]
    if dr:
        origin = [f"model sha256 {dr['model_sha256'][:16]}..."]
        if dr.get("exported_from"):
            origin.append(f"exported from `{dr['exported_from']}`")
        tr_cfg = dr.get("training") or {}
        if tr_cfg.get("max_steps"):
            origin.append(f"{tr_cfg['max_steps']} steps on {tr_cfg.get('train_files')}")
        lines += [f"Drafter: {dr['source']}: `{dr['path']}` ({'; '.join(origin)}).", ""]
    lines += [
              "| dataset | prompts (turns) | dropped as training prompts (exact / prefix) | "
              + " | ".join(f"tau {m}" for m in modes) + " | tokens (block) |",
              "|---|---|---|" + "---|" * len(modes) + "---|"]
    for name, d in ev["datasets"].items():
        taus = " | ".join(_fmt(d["modes"].get(m, {}).get("tau")) for m in modes)
        lines.append(f"| {name} | {d['prompts_done']}/{d['prompts']} ({d['turns']}) | {d['dropped_overlap']['exact']} / "
                     f"{d['dropped_overlap']['prefix']} | {taus} | {d['modes'].get('block', {}).get('tokens', '-')} |")
    for label, taus in ev["pooled_tau"].items():
        lines.append(f"| pooled: {label} | | | " + " | ".join(_fmt(taus.get(m)) for m in modes) + " | |")
    lines += ["", f"Reference tau ~{ref['tau']} compares with the pooled mt-bench+sharegpt block tau.", ""]
    if tr.get("accuracy_per_position"):
        width = len(tr["accuracy_per_position"])
        lines += ["## Accuracy per block position (training, teacher-forced)", "",
                  "| | " + " | ".join(str(k + 1) for k in range(width)) + " |",
                  "|---|" + "---|" * width,
                  f"| step {tr['steps']} | " + " | ".join(_fmt(a, 2) for a in tr["accuracy_per_position"]) + " |",
                  f"| mean of last {tr['mean_over_last_records']} records | "
                  + " | ".join(_fmt(a, 2) for a in tr["accuracy_per_position_mean_last"]) + " |", "",
                  f"Final loss {_fmt(tr['loss'])}, accuracy {_fmt(tr['accuracy'])}, tau estimate "
                  f"{_fmt(tr['tau_estimate'])} (mean of last records {_fmt(tr['tau_estimate_mean_last'])}), "
                  f"{_fmt(tr['tokens_per_s_mean'], 0)} target tokens/s.", ""]
    w = s["wall_s"]
    lines += ["## Wall time", ""]
    if w.get("regen_s") is not None:
        lines.append(f"- data (regen): {_fmt(w.get('regen_s'), 1)} s")
    lines += [f"- prepare: {_fmt(w.get('prepare_s'), 1)} s",
              f"- train: {_fmt(w.get('train_s'), 1)} s for the training process(es) (target load, compile warm-up "
              f"{_fmt(tr.get('warmup_s'), 1)} s, loop {_fmt(tr.get('loop_s'), 1)} s); reference ~{ref['train_wall_s']} s",
              (f"- eval by replay: {_fmt(w.get('corpus_s'), 1)} s for the target's greedy continuations, "
               f"{_fmt(w.get('replay_s'), 1)} s to replay every drafter"
               + (f"; real decoding of the check prompts {_fmt(w.get('eval_s'), 1)} s" if s.get("decode_check") else "")
               if s.get("method") == "replay" else
               f"- eval: {_fmt(w.get('eval_s'), 1)} s with {ev['settings']['workers']} parallel workers "
               f"({_fmt(ev['worker_prompt_s'], 1)} s of per-prompt decoding summed over workers)"), ""]
    lines += replay_markdown(s, modes)
    hist_mode = "block"
    lines += [f"## Accepted tokens per step ({hist_mode})", ""]
    for name, d in ev["datasets"].items():
        hist = d["modes"].get(hist_mode, {}).get("histogram", {})
        lines.append(f"- {name}: " + ", ".join(f"{k}: {v}" for k, v in hist.items()))
    return "\n".join(lines) + "\n"


def replay_markdown(s: dict, modes: list[str]) -> list[str]:
    """The sections only a replay run has: the method, the variants, the curve, the check against decoding."""
    if s.get("method") != "replay":
        return []
    lines = ["## Method", "",
             "Tau by replay (`dflash_train.infer.replay`): the target's greedy continuation of every prompt, then "
             "every step's acceptance from one drafter pass; equal to real greedy speculative decoding up to "
             "floating-point ties (see the check below). Positions where the full-sequence target pass disagrees "
             f"with the batched greedy continuation: {s.get('argmax_mismatches')}.", ""]
    lines += variants_markdown(s.get("variants") or {}, modes)
    lines += truncation_markdown(s.get("confidence_truncation"))
    lines += reranker_markdown(s.get("reranker"))
    if s.get("curve"):
        lines += ["## Tau against training time (default recipe)", "",
                  "| step | train s after the first logged step | " + " | ".join(f"tau {m} (MT-Bench+ShareGPT)" for m in modes)
                  + " | " + " | ".join(f"tau {m} (all)" for m in modes) + " |",
                  "|---|---|" + "---|" * (2 * len(modes))]
        for c in s["curve"]:
            lines.append(f"| {c['step']} | {_fmt(c['train_s_after_first_log'], 1)} | "
                         + " | ".join(_fmt(c["tau_mt-bench+sharegpt"].get(m)) for m in modes) + " | "
                         + " | ".join(_fmt(c["tau_all"].get(m)) for m in modes) + " |")
        lines.append("")
    check = s.get("decode_check")
    if check:
        lines += ["## Check: real speculative decoding of the first prompts of each set", "",
                  f"{check['prompts']} prompts ({check['per_dataset']}) decoded step by step with each drafter, the "
                  "default's with the target alone too, and compared with their replay turn by turn (identical tokens "
                  "are the target's greedy output: replay reads it).", "",
                  "| drafter | mode | turns | identical tokens | identical accept lengths | tau decoded | tau replayed "
                  "| outputs differing from the target alone |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, c in check["drafters"].items():
            for m, a in c["agreement"].items():
                lines.append(f"| {name} | {m} | {a['turns']} | {a['identical_tokens']} | {a['identical_accept_lengths']} | "
                             f"{_fmt(a['tau_decoded'])} | {_fmt(a['tau_replayed'])} | {_fmt(c['lossless_mismatches'])} |")
        lines += ["", "| dataset (default drafter) | " + " | ".join(f"speedup {m}" for m in modes)
                  + " | target alone tok/s |", "|---|" + "---|" * (len(modes) + 1)]
        for ds, sp in check["speedup"].items():
            lines.append(f"| {ds} | " + " | ".join(f"{_fmt(sp.get(m), 2)}x" if sp.get(m) else "-" for m in modes)
                         + f" | {_fmt(check['decode_tokens_per_s'][ds].get('target'), 1)} |")
        lines.append("")
    return lines


def truncation_markdown(section: Optional[dict]) -> list[str]:
    """--confidence-thresholds: tau and tokens verified per step of block decoding truncated at each threshold, per
    drafter with a confidence head, beside untruncated block decoding."""
    if not section:
        return []
    lines = ["## Confidence truncation (block)", "",
             "Each step verifies only the drafts before the first whose predicted acceptance is below the threshold "
             "(eval --confidence-threshold; lossless). Verified per step: the anchor and the drafts the target "
             "checks (eval's verified_per_step).", "",
             "| drafter | threshold | tau (MT-Bench+ShareGPT) | tau (all) | verified per step (MT-Bench+ShareGPT) "
             "| verified per step (all) |", "|---|---|---|---|---|---|"]
    for name, d in section["drafters"].items():
        for row in d["modes"].values():
            lines.append(f"| {name} | {'none' if row['threshold'] is None else format(row['threshold'], 'g')} | "
                         f"{_fmt(row['tau_mt-bench+sharegpt'])} | {_fmt(row['tau_all'])} | "
                         f"{_fmt(row['verified_per_step_mt-bench+sharegpt'], 2)} | {_fmt(row['verified_per_step_all'], 2)} |")
    if not section["drafters"]:
        lines.append("| (no drafter with a confidence head) | | | | | |")
    return lines + [""]


def reranker_markdown(section: Optional[dict]) -> list[str]:
    """Block tau of each reranking drafter's drafts beside its backbone's argmax drafts, pooled and per dataset."""
    if not section:
        return []
    datasets = list(dict.fromkeys(ds for d in section.values() for row in d.values() for ds in row["datasets"]))
    lines = ["## Reranker against the backbone's argmax (block)", "",
             "The same drafter's block tau with its own drafts (DFlash2's selector, LiLiCorr's walk) and with its "
             "backbone's argmax at every slot, on the same turns.", "",
             "| drafter | drafts | tau (MT-Bench+ShareGPT) | tau (all) | " + " | ".join(datasets) + " |",
             "|---|---|---|---|" + "---|" * len(datasets)]
    for name, d in section.items():
        for mode, row in d.items():
            lines.append(f"| {name} | {'reranked' if mode == 'block' else 'argmax'} | "
                         f"{_fmt(row['tau_mt-bench+sharegpt'])} | {_fmt(row['tau_all'])} | "
                         + " | ".join(_fmt(row["datasets"].get(ds)) for ds in datasets) + " |")
    return lines + [""]


def variants_markdown(variants: dict, modes: list[str]) -> list[str]:
    """The recipes side by side (more than one): drafter, training, tau per mode pooled and per dataset ("n/a"
    where a mode does not apply), conditional acceptance per slot, and the confidence heads' calibration."""
    if len(variants) < 2:
        return []
    ok = {n: v for n, v in variants.items() if "failed" not in v}

    def tau(v: dict, taus: dict, m: str) -> str:
        return "n/a" if m.startswith("tree-") and v.get("tree_not_applicable") else _fmt(taus.get(m))

    lines = ["## Recipes at equal steps", "",
             "| recipe | architecture | drafts per block | overrides | steps | train wall s | train accuracy | "
             + " | ".join(f"tau {m} (MT-Bench+ShareGPT)" for m in modes) + " | "
             + " | ".join(f"tau {m} (all)" for m in modes) + " | block steps accepting every draft |",
             "|---|---|---|---|---|---|---|" + "---|" * (2 * len(modes) + 1)]
    for name, v in variants.items():
        if "failed" in v:
            lines.append(f"| {name} | | | {' '.join(v['overrides'])} | training failed: {v['failed']} |")
            continue
        lines.append(f"| {name} | {v.get('architecture', '-')} | {_fmt(v.get('drafts_per_block'))} | "
                     f"{' '.join(v['overrides']) or '-'} | {_fmt(v['steps'])} | {_fmt(v['train_wall_s'], 1)} | "
                     f"{_fmt(v['accuracy_mean_last'])} | "
                     + " | ".join(tau(v, v["tau_mt-bench+sharegpt"], m) for m in modes) + " | "
                     + " | ".join(tau(v, v["tau_all"], m) for m in modes) + " | "
                     + _share(v.get("every_draft_accepted_mt-bench+sharegpt")) + " |")
    lines += ["", "Drafts per block: the tokens one step drafts (DFlash-family blocks of B slots draft B - 1, DSpark's "
              "B); compare recipes at equal drafts per block for equal verification width. Block steps accepting "
              "every draft (MT-Bench + ShareGPT): the share of steps a block one draft shorter would have cut short, "
              "about what one more or one less draft moves tau by. Train wall s: the "
              "training processes of this comparison shared the GPU(s) (the default had its own where there were "
              "several); compare tau at equal steps, not wall times. n/a: the drafter refuses DDTree.", ""]
    sets = list(dict.fromkeys(ds for v in ok.values() for ds in v["tau_by_dataset"]))
    if sets:
        lines += ["### Tau per dataset (" + " / ".join(modes) + ")", "",
                  "| recipe | " + " | ".join(sets) + " |", "|---|" + "---|" * len(sets)]
        for name, v in ok.items():
            lines.append(f"| {name} | " + " | ".join(" / ".join(tau(v, v["tau_by_dataset"].get(ds, {}), m) for m in modes)
                                                    for ds in sets) + " |")
        lines.append("")
    slots = {n: v["block_by_slot_mt-bench+sharegpt"] for n, v in ok.items() if v.get("block_by_slot_mt-bench+sharegpt")}
    if slots:
        width = max(len(t["acceptance"]) for t in slots.values())
        lines += ["### Conditional acceptance per drafted slot (block, MT-Bench + ShareGPT)", "",
                  "The share of the steps that reached a slot (every draft before it accepted) that accepted it too.",
                  "", "| recipe | " + " | ".join(str(k + 1) for k in range(width)) + " |", "|---|" + "---|" * width]
        for name, t in slots.items():
            lines.append(f"| {name} | " + " | ".join(_fmt(t["acceptance"][k], 2) if k < len(t["acceptance"]) else ""
                                                    for k in range(width)) + " |")
        lines.append("")
        calibrated = {n: t for n, t in slots.items() if t.get("predicted")}
        if calibrated:
            lines += ["### Confidence head calibration (block, MT-Bench + ShareGPT)", "",
                      "Per drafted slot: the mean predicted acceptance (the confidence head's sigmoid) over the steps "
                      "that reached the slot, against the acceptance measured there (above); steps: how many reached "
                      "it.", "", "| recipe | | " + " | ".join(str(k + 1) for k in range(width)) + " |",
                      "|---|---|" + "---|" * width]
            for name, t in calibrated.items():
                for label, key, nd in (("predicted", "predicted", 2), ("measured", "acceptance", 2), ("steps", "reached", 0)):
                    vals = t[key]
                    lines.append(f"| {name} | {label} | " + " | ".join(
                        (_fmt(vals[k], nd) if nd else str(vals[k])) if k < len(vals) else "" for k in range(width)) + " |")
            lines.append("")
    return lines
