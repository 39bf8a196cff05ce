"""Tau and verified tokens pooled over datasets and modes, DSpark's confidence truncation, a reranker against its
backbone's argmax, replay against decoding."""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def pooled_per_step(report: dict, modes: list[str], names: Optional[list[str]] = None,
                    field: str = "tau") -> dict[str, Optional[float]]:
    """A per-step mean (`field` of each dataset's mode: `tau`, `verified_per_step`) per mode over the steps of the
    named datasets (all when None) of a report; a dataset whose mode has no such value does not count."""
    out = {}
    for mode in modes:
        steps = total = 0.0
        for name, body in report["datasets"].items():
            s = body["modes"].get(mode)
            if (names is None or name in names) and s and s.get(field) is not None:
                steps += s["steps"]
                total += s[field] * s["steps"]
        out[mode] = total / steps if steps else None
    return out


def pooled_tau(report: dict, modes: list[str], names: Optional[list[str]] = None) -> dict[str, Optional[float]]:
    """Tau per mode over the steps of the named datasets (all when None) of a report."""
    return pooled_per_step(report, modes, names)


def pooled_verified(report: dict, modes: list[str], names: Optional[list[str]] = None) -> dict[str, Optional[float]]:
    """Tokens verified per step (`verified_per_step`) per mode over the steps of the named datasets (all when None)."""
    return pooled_per_step(report, modes, names, "verified_per_step")


def confidence_truncation(report: dict, truncated: dict, thresholds: tuple, drafts: int,
                          pooled_names: list[str]) -> dict:
    """One drafter's lines of the confidence truncation table: untruncated block decoding (every step verifies the
    anchor and all `drafts`: `report`, the drafter's replay report) and block decoding truncated at each threshold
    (`truncated`: its report of the `block-conf-C` modes), tau and tokens verified per step (`replay.verified_lengths`:
    the anchor and the drafts the target checks, eval's `verified_per_step`), pooled over MT-Bench + ShareGPT and all."""
    from dflash_train.infer.replay import confidence_mode

    rows = {"block": {"threshold": None, "tau_mt-bench+sharegpt": pooled_tau(report, ["block"], pooled_names)["block"],
                      "tau_all": pooled_tau(report, ["block"])["block"],
                      "verified_per_step_mt-bench+sharegpt": 1.0 + drafts, "verified_per_step_all": 1.0 + drafts}}
    for c in thresholds:
        mode = confidence_mode(c)
        rows[mode] = {"threshold": c, "tau_mt-bench+sharegpt": pooled_tau(truncated, [mode], pooled_names)[mode],
                      "tau_all": pooled_tau(truncated, [mode])[mode],
                      "verified_per_step_mt-bench+sharegpt": pooled_verified(truncated, [mode], pooled_names)[mode],
                      "verified_per_step_all": pooled_verified(truncated, [mode])[mode]}
    return {"drafts_per_block": drafts, "modes": rows}


def reranker_rows(report: dict, plain: dict, pooled_names: list[str]) -> dict:
    """One drafter's lines of the reranker table: block tau of its drafts (`report`, its replay report) and of its
    backbone's argmax drafts (`plain`: its report of `replay.ARGMAX_MODE`), pooled over MT-Bench + ShareGPT and all,
    and per dataset."""
    from dflash_train.infer.replay import ARGMAX_MODE

    return {mode: {"tau_mt-bench+sharegpt": pooled_tau(rep, [mode], pooled_names)[mode],
                   "tau_all": pooled_tau(rep, [mode])[mode],
                   "datasets": {ds: body["modes"][mode]["tau"] for ds, body in rep["datasets"].items()
                                if mode in body["modes"]}}
            for mode, rep in (("block", report), (ARGMAX_MODE, plain))}


def compare_with_decoding(decoded: dict[str, dict], replayed: dict[str, dict], modes: list[str]) -> dict:
    """Real decoding against replay, turn by turn, for the prompts decoded: how many turns have identical
    tokens and identical accept lengths, per mode, and the tau each way over those turns."""
    out = {}
    for mode in modes:
        turns = same_tokens = same_accepts = 0
        acc_dec: list[int] = []
        acc_rep: list[int] = []
        first_diff = []
        for key, drec in decoded.items():
            rrec = replayed.get(key)
            if rrec is None or mode not in drec["modes"]:
                continue
            for t, (d, r) in enumerate(zip(drec["modes"][mode], rrec["modes"][mode])):
                turns += 1
                same_tokens += d["token_ids"] == r["token_ids"]
                same_accepts += d["accept_lengths"] == r["accept_lengths"]
                if d["accept_lengths"] != r["accept_lengths"] and len(first_diff) < 5:
                    first_diff.append({"prompt": key.replace("\x00", "/"), "turn": t})
                acc_dec += d["accept_lengths"]
                acc_rep += r["accept_lengths"]
        out[mode] = {"turns": turns, "identical_tokens": same_tokens, "identical_accept_lengths": same_accepts,
                     "tau_decoded": sum(acc_dec) / len(acc_dec) if acc_dec else None,
                     "tau_replayed": sum(acc_rep) / len(acc_rep) if acc_rep else None, "differing": first_diff}
    return out


def metric_times(run: Path) -> dict[int, float]:
    """Step -> seconds of training after the first logged step (metrics `time` stamps)."""
    from dflash_train.run.metrics import read_metrics

    if not (run / "metrics.jsonl").is_file():
        return {}
    recs = [r for r in read_metrics(run) if r.get("kind") != "validation" and "time" in r]
    if not recs:
        return {}
    t0 = recs[0]["time"]
    return {r["step"]: r["time"] - t0 for r in recs}
