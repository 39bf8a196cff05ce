"""The `dflash-train` command (also `python -m dflash_train`): every parser, and the commands they run.

A command imports what it runs inside its function: `status` and `stop` start in a fraction of a
second, and importing torch alone takes 1.7 s (measured on the 2-core CPU machine).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import select
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

from .architectures import registry
from .config.validate import validate_world
from .data.dataset import FAR_FACTOR
from .data.formats import BUILTIN_SOURCES
from .data.regen.inputs import ENGINES
from .errors import EXIT_DONE, EXIT_FAILED, EXIT_STOPPED, EXIT_USER_ERROR, USER_ERRORS, UserError, debug_enabled
from .numbers import (ALL_IF_ZERO, BLOCK_SIZE, FRACTION, INDEX, NO_BOUND_IF_ZERO, POSITIVE_INT, POSITIVE_NUMBER, SEED,
                      TEMPERATURE, TOP_P, TREE_BUDGET, VAL_FRACTION)

log = logging.getLogger("dflash_train")


def parse_bool(value: str) -> bool:
    """The argparse type of every true|false option: true/false, 1/0 or yes/no, in any case."""
    v = value.lower()
    if v in ("true", "1", "yes"):
        return True
    if v in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false (or 1/0, yes/no), got {value!r}")


SKIP_DAMAGED_HELP = ("a --data file that is damaged (cut short, bad compression, empty): use its rows before the "
                     "damage and say where it was cut (default: off, stop with an error naming the file)")


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def _default_run_dir(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _child_train_args(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The command a launched rank (or the detached launcher) runs: the same start, already admitted here
    (so no --overwrite: the old run has been moved aside)."""
    out = ["train", *([args.config] if args.config else []), *args.overrides, "--run-dir", str(run_dir)]
    if args.max_steps is not None:
        out += ["--max-steps", str(args.max_steps)]
    if args.resume:
        out.append("--resume")
    if args.fresh_compile_cache:
        out.append("--fresh-compile-cache")
    return out


def _split_config_argument(args: argparse.Namespace) -> None:
    """`train --resume --run-dir R optim.max_steps=40`: argparse takes the first override for CONFIG."""
    if args.config and "=" in args.config and not Path(args.config).is_file():
        args.overrides = [args.config, *args.overrides]
        args.config = None


def cmd_train(args: argparse.Namespace) -> int:
    from .train.processes import launch

    if launch.is_detached_launcher():  # the process --detach started: status.json tells what becomes of the start
        return launch.run_detached(Path(args.run_dir), float(os.environ[launch.LAUNCH_TIME_ENV]), lambda: _train(args))
    return _train(args)


def _train(args: argparse.Namespace) -> int:
    from .train.processes import launch
    from .train.start.directory_admission import Footprint, admit_start, undo_refused_start

    _split_config_argument(args)
    if args.resume and not args.run_dir:
        raise UserError("--resume continues the run in --run-dir: give --run-dir RUN")
    world = args.nproc if "WORLD_SIZE" not in os.environ else int(os.environ["WORLD_SIZE"])
    run_dir = Path(args.run_dir) if args.run_dir else _default_run_dir(Path(args.config or "run").stem)
    # The process the user started owns the checks on the run directory; the ranks and the detached launcher
    # it starts (they inherit its launch time) only rebuild the same config.
    top_level = os.environ.get("RANK", "0") == "0" and launch.LAUNCH_TIME_ENV not in os.environ
    # Invalid configs and a run directory this start may not use fail here, before anything starts or loads.
    start = admit_start(args.config, args.overrides, run_dir, resume=args.resume, overwrite=args.overwrite,
                        max_steps=args.max_steps, check_owner=top_level)
    validate_world(start.cfg, world)
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        launch.check_local_ranks(start.cfg.run.device, args.nproc)
    if start.already_done:
        print(start.already_done)
        return EXIT_DONE
    if start.moved_aside:
        print(f"moved the old run aside: {start.moved_aside}")
    if start.cleared:
        print(f"removed the trace of an earlier start that failed before training: {', '.join(start.cleared)}")
    # Only the process that owns the whole start may take back what it wrote (not a rank, not a detached child).
    owns_start = top_level and "WORLD_SIZE" not in os.environ and not args.detach
    before = Footprint.of(run_dir)
    launched_at = os.environ.get(launch.LAUNCH_TIME_ENV) or str(time.time())
    inherit = {launch.LAUNCH_TIME_ENV: launched_at}  # every process of this start: a STOP older than this is stale
    if args.detach:
        child = _child_train_args(args, run_dir) + (["--nproc", str(args.nproc)] if args.nproc > 1 else [])
        pid = launch.detach(child, run_dir, inherit)
        print(f"started in the background (pid {pid}): {run_dir}\n"
              f"  watch: dflash-train status {run_dir} --follow\n  stop:  dflash-train stop {run_dir}")
        return EXIT_DONE
    # Said once the start is admitted (the config against the target, the run directory), not before a refusal.
    watch = None if "WORLD_SIZE" in os.environ else functools.partial(
        print, f"run directory: {run_dir}  (watch it with: dflash-train status {run_dir})", flush=True)
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        rc = launch.supervise(_child_train_args(args, run_dir), args.nproc, run_dir, args.stall_timeout, inherit,
                              on_admitted=watch)
        if rc == EXIT_USER_ERROR and owns_start:
            _say_undone(undo_refused_start(start, before))
        if rc == EXIT_STOPPED:
            print(f"stopped before done; continue with: dflash-train train --resume --run-dir {run_dir}", file=sys.stderr)
        elif rc not in (EXIT_DONE, EXIT_USER_ERROR):  # a refusal: the rank said what to change
            print(f"error: the run failed; see dflash-train status {run_dir}", file=sys.stderr)
        return rc
    from .train.trainer import train

    try:
        result = train(start.cfg, run_dir, fresh_compile_cache=args.fresh_compile_cache, resume=args.resume,
                       changes=start.changes, launched_at=float(launched_at), on_admitted=watch)
    except USER_ERRORS:
        if owns_start:
            _say_undone(undo_refused_start(start, before))
        raise
    is_main = os.environ.get("RANK", "0") == "0"
    if result is not None and result.name == "export":
        print(f"exported drafter: {result}")
        return EXIT_DONE
    if result is None and not is_main:
        print("target rank finished")
        return EXIT_DONE
    print("stopped during start-up; nothing to resume" if result is None
          else f"stopped before done; checkpoints in {result}; continue with: dflash-train train --resume "
               f"--run-dir {run_dir}")
    return EXIT_STOPPED


def _say_undone(done: Optional[str]) -> None:
    if done:
        log.info("%s; fix the error and run the same command again", done)


def cmd_status(args: argparse.Namespace) -> int:
    from .run.directory import RunDir
    from .run.status import format_ranks, format_status, read_heartbeats, read_status, run_verdict

    while True:
        status, last = read_status(args.run_dir)
        text = format_status(status, last)
        beats = read_heartbeats(RunDir(Path(args.run_dir)))
        if beats:
            text += "\n" + format_ranks(beats)
        print(text, flush=True)
        shown, _ = run_verdict(status)
        ended = {"done": EXIT_DONE, "failed": EXIT_FAILED, "dead": EXIT_FAILED, "silent": EXIT_FAILED,
                 "stopped": EXIT_STOPPED}
        if not args.follow or shown in ended:
            return ended.get(shown, EXIT_DONE)
        print("-" * 40, flush=True)
        time.sleep(args.interval)


def cmd_stop(args: argparse.Namespace) -> int:
    from .train.processes.launch import request_stop

    code, message = request_stop(Path(args.run_dir))
    print(message)
    return code


def cmd_demo(args: argparse.Namespace) -> int:
    from .commands.demo import run_demo

    return run_demo(Path(args.run_dir), args.overrides)


def cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from .infer.eval_options import DecodingOptions, check_against_drafter, check_flags
    from .infer.evaluate import evaluate, load_eval_models, require_eval_fp8_device
    from .files.outputs import check_report_out
    from .files.paths import require_exported_drafter
    from .runtime import resolve_device, resolve_dtype

    budgets = tuple(args.tree_budget or ())
    decoding = DecodingOptions(budgets, args.confidence_threshold, args.temperature, args.block_size, args.replay)
    check_flags(decoding)
    require_exported_drafter(Path(args.drafter))  # a checkpoint or a run: say which command fits, before loading
    check_against_drafter(decoding, Path(args.drafter))  # what the drafter supports, from its config.json
    check_report_out(Path(args.out), [("--drafter", Path(args.drafter)), ("--target", Path(args.target)),
                                      *[("--data", Path(d)) for d in args.data]], args.overwrite)
    from .data.formats import check_readable, require_packages

    require_packages(args.data)  # a built-in set's package, and a damaged --data file: said before the models load
    if not args.skip_damaged_files:
        for data in args.data:
            check_readable([data], args.limit)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    if args.target_quantize == "fp8":
        require_eval_fp8_device(device, dtype)
    template_kwargs = {"enable_thinking": args.thinking} if args.thinking is not None else None
    target, tokenizer, drafter, stops = load_eval_models(args.target, args.drafter, device, dtype,
                                                         template_kwargs, args.block_size, args.target_quantize,
                                                         args.max_new_tokens)
    save = functools.partial(_save_eval, args)
    if args.replay:
        from .infer.evaluate import evaluate_by_replay

        with torch.no_grad():
            report = evaluate_by_replay(target, tokenizer, drafter, args.data, max_new_tokens=args.max_new_tokens,
                                        tree_budgets=budgets, limit=args.limit, stop_token_ids=stops,
                                        template_kwargs=template_kwargs, on_dataset=save,
                                        skip_damaged_files=args.skip_damaged_files, progress=not args.no_progress)
        return _finish_eval(args, report)
    with torch.no_grad():
        report = evaluate(target, tokenizer, drafter, args.data, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, block_size=args.block_size, tree_budgets=budgets,
                          limit=args.limit, stop_token_ids=stops, template_kwargs=template_kwargs,
                          measure_speedup=not args.no_baseline, progress=not args.no_progress, on_dataset=save,
                          skip_damaged_files=args.skip_damaged_files, confidence_threshold=args.confidence_threshold)
    return _finish_eval(args, report)


def _save_eval(args: argparse.Namespace, report: dict) -> None:
    """The report so far to --out (and its .md): after each dataset, and at the end."""
    from .infer.evaluate import write_report

    report["config"]["target_quantize"] = args.target_quantize
    write_report(report, Path(args.out))
    if report["datasets"]:
        log.info("eval: %s done; the report so far is in %s", list(report["datasets"])[-1], args.out)


def _finish_eval(args: argparse.Namespace, report: dict) -> int:
    """The table, the lossless lines and where the report is; exit code 1 when a decoding mode failed."""
    from .infer.evaluate import failure_line, lossless_line, markdown_table

    out = Path(args.out)
    print(markdown_table(report))
    for ds in report["datasets"]:
        print(lossless_line(report, ds))
    for record in report.get("damaged_files", ()):
        from .data.formats import DamagedDataFile

        print(DamagedDataFile.from_record(record).cut_line())
    failed = failure_line(report)
    if args.update_card and not failed:
        from .exports.card import put_eval_table

        put_eval_table(Path(args.drafter), report)
    print(f"report: {out} and {out.with_suffix('.md')}")
    if failed:
        card = " (the model card was left as it was)" if args.update_card else ""
        print(f"error: eval: {failed}{card}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_DONE


def cmd_export(args: argparse.Namespace) -> int:
    from .commands.export import checkpoint_weights, export_checkpoint
    from .files.paths import resolve_checkpoint

    checkpoint = resolve_checkpoint(Path(args.checkpoint))
    out = export_checkpoint(checkpoint, Path(args.out), dtype=args.dtype, target=args.target, overwrite=args.overwrite)
    weights = checkpoint_weights(checkpoint)
    print(f"exported drafter: {out}" + (f" (weights: {weights})" if weights else ""))
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    from . import assets
    from .data.formats import require_packages
    from .commands.prepare import PrepareConfig, prepare, summary
    from .target.capture import load_tokenizer
    from .files.outputs import check_prepare_out

    check_prepare_out(Path(args.out), args.data, args.overwrite)  # before the tokenizer loads
    cfg = PrepareConfig(max_length=args.max_length, block_size=args.block_size, val_fraction=args.val_fraction,
                        thinking=args.thinking, shard_rows=args.shard_rows, max_samples=args.max_samples,
                        overwrite=args.overwrite, skip_damaged_files=args.skip_damaged_files)
    require_packages(args.data)  # every --data exists (a built-in set: its package), said before the tokenizer loads
    target_path = assets.resolve_target(args.target, weights=False)  # the tokenizer is all prepare reads
    tokenizer = load_tokenizer(target_path, args.trust_remote_code)
    out = Path(args.out)
    manifest = prepare(tokenizer, args.target, args.data, out, cfg, progress=sys.stderr.isatty())
    print(summary(manifest, out))
    return 0


def cmd_regen(args: argparse.Namespace) -> int:
    from .data.regen.inputs import RegenSettings
    from .data.regen.journal import format_summary
    from .files.outputs import check_regen_outputs

    check_regen_outputs(Path(args.out) if args.out else None, Path(args.export_batch) if args.export_batch else None,
                        args.data, args.import_batch or ())
    settings = RegenSettings(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        stop_token_ids=args.stop_token_ids, thinking=args.thinking, seed=args.seed, batch_size=args.batch_size,
        batch_tokens=args.batch_tokens, limit=args.limit, max_turns=args.max_turns, sort_window=args.sort_window,
        max_prompt_tokens=args.max_prompt_tokens, dtype=args.dtype,
        device=args.device, progress=not args.no_progress, skip_damaged_files=args.skip_damaged_files,
        engine=args.engine)
    if args.export_batch or args.import_batch:
        from .data.regen.roundtrip import batch_roundtrip

        summary = batch_roundtrip(args.data, imports=args.import_batch or (), export_path=args.export_batch,
                                  out=args.out, settings=settings, model_name=args.model or args.target)
    else:
        if not args.target or not args.out:
            raise ValueError("regen needs --target and --out (or --export-batch / --import-batch)")
        from .data.regen.local import regenerate

        summary = regenerate(args.target, args.data, args.out, settings)
    print(format_summary(summary))
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from .commands.doctor import format_report, remove_stale_targets, run_doctor

    if args.remove_stale_targets:
        print(remove_stale_targets())
    checks, verdict = run_doctor()
    print(format_report(checks, verdict))
    return 0 if verdict.startswith("READY") else 1


def _add_prepare_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "prepare", help="tokenise conversations with the target's chat template into a prepared dataset directory",
        description="Read conversations (JSONL / JSON array / Parquet; ShareGPT, OpenAI messages, {prompt, response}) "
                    f"or a built-in source ({', '.join(BUILTIN_SOURCES)}), tokenise them with the target's chat "
                    "template (loss on assistant tokens) and write memory-mapped shards + manifest.json to --out. "
                    "Bad rows are skipped and listed in OUT/rejects.jsonl.",
    )
    p.add_argument("--target", required=True, help="target whose tokenizer and chat template are used: smollm2, an HF folder or a .gguf")
    p.add_argument("--data", action="append", required=True, metavar="FILE|DIR|NAME",
                   help="input file, folder of files, or built-in source; repeat for several")
    p.add_argument("--out", required=True, help="output directory (written atomically)")
    p.add_argument("--max-length", type=POSITIVE_INT.flag, default=3072,
                   help=f"tokens per conversation; longer ones are truncated, more than {FAR_FACTOR}x longer ones "
                        "rejected (default: %(default)s)")
    p.add_argument("--block-size", type=BLOCK_SIZE.flag, default=16,
                   help="drafter block size: rows with fewer than 2 * block_size supervised tokens are dropped "
                        "(default: %(default)s)")
    p.add_argument("--val-fraction", type=VAL_FRACTION.flag, default=0.02,
                   help="share held out for validation, by a hash of the content (default: %(default)s)")
    p.add_argument("--thinking", type=parse_bool, default=None, metavar="true|false",
                   help="enable_thinking for templates that read it (default: the template's own default)")
    p.add_argument("--shard-rows", type=POSITIVE_INT.flag, default=50_000,
                   help="rows per shard file (default: %(default)s)")
    p.add_argument("--max-samples", type=ALL_IF_ZERO.flag, default=0,
                   help="keep at most this many rows, 0 = all (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier prepared dataset in --out: it is moved aside to OUT.old-<time>, never "
                        "deleted; any other non-empty folder and a folder holding --data are refused (default: off)")
    p.add_argument("--skip-damaged-files", action="store_true", help=SKIP_DAMAGED_HELP)
    p.add_argument("--trust-remote-code", action="store_true", help="only if you trust the target folder's code")
    p.set_defaults(func=cmd_prepare)


def _add_regen_parser(subparsers) -> None:
    r = subparsers.add_parser(
        "regen", help="the target writes the assistant turns of your prompts (resumable; or vLLM/SGLang batch files)",
        description="Regenerate the assistant turns of conversations / prompts with the target, turn by turn. "
                    "Kill it at any moment and run the same command again: it continues where it stopped.")
    r.add_argument("--target", help="target: smollm2, an HF folder or a .gguf file")
    r.add_argument("--data", nargs="+", action="extend", required=True,
                   help=f"JSONL/JSON/Parquet files (ShareGPT, OpenAI messages, prompt[/response]) or built-in sets: "
                        f"{', '.join(BUILTIN_SOURCES)}")
    r.add_argument("--out", help="output JSONL of {id, messages} (OUT.regen.json and OUT.rejects.jsonl beside it)")
    r.add_argument("--max-new-tokens", type=POSITIVE_INT.flag, default=512,
                   help="per assistant turn (default: %(default)s)")
    r.add_argument("--temperature", type=TEMPERATURE.flag, default=0.0, help="0 = greedy (default: %(default)s)")
    r.add_argument("--top-p", type=TOP_P.flag, default=1.0,
                   help="nucleus sampling when --temperature > 0; 1.0 = off (default: %(default)s)")
    r.add_argument("--stop-token-ids", type=INDEX.flag, nargs="+", default=None,
                   help="default: the target's stop tokens (dflash_target.json), else its eos token(s)")
    r.add_argument("--batch-size", type=POSITIVE_INT.flag, default=16,
                   help="conversations per generate call, at most (default: %(default)s)")
    r.add_argument("--batch-tokens", type=NO_BOUND_IF_ZERO.flag, default=0,
                   help="at most this many padded tokens, rows x (longest prompt + --max-new-tokens), per generate "
                        "call, whose memory grows with them: with a large --batch-size, short prompts go in wide "
                        "calls and long ones in narrow calls; 0 = no bound (default: %(default)s)")
    r.add_argument("--engine", choices=ENGINES, default="generate",
                   help="generate: HF generate over left-padded batches; continuous: transformers' continuous "
                        "batching (paged KV cache, no padding, a row leaves the batch at its stop token; greedy "
                        "only; --batch-tokens does not apply) (default: %(default)s)")
    r.add_argument("--limit", type=ALL_IF_ZERO.flag, default=0,
                   help="only the first N input rows, 0 = all (default: %(default)s)")
    r.add_argument("--max-turns", type=ALL_IF_ZERO.flag, default=0,
                   help="answer only the first N user turns of each conversation, 0 = all (default: %(default)s)")
    r.add_argument("--thinking", type=parse_bool, default=None, metavar="true|false",
                   help="pass enable_thinking to the chat template (default: not passed)")
    r.add_argument("--seed", type=SEED.flag, default=0,
                   help="sampling seed; each batch and turn reseeds from it (default: %(default)s)")
    r.add_argument("--max-prompt-tokens", type=POSITIVE_INT.flag, default=None,
                   help="longer first prompts are rejected, longer later turns end the conversation "
                        "(default: the target's context minus --max-new-tokens)")
    r.add_argument("--sort-window", type=POSITIVE_INT.flag, default=4096,
                   help="rows sorted by prompt length together (default: %(default)s)")
    r.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto = cuda when a GPU is visible, else cpu (default: %(default)s)")
    r.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto = bfloat16 on GPU, float32 on CPU (default: %(default)s)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--skip-damaged-files", action="store_true", help=SKIP_DAMAGED_HELP)
    r.add_argument("--export-batch", metavar="FILE",
                   help="write OpenAI batch requests (vllm run-batch / SGLang) instead of generating")
    r.add_argument("--import-batch", metavar="FILE", nargs="+", action="extend", default=None,
                   help="read batch responses (all rounds so far) and write the conversations to --out")
    r.add_argument("--model", help="body.model of exported requests (default: --target as given)")
    r.set_defaults(func=cmd_regen)


class _VersionAction(argparse.Action):
    """--version, read when asked (argparse's own takes the text when the parser is built, and status starts faster
    without reading the libraries' metadata)."""

    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from .commands.doctor import version_line

        print(version_line())
        parser.exit()


def _add_run_parsers(sub) -> None:
    """train, status and stop: a run's life."""
    t = sub.add_parser("train", help="train a drafter; exit code 0 done, 1 failed, 2 user error, 3 stopped before done",
                       description="Train a drafter. Exit codes: 0 done (exported), 1 failed, 2 user error (the message "
                                   "says what to change), 3 stopped before done (continue with --resume).")
    t.add_argument("config", nargs="?", default=None,
                   help="YAML config (see configs/); with --resume it may be left out: the run's own config.yaml is used")
    t.add_argument("overrides", nargs="*", default=[],
                   help="dotted overrides, e.g. optim.lr=3e-4 data.max_length=2048; with --resume only the steps and "
                        "the log/save/eval cadence may change (default: none)")
    t.add_argument("--run-dir", default=None, help="run directory (default: runs/<config>-<time>)")
    t.add_argument("--max-steps", type=POSITIVE_INT.flag, default=None,
                   help="train N optimizer steps in all: optim.max_steps given on the command line, over the config "
                        "file's (an override of optim.max_steps with another value is refused; default: the config's "
                        "epochs / optim.max_steps)")
    t.add_argument("--fresh-compile-cache", action="store_true",
                   help="empty the inductor cache before compiling (default: off, reuse it)")
    t.add_argument("--resume", action="store_true",
                   help="continue the run in --run-dir from its newest valid checkpoint, with its own config "
                        "(default: off, a fresh run)")
    t.add_argument("--overwrite", action="store_true",
                   help="start fresh in a --run-dir that holds a run: the old run is moved aside to "
                        "RUN.old-<time>, never deleted (default: off, refuse)")
    t.add_argument("--nproc", type=POSITIVE_INT.flag, default=1,
                   help="start N local ranks, one per GPU on a GPU machine (default: 1)")
    t.add_argument("--detach", action="store_true",
                   help="run in the background; output goes to RUN/launcher.out (default: off)")
    t.add_argument("--stall-timeout", type=POSITIVE_NUMBER.flag, default=300.0,
                   help="seconds without progress from a rank before the run is stopped as failed (default: %(default)s)")
    t.set_defaults(func=cmd_train)

    s = sub.add_parser("status", help="phase, step, tokens/s, loss, accuracy, ETA, heartbeat and last error of a run; "
                                      "exit code 0 running or done, 1 failed or dead, 3 stopped")
    s.add_argument("run_dir", help="the run directory")
    s.add_argument("--follow", action="store_true", help="keep printing until the run ends (default: off)")
    s.add_argument("--interval", type=POSITIVE_NUMBER.flag, default=5.0,
                   help="seconds between reports with --follow (default: %(default)s)")
    s.set_defaults(func=cmd_status)

    st = sub.add_parser("stop", help="ask a running run to checkpoint and exit (continue it with train --resume)")
    st.add_argument("run_dir", help="the run directory")
    st.set_defaults(func=cmd_stop)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-train", description="Train block drafters for speculative decoding "
                                f"({', '.join(registry.names())}) for your own LLM.")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging (default: off)")
    p.add_argument("--version", action=_VersionAction, help="print the version (and torch's and transformers') and exit")
    p.add_argument("--debug", action="store_true",
                   help="print the traceback of a user error too (default: off; DFLASH_DEBUG=1 does the same)")
    sub = p.add_subparsers(dest="command", required=True)

    _add_run_parsers(sub)
    e = sub.add_parser("eval", help="speculative decoding with the target: tau, histogram, speedup (block and DDTree)")
    e.add_argument("--target", required=True, help="target: smollm2, an HF folder or a .gguf file")
    e.add_argument("--drafter", required=True,
                   help="an exported drafter folder (config.json + model.safetensors): RUN/export or the --out of export")
    e.add_argument("--data", nargs="+", default=["mt-bench"],
                   help="mt-bench, humaneval, sharegpt (held-out), or a file or folder of prompts / conversations in any "
                        "shape prepare reads; several allowed (default: mt-bench)")
    e.add_argument("--out", default="eval.json",
                   help="JSON report; a Markdown table is written beside it (default: %(default)s)")
    e.add_argument("--overwrite", action="store_true",
                   help="replace an earlier eval report in --out (and its .md); a file that is not an eval report "
                        "is never replaced (default: off, an existing report is refused)")
    e.add_argument("--max-new-tokens", type=POSITIVE_INT.flag, default=256,
                   help="tokens generated per turn of each prompt, fewer than the target's context "
                        "(max_position_embeddings) (default: %(default)s)")
    e.add_argument("--temperature", type=TEMPERATURE.flag, default=0.0,
                   help="0 = greedy, checked lossless against the target; above 0 = speculative sampling "
                        "(default: %(default)s)")
    e.add_argument("--block-size", type=BLOCK_SIZE.flag, default=None,
                   help="verify this many tokens per step, at most the trained block size (default: trained)")
    e.add_argument("--confidence-threshold", type=FRACTION.flag, default=0.0,
                   help="a drafter with a confidence head: each step verifies only the drafts before the "
                        "first whose predicted acceptance is below this (lossless: the drafter's own prediction); "
                        "the report gives verified_per_step beside tau; 0 = verify every draft (default: "
                        "%(default)s)")
    e.add_argument("--tree-budget", type=TREE_BUDGET.flag, nargs="+", default=None, metavar="N",
                   help=f"DDTree node budgets to evaluate as well, e.g. 16 64, each at most {TREE_BUDGET.high}: a "
                        "step verifies budget + 1 tokens under a (budget + 1) x (context + budget + 1) mask (default: "
                        "none, block verification only)")
    e.add_argument("--limit", type=ALL_IF_ZERO.flag, default=0,
                   help="prompts per dataset, 0 = all (default: %(default)s)")
    e.add_argument("--thinking", type=parse_bool, default=None, metavar="true|false",
                   help="pass enable_thinking to the chat template (default: not passed)")
    e.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto = cuda when a GPU is visible, else cpu (default: %(default)s)")
    e.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                   help="dtype of target and drafter: float32, the default on every device, makes greedy decoding "
                        "exactly lossless; bfloat16 is the serving dtype (faster on a GPU; outputs may differ from "
                        "float32's where logits nearly tie); auto = bfloat16 on a GPU, float32 on the CPU "
                        "(default: %(default)s)")
    e.add_argument("--target-quantize", default="none", choices=["none", "fp8"],
                   help="fp8: every decoder layer's linears in FP8 (row-wise weight scales, per-token activations, "
                        "as target.quantize=fp8 trains with), for the acceptance on a target served in FP8; needs "
                        "--dtype bfloat16 (or auto) on a GPU of compute capability 8.9+ (default: %(default)s)")
    e.add_argument("--no-progress", action="store_true",
                   help="no progress bar (default: a bar with the ETA of each dataset's prompts on stderr; none with "
                        "--replay)")
    e.add_argument("--no-baseline", action="store_true", help="skip the target-only run (no speedup, no lossless check)")
    e.add_argument("--replay", action="store_true",
                   help="greedy tau by replay: the target's greedy continuation of every prompt (batched), then one "
                        "drafter pass per turn gives every step's acceptance; the same tau as decoding, in minutes "
                        "for whole datasets; no timing, no speedup")
    e.add_argument("--update-card", action="store_true", help="write the result table into the drafter's README.md")
    e.add_argument("--skip-damaged-files", action="store_true", help=SKIP_DAMAGED_HELP)
    e.set_defaults(func=cmd_eval)

    x = sub.add_parser("export", help="export a checkpoint in the layout vLLM and SGLang load for its architecture, "
                                      "with a parity check")
    x.add_argument("checkpoint", help="RUN/checkpoints/step-N (step-20 for step-00000020; best for the best by "
                   "validation tau; or its drafter/ folder)")
    x.add_argument("--out", required=True, help="folder to write the exported drafter to (a new or empty one)")
    x.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export in --out: it is moved aside to OUT.old-<time>, never deleted; "
                        "any other non-empty folder, a run's folders and the checkpoint are refused (default: off)")
    x.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="dtype of the exported weights (default: %(default)s)")
    x.add_argument("--target", default=None,
                   help="the target (path or embedded name) whose lm_head a drafter with a training-time layout (e.g. "
                        "factored codebooks) is exported with (default: the target the run's config.yaml names)")
    x.set_defaults(func=cmd_export)

    doc = sub.add_parser("doctor", help="versions, GPUs, a flex_attention compile smoke test, cache dir, verdict")
    doc.add_argument("--remove-stale-targets", action="store_true",
                     help="first delete the converted targets in the cache that no GGUF known to it reaches any more "
                          "(the report's 'target cache' line names them); one still needed is converted again")
    doc.set_defaults(func=cmd_doctor)

    _add_prepare_parser(sub)
    _add_regen_parser(sub)
    d = sub.add_parser("demo", help="train a drafter for the embedded default target (SmolLM2-135M) on CPU or GPU")
    d.add_argument("overrides", nargs="*", help="dotted overrides of the demo config")
    d.add_argument("--run-dir", default="runs/demo",
                   help="where every stage writes; a second run reuses it (default: %(default)s)")
    d.set_defaults(func=cmd_demo)
    return p


def _stdout_gone() -> bool:
    """Whether standard output is a pipe whose reader has closed it (its write end polls as an error)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no fd (a captured stream) or no poll on this platform
        return False


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
    if args.debug:
        os.environ["DFLASH_DEBUG"] = "1"  # the ranks and the detached launcher inherit it
    try:
        code = args.func(args)
        sys.stdout.flush()  # a reader that stopped reading (`status RUN | head -3`) is found here, not at exit
        return code
    except BrokenPipeError as e:
        if _stdout_gone():  # nothing to say to a reader who left; the rest of the output is dropped
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_FAILED
        print(f"error: {e.strerror or e}", file=sys.stderr)
        return EXIT_FAILED
    except USER_ERRORS as e:
        if debug_enabled():
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except OSError as e:  # a full disk, a read-only or missing folder: one line that names the file
        where = f" ({e.filename})" if e.filename else ""
        print(f"error: {e.strerror or e}{where}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
