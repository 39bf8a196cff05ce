"""The `dflash-train` command (also `python -m dflash_train`)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from .config import ConfigError, config_from_dict, load_config

log = logging.getLogger("dflash_train")

# The demo: the embedded default target and built-in ShareGPT conversations, sized for a 2-core CPU.
DEMO_CONFIG = {
    "target": {"path": "smollm2"},
    "drafter": {"num_draft_layers": 2, "block_size": 8, "attention_backend": "auto"},
    "data": {"train_files": ["sharegpt"], "max_samples": 600, "max_length": 384, "token_budget": 1536, "max_batch_size": 4},
    "objective": {"max_anchors": 48, "gamma": 4.0},
    # ~4 s per step on a 2-core CPU: 150 steps keep the demo near 10 minutes.
    "optim": {"lr": 1e-3, "epochs": 1.0, "max_steps": 150, "warmup_ratio": 0.05},
    "run": {"log_every": 5, "save_every": 50},
}


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def _default_run_dir(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def cmd_train(args: argparse.Namespace) -> int:
    from .train.trainer import train

    cfg = load_config(args.config, args.overrides)
    run_dir = Path(args.run_dir) if args.run_dir else _default_run_dir(Path(args.config).stem)
    print(f"run directory: {run_dir}  (watch it with: dflash-train status {run_dir})", flush=True)
    export = train(cfg, run_dir, max_steps=args.max_steps)
    print(f"exported drafter: {export}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from .rundir import format_status, read_status

    status, last = read_status(args.run_dir)
    print(format_status(status, last))
    return 1 if status.get("phase") == "failed" else 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .train.trainer import train

    cfg = config_from_dict(DEMO_CONFIG, args.overrides)
    run_dir = Path(args.run_dir)
    print(f"demo: training a DFlash drafter for SmolLM2-135M-Instruct on ShareGPT conversations -> {run_dir}", flush=True)
    t0 = time.time()
    export = train(cfg, run_dir, max_steps=args.max_steps)
    print(f"\ndemo finished in {time.time() - t0:.0f} s")
    print(f"  run directory:    {run_dir}   (dflash-train status {run_dir})")
    print(f"  exported drafter: {export}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-train", description="Train DFlash speculative-decoding drafters.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a drafter (one process: CPU, or one GPU with target and drafter colocated)")
    t.add_argument("config", help="YAML config (see configs/)")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-4 data.max_length=2048")
    t.add_argument("--run-dir", help="run directory (default runs/<config>-<time>)")
    t.add_argument("--max-steps", type=int, default=None, help="stop after N optimizer steps")
    t.set_defaults(func=cmd_train)

    s = sub.add_parser("status", help="phase, step, tokens/s, loss, accuracy, ETA, heartbeat and last error of a run")
    s.add_argument("run_dir")
    s.set_defaults(func=cmd_status)

    d = sub.add_parser("demo", help="train a drafter for the embedded default target (SmolLM2-135M) on CPU or GPU")
    d.add_argument("overrides", nargs="*", help="dotted overrides of the demo config")
    d.add_argument("--run-dir", default="runs/demo")
    d.add_argument("--max-steps", type=int, default=None)
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come before or after options (`train c.yaml --max-steps 5 optim.lr=1e-3`).
    args, extra = parser.parse_known_args(argv)
    stray = [e for e in extra if e.startswith("-") or "=" not in e or not hasattr(args, "overrides")]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    _setup_logging(args.verbose)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
