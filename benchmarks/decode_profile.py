#!/usr/bin/env python3
"""Where a speculative decoding step spends its time: target forward, drafter forward, lm_head, cache
trimming, tree building, and the rest (Python bookkeeping, host syncs), per mode.

Wraps the `SpeculativeDecoder` methods of one process with timers (a CUDA sync around each region on a
GPU, so regions are attributed to the kernels they launch; that adds syncs of its own: compare the
total with and without `--no-sync`). Decoding output is unchanged by the timers.

    PYTHONPATH=src python benchmarks/decode_profile.py --target smollm2 --max-new-tokens 64 --prompts 2
    PYTHONPATH=src python benchmarks/decode_profile.py --drafter runs/quality/run/export --device cuda \\
        --max-new-tokens 256 --prompts 4 --dtype bfloat16 --json $OUT/profile.json

Without `--drafter`, an untrained drafter of the reference shape (5 layers, block 16) is used: it accepts
~1 token per step, so the per-step costs are those of a real drafter, the tokens per step are not.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402


class Timers:
    """Inclusive and exclusive time per region; a region's name is its path ("decode/target/lm_head")."""

    def __init__(self, device: torch.device, sync: bool = True):
        self.device, self.sync = device, sync and device.type == "cuda"
        self.incl: dict[str, float] = defaultdict(float)
        self.excl: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.stack: list[list] = []  # [path, child time]

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            path = (self.stack[-1][0] + "/" if self.stack else "") + name
            self.stack.append([path, 0.0])
            t0 = self._now()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = self._now() - t0
                _, child = self.stack.pop()
                self.incl[path] += dt
                self.excl[path] += dt - child
                self.calls[path] += 1
                if self.stack:
                    self.stack[-1][1] += dt

        return timed

    def reset(self) -> None:
        self.incl.clear(), self.excl.clear(), self.calls.clear()


def instrument(dec, timers: Timers) -> None:
    import dflash_train.infer.spec_decode as sd

    dec._prefill = timers.wrap("prefill", dec._prefill)
    dec._target = timers.wrap("target", dec._target)
    dec._draft_hidden = timers.wrap("draft", dec._draft_hidden)
    dec.drafter.forward = timers.wrap("drafter", dec.drafter.forward)
    dec.lm_head.forward = timers.wrap("lm_head", dec.lm_head.forward)
    dec.embed.forward = timers.wrap("embed", dec.embed.forward)
    dec.build_tree_from_top = timers.wrap("tree_build", dec.build_tree_from_top)
    dec._tree_mask = timers.wrap("tree_mask", dec._tree_mask)
    for name in ("trim_cache", "select_cache", "accept_tree_path"):
        if hasattr(sd, name):
            setattr(sd, name, timers.wrap("cache_cut", getattr(sd, name)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", help="exported drafter folder (default: an untrained 5-layer, block-16 drafter)")
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=2, help="first turns of the first N MT-Bench prompts")
    p.add_argument("--min-prompt-tokens", type=int, default=0,
                   help="repeat each prompt's text until the templated prompt has this many tokens (long contexts)")
    p.add_argument("--modes", default="block,tree-32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave)")
    p.add_argument("--warmup", type=int, default=1, help="untimed decodes first (the first prompt)")
    p.add_argument("--no-sync", action="store_true", help="no CUDA sync around regions")
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args(argv)

    from dflash_train import assets
    from dflash_train.data.chat import prompt_ids
    from dflash_train.infer.evaluate import iter_prompts
    from dflash_train.infer.spec_decode import SpeculativeDecoder
    from dflash_train.architectures.dflash.model import DFlashDrafter
    from dflash_train.architectures.family.config import make_drafter_config
    from dflash_train.architectures.io import load_drafter
    from dflash_train.target.capture import load_target_model, load_tokenizer
    from dflash_train.assets import stop_token_ids

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    tpath = assets.resolve_target(args.target)
    target = load_target_model(tpath, dtype, device)
    tok = load_tokenizer(tpath)
    if args.drafter:
        drafter = load_drafter(args.drafter, device=device, dtype=dtype)
    else:
        torch.manual_seed(0)
        n = target.config.num_hidden_layers
        from dflash_train.architectures.drafter import default_target_layer_ids

        drafter = DFlashDrafter(make_drafter_config(target.config, num_draft_layers=args.layers, block_size=args.block_size,
                                                    target_layer_ids=default_target_layer_ids(n, 5),
                                                    mask_token_id=16)).to(device, dtype)
    stops = stop_token_ids(tpath, tok)
    dec = SpeculativeDecoder(target, drafter, stops)
    prompts = []
    for item in iter_prompts("mt-bench", args.prompts):
        user = item["turns"][0]
        while True:
            ids = prompt_ids(tok, [{"role": "user", "content": user}])
            if len(ids) >= args.min_prompt_tokens:
                break
            user += "\n\n" + item["turns"][0]
        prompts.append(ids)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]

    def run(mode, prompt):
        if mode == "block":
            return dec.generate_block(prompt, args.max_new_tokens)
        if mode == "target":
            return dec.generate_target_only(prompt, args.max_new_tokens)
        return dec.generate_tree(prompt, args.max_new_tokens, int(mode.split("-")[1]))

    with torch.no_grad():
        for _ in range(args.warmup):
            for mode in modes:
                run(mode, prompts[0])
    timers = Timers(device, not args.no_sync)
    instrument(dec, timers)
    results = {"device": str(device), "dtype": args.dtype, "threads": torch.get_num_threads(),
               "max_new_tokens": args.max_new_tokens, "prompt_tokens": [len(x) for x in prompts], "modes": {}}
    for mode in modes:
        timers.reset()
        steps = decode_s = prefill_s = 0.0
        tokens, outs = 0, []
        t_wall = time.perf_counter()
        with torch.no_grad():
            for prompt in prompts:
                timers.stack.clear()
                r = run(mode, prompt)
                steps += len(r.accept_lengths)
                decode_s += r.decode_s
                prefill_s += r.prefill_s
                tokens += len(r.tokens)
                outs.append(r.tokens)
        wall = time.perf_counter() - t_wall
        decode = {k: v for k, v in timers.excl.items() if not k.startswith("prefill")}
        accounted = sum(decode.values())
        per_step = {k: 1000 * v / steps for k, v in sorted(decode.items(), key=lambda kv: -kv[1])}
        per_step["other (bookkeeping)"] = 1000 * (decode_s - accounted) / steps
        results["modes"][mode] = {
            "steps": int(steps), "tokens": tokens, "tau": tokens / steps if steps else None,
            "decode_s": round(decode_s, 3), "prefill_s": round(prefill_s, 3), "wall_s": round(wall, 3),
            "ms_per_step": round(1000 * decode_s / steps, 2),
            "ms_per_step_exclusive": {k: round(v, 2) for k, v in per_step.items()},
            "prefill_ms_exclusive": {k: round(1000 * v / len(prompts), 1) for k, v in timers.excl.items()
                                     if k.startswith("prefill")},
            "calls": dict(timers.calls),
            "token_ids": outs,
        }
        m = results["modes"][mode]
        print(f"\n{mode}: {m['steps']} steps, {tokens} tokens, {m['ms_per_step']:.1f} ms/step decode, "
              f"prefill {1000 * prefill_s / len(prompts):.0f} ms/prompt, wall {wall:.1f} s")
        for k, v in m["ms_per_step_exclusive"].items():
            print(f"  {k:32s} {v:8.2f} ms/step")
        for k, v in m["prefill_ms_exclusive"].items():
            print(f"  {k:32s} {v:8.1f} ms/prompt")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
