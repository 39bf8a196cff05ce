"""DFlash's, DSpark's and Domino's training steps at one workload (throughput.py's defaults: the Qwen3-8B shape,
4 x 2048 tokens, block 16, 512 anchors a row, target and drafter compiled), one process each, in sequence sharing
one inductor cache (the target's and the drafter layers' graphs compile once); a table last.

    PYTHONPATH=src python benchmarks/family_steps.py [--cache-dir DIR] [--variant NAME=ARCH[,KEY=VALUE...]]
        [-- THROUGHPUT_ARGS...]

`--variant dspark-dpard=dspark,dspark.loss=dpard` measures one more process
of that architecture with those run-config overrides, after the `--architectures`.

The goal it checks: each architecture's step within 15% of DFlash's (`BUDGET`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

BUDGET = 1.15
THROUGHPUT = Path(__file__).with_name("throughput.py")


def parse_variant(spec: str) -> tuple[str, str, list[str]]:
    """`NAME=ARCH[,KEY=VALUE...]` -> (name, architecture, overrides)."""
    name, sep, rest = spec.partition("=")
    parts = rest.split(",")
    if not sep or not name or not parts[0] or any("=" not in o for o in parts[1:]):
        raise SystemExit(f"--variant {spec!r}: expected NAME=ARCHITECTURE[,KEY=VALUE...]")
    return name, parts[0], parts[1:]


def run(architecture: str, cache: str, repeat: int, out: Path, timeout: int, extra: list[str],
        name: Optional[str] = None, overrides: Sequence[str] = ()) -> bool:
    """One throughput.py process for `architecture` (with run-config `overrides`, its result named `name`), its
    result line appended to `out`."""
    sets = [a for o in overrides for a in ("--set", o)]
    cmd = [sys.executable, str(THROUGHPUT), "--compile-target", "--compile-drafter", "--repeat", str(repeat),
           "--cache-dir", cache, "--architecture", architecture, "--label", name or architecture, *sets,
           "--json", str(out), *extra]
    env = {**os.environ, "BENCH_START_TS": f"{time.time():.6f}"}
    try:
        return subprocess.run(cmd, env=env, timeout=timeout).returncode == 0
    except subprocess.TimeoutExpired:
        print(f"{name or architecture}: no result within {timeout} s", file=sys.stderr)
        return False


def table(results: list[dict]) -> str:
    base = next((r for r in results if r["architecture"] == "dflash"), None)
    head = ("| architecture | step s | vs DFlash | target / drafter s | drafter - DFlash's s | step MFU | peak GiB "
            "(preflight) | first step s |")
    lines = [head, "|" + "---|" * 8]
    for r in results:
        ratio = f"{r['step_s'] / base['step_s']:.2f}x" if base else "-"
        extra = f"{r['drafter_s'] - base['drafter_s']:+.3f}" if base else "-"
        lines.append(f"| {r.get('name', r['architecture'])} | {r['step_s']:.3f} | {ratio} | {r['target_s']:.3f} / "
                     f"{r['drafter_s']:.3f} | {extra} | {r['step_mfu']:.0%} | {r['peak_mem_gib']} "
                     f"({r['preflight_estimate_gib']}) | {r['first_step_s']} |")
    if base:
        within = [r.get("name", r["architecture"]) for r in results if r["step_s"] <= BUDGET * base["step_s"]]
        lines.append(f"budget: step <= {BUDGET} x DFlash's = {BUDGET * base['step_s']:.3f} s; within: "
                     f"{', '.join(within)}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-dir", default=None, help="the inductor cache the three processes share (default: new)")
    ap.add_argument("--architectures", default="dflash,dspark,domino")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARCH[,KEY=VALUE...]",
                    help="one more process: that architecture with these run-config overrides (repeat)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=240, help="seconds each process may take")
    ap.add_argument("extra", nargs="*", help="more throughput.py arguments (after --)")
    args = ap.parse_args()
    cache = args.cache_dir or tempfile.mkdtemp(prefix="family-steps-cache-")
    out = Path(tempfile.mkdtemp(prefix="family-steps-")) / "results.jsonl"
    started = time.time()
    variants = [parse_variant(v) for v in args.variant]
    for architecture in args.architectures.split(","):
        run(architecture, cache, args.repeat, out, args.timeout, args.extra)
    for name, architecture, overrides in variants:
        run(architecture, cache, args.repeat, out, args.timeout, args.extra, name, overrides)
    results = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    for r in results:  # what each step's counted FLOPs are made of (train/loop/flops.py), TFLOP
        print(f"{r.get('name', r['architecture'])}: drafter TFLOP {r['drafter_tflop_parts']}, counted rows {r['counted_rows']}, "
              f"target positions {r['target_positions']}")
    wanted = len(args.architectures.split(",")) + len(variants)
    print(f"{len(results)} of {wanted} measured in {time.time() - started:.0f} s "
          f"(results: {out})")
    print(table(results))
    if len(results) < wanted:
        sys.exit(1)


if __name__ == "__main__":
    main()
