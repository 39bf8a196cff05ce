"""The driver: the stages (data, prepare, train, eval) of one call over the work directory."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from .children import (
    child_env, ChildFailed, count_lines, gpu_env, run_eval_workers, run_helpers, run_regen, run_trainings, TrainJob,
    visible_gpus
)
from .inputs import load_eval_items, prepare_training_data
from .pooling import compare_with_decoding, confidence_truncation, metric_times, pooled_tau, reranker_rows
from .report import (
    acceptance_by_slot, dataset_summaries, drafter_block_size, drafter_facts, pooled_by_mode,
    summary_markdown, train_summary, variant_row
)
from .settings import DEFAULT_EVAL, ENTRY, POOLED, REFERENCE, REGEN_FILE, REGEN_SOURCE
from .shards import drafter_origin, file_sha256, merged_report, plan_shards, read_records, record_key
from .workers import DecodeJob, EvalSettings


STAGE_KEY = "onpolicy.start_from="  # a variant's `onpolicy.start_from=@NAME`: the on-policy stage after run NAME


def stage_source(overrides: list[str]) -> Optional[str]:
    """The run an on-policy variant continues (`onpolicy.start_from=@NAME` -> NAME), or None."""
    given = [o[len(STAGE_KEY):] for o in overrides if o.startswith(STAGE_KEY)]
    return given[-1][1:] if given and given[-1].startswith("@") else None


def parse_variants(specs: list[str], config: str, overrides: list[str]) -> dict[str, list[str]]:
    """--variant NAME=K=V[,K=V...] -> {NAME: [K=V, ...]}; a bad spec, a variant whose config does not load, or an
    on-policy variant (`onpolicy.start_from=@RUN`) naming no earlier run fails now, before anything runs."""
    from dflash_train.config.load import load_config

    variants: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, extra = spec.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or name == "default" or name in variants:
            raise SystemExit(f"--variant {spec!r}: expected NAME=key=value[,key=value...] with a new NAME of "
                             "letters, digits, _ . - (not 'default')")
        variants[name] = [o for o in extra.split(",") if o]
        source = stage_source(variants[name])
        if source is not None and source != "default" and source not in variants:
            raise SystemExit(f"--variant {spec!r}: onpolicy.start_from=@{source} names no earlier run (default or a "
                             f"--variant before it: {', '.join(['default', *variants][:-1])})")
        load_config(config, list(overrides) + variants[name])
    return variants


def next_wave(todo: dict, ready: Callable[[str], bool], order: list[str], one_at_a_time: bool) -> dict:
    """The runs of `todo` to train together next: every one that is ready (an on-policy variant once the run it
    continues has exported), or with `one_at_a_time` the first of them in `order` alone (each run alone on its
    GPU: training wall times that compare, for equal-GPU-time comparisons)."""
    wave = {n: r for n, r in todo.items() if ready(n)}
    if one_at_a_time and wave:
        first = next(n for n in order if n in wave)
        return {first: wave[first]}
    return wave


def flex_refusals(configs: dict) -> list[str]:
    """The runs (name -> loaded config) whose training on a GPU would stop at its start: flex attention (the GPU's
    `drafter.attention_backend: auto`) tiles whole blocks into 128-query tiles, so it needs a block size dividing
    128 (`family.backend.resolve_backend`). Named before anything runs, with the fix."""
    from dflash_train.architectures.family.backend import FLEX_TILE

    return [f"{name}: drafter.block_size={c.drafter.block_size} does not divide {FLEX_TILE}, which flex attention "
            f"(drafter.attention_backend={c.drafter.attention_backend}, flex on a GPU) needs; choose a block size "
            f"that divides it or add drafter.attention_backend=sdpa (dense masks: slower, more memory)"
            for name, c in configs.items()
            if c.run.device != "cpu" and c.drafter.attention_backend in ("auto", "flex") and FLEX_TILE % c.drafter.block_size]


def exported(folder: Path) -> bool:
    return (folder / "model.safetensors").is_file()


class Driver:
    """One call of the comparison: its stages (prepare, train, eval) run through a `StageRunner` on --out
    (state and times in pipeline.json), under the --deadline-s budget."""

    def __init__(self, args: argparse.Namespace):
        from dflash_train.config.load import load_config
        from dflash_train.commands.pipeline import StageRunner

        self.args = args
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        # no --data: the data stage regenerates the training set into OUT/data (with --drafter: the eval prompts are
        # filtered against that file when an earlier run left it there)
        self.regen = not args.data
        args.tree_budget = args.tree_budget or [32]
        args.data = str(Path(args.data).resolve()) if args.data else str(self.out / REGEN_FILE)
        self.prepared = self.out / "prepared"
        self.run = self.out / "run"
        self.eval_dir = self.out / "eval"
        self.cfg = load_config(args.config, args.overrides)
        self.variants = parse_variants(getattr(args, "variant", None) or [], args.config, args.overrides)
        if visible_gpus(args.device) and not getattr(args, "drafter", None):
            refused = flex_refusals({name: load_config(args.config, overrides)
                                     for name, (_, overrides) in self.runs().items()})
            if refused:
                raise SystemExit("these runs would stop at the start of training on the GPU:\n  " + "\n  ".join(refused))
        self.start = time.time()
        self.log_file = open(self.out / "driver.log", "a", encoding="utf-8")
        # One target per work directory: its prepared tokens, drafters and continuations are that target's.
        self.runner = StageRunner(self.out, {"target": self.cfg.target.path}, label="quality comparison",
                                  remedy="remove it or pass another --out", adopt_unstamped=True,
                                  deadline=self.start + args.deadline_s if args.deadline_s else None, say=self.log)
        self.settings = EvalSettings(max_new_tokens=args.max_new_tokens, tree_budgets=tuple(args.tree_budget),
                                     baseline=args.baseline, dtype=args.dtype, device=args.device,
                                     target_quantize=args.eval_target_quantize)
        # --drafter: evaluate that exported drafter (no prepare, no train); else this run's export
        self.given_drafter = Path(args.drafter).resolve() if getattr(args, "drafter", None) else None
        self.drafter_dir = self.given_drafter or self.run / "export"
        self.overlap_data: Optional[str] = None  # the training file the eval prompts were filtered against
        self.failed: dict[str, str] = {}  # variants whose training failed this call: left out of the comparison

    def log(self, msg: str) -> None:
        line = f"[quality {time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def stages(self, names: set[str]) -> list:
        """The selected stages, in order. A done stage is skipped while its key (what it depends on) is unchanged."""
        from dflash_train.commands.pipeline import Stage

        data_key = {"source": REGEN_SOURCE, "limit": self.args.regen_limit,
                    "max_new_tokens": self.args.regen_max_new_tokens, "max_turns": self.args.regen_max_turns}
        prepare_key = {"data": self.args.data, "max_length": self.cfg.data.max_length,
                       "block_size": self.cfg.drafter.block_size, "val_fraction": self.args.val_fraction}
        if self.needs_label_counts():  # only then: an older work directory's stages stay done otherwise
            prepare_key["label_counts"] = True
        all_stages = [
            Stage("data", self.stage_data, outputs=(Path(self.args.data),), key=data_key),
            Stage("prepare", self.stage_prepare, outputs=(self.prepared / "manifest.json",), key=prepare_key),
            Stage("train", self.stage_train, outputs=tuple(run / "export" / "model.safetensors"
                                                           for run, _ in self.runs().values()),
                  key={name: [str(run), overrides] for name, (run, overrides) in self.runs().items()}),
            Stage("eval", self.stage_eval, outputs=(self.out / "summary.json", self.out / "summary.md"),
                  key=self.eval_key, reuse=self.print_summary, min_remaining_s=self.args.eval_stop_margin_s + 60),
        ]
        return [s for s in all_stages if s.name in names and (s.name != "data" or self.regen)]

    def needs_label_counts(self) -> bool:
        """Whether a run trains a reduced draft vocabulary (`drafter.draft_vocab_size`), chosen from the prepared
        data's label counts (a directory prepared before they existed has none)."""
        from dflash_train.config.load import load_config

        return any(load_config(self.args.config, overrides).drafter.draft_vocab_size
                   for _, overrides in self.runs().values())

    def eval_key(self) -> dict:
        """Everything the summary depends on besides the stages before it: the arguments, the drafter's weights."""
        a = vars(self.args)
        key = {k: a[k] for k in ("config", "overrides", "data", "val_fraction", "eval", "limit", "overlap_prefix",
                                 "max_new_tokens", "tree_budget", "baseline", "dtype", "device", "workers", "method",
                                 "check_decode", "drafter", "variant", "curve_every", "eval_target_quantize")}
        if a.get("confidence_thresholds"):  # only when given: an eval done without them stays done
            key["confidence_thresholds"] = list(a["confidence_thresholds"])
        weights = self.drafter_dir / "model.safetensors"
        key["drafter_sha256"] = file_sha256(weights) if weights.is_file() else None
        return key

    # ------------------------------------------------------------------ data

    def regen_command(self) -> list[str]:
        a = self.args
        return [sys.executable, "-m", "dflash_train", "regen", "--target", self.cfg.target.path,
                "--data", REGEN_SOURCE, "--limit", str(a.regen_limit), "--max-new-tokens", str(a.regen_max_new_tokens),
                "--max-turns", str(a.regen_max_turns), "--batch-size", str(a.regen_batch_size),
                "--batch-tokens", str(a.regen_batch_tokens), "--engine", a.regen_engine, "--device", a.device,
                "--no-progress", "--out", a.data]

    def stage_data(self) -> None:
        """The training set: the target's own greedy answers to the first --regen-limit conversations of the
        built-in ShareGPT training split (`dflash-train regen`, resumable: a call the deadline stopped, or an
        earlier run with a smaller limit, is continued)."""
        from dflash_train.data.regen.journal import side_paths

        out = Path(self.args.data)
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = self.regen_command()
        self.log("data: " + " ".join(cmd))
        t0 = time.time()
        try:
            run_regen(cmd, out.parent / "regen.log", self.runner, self.args.device, self.log)
        finally:
            self.runner.add_time("regen_s", time.time() - t0)
        rows, rejects = count_lines(out), count_lines(side_paths(out)[1])
        self.log(f"data: {out}: {rows} conversations, {rejects} rejected")

    def regen_summary(self) -> dict:
        """What the data stage made: its source and settings, conversations written and rejected."""
        from dflash_train.data.regen.journal import side_paths

        out = Path(self.args.data)
        return {"source": f"built-in {REGEN_SOURCE} (training split), the first {self.args.regen_limit} conversations",
                "generated_by": "the target, greedy, its stop tokens", "max_new_tokens": self.args.regen_max_new_tokens,
                "max_turns": self.args.regen_max_turns,
                "command": " ".join(["dflash-train"] + self.regen_command()[3:]),
                "conversations": count_lines(out), "rejected": count_lines(side_paths(out)[1])}

    # ------------------------------------------------------------------ prepare

    def stage_prepare(self) -> None:
        seconds = prepare_training_data(self.cfg, self.args.data, self.args.val_fraction, self.prepared, self.log)
        if seconds is not None:
            self.runner.add_time("prepare_s", seconds)

    # ------------------------------------------------------------------ train

    def runs(self) -> dict[str, tuple[Path, list[str]]]:
        """Training runs by name: "default" (the config and its overrides; with --curve-every it saves every
        that many steps) in run/, and each --variant in variants/NAME/ (the default's overrides, then its own)."""
        base = list(self.args.overrides)
        if self.args.curve_every:
            base += [f"run.save_every={self.args.curve_every}", "run.keep_last=1000"]
        runs = {"default": (self.run, base)}
        for name, extra in self.variants.items():
            source = stage_source(extra)
            if source is not None:  # the on-policy stage continues that run's export
                extra = [o for o in extra if not o.startswith(STAGE_KEY)] + [f"{STAGE_KEY}{runs[source][0]}"]
            runs[name] = (self.out / "variants" / name, list(self.args.overrides) + extra)
        return runs

    @staticmethod
    def train_gpu(name: str, k: int, gpus: int) -> int:
        """The default run has GPU 0 to itself (its wall time is the one compared with the reference); the
        variants share the others."""
        if name == "default" or gpus < 2:
            return 0
        return 1 + (k - 1) % (gpus - 1)

    def train_command(self, run: Path, overrides: list[str]) -> list[str]:
        from dflash_train.files.layout import list_checkpoints

        cmd = [sys.executable, "-m", "dflash_train", "train", str(self.args.config), *overrides,
               f"data.train_files=[{self.prepared}]", "--run-dir", str(run)]
        if run.joinpath("checkpoints").is_dir() and list_checkpoints(run / "checkpoints"):
            cmd.append("--resume")
        elif run.is_dir():
            cmd.append("--overwrite")  # an earlier call's attempt that never checkpointed: moved aside
        return cmd

    def stage_train(self) -> None:
        """Train every run not yet exported, at the same time (spread over the GPUs; with --one-at-a-time one after
        another). Unfinished when the deadline stopped them (with a checkpoint: the next call resumes)."""
        from dflash_train.commands.pipeline import Unfinished

        runs = self.runs()
        todo = {n: r for n, r in runs.items() if not exported(r[0] / "export")}
        for name in sorted(set(runs) - set(todo)):
            self.log(f"train {name}: reusing {runs[name][0] / 'export'}")
        order = list(runs)  # each run keeps its GPU slot across waves
        while todo:  # waves: an on-policy variant trains once the run it continues has exported
            wave = next_wave(todo, lambda n: self.ready(n, runs), order, self.args.one_at_a_time)
            if not wave:
                break
            self.train_wave(wave, order)
            todo = {n: r for n, r in todo.items() if n not in wave and n not in self.failed}
            if not all(exported(r[0] / "export") for n, r in wave.items() if n not in self.failed):
                break  # the deadline stopped this wave: later waves wait for the next call
        for name, (run, _) in todo.items():
            source = stage_source(self.variants.get(name, []))
            if source in self.failed:
                self.log(f"train {name}: not run, {source} (the run it continues) failed")
                self.failed[name] = f"{source} failed"
        if not all(exported(r[0] / "export") for n, r in runs.items() if n not in self.failed):
            raise Unfinished("training stopped at the deadline with a checkpoint; run the same command again to "
                             "continue")

    def ready(self, name: str, runs: dict[str, tuple[Path, list[str]]]) -> bool:
        """Whether run `name` may train now: it continues no run, or that run has exported."""
        source = stage_source(self.variants.get(name, []))
        return source is None or (source not in self.failed and exported(runs[source][0] / "export"))

    def train_wave(self, wave: dict[str, tuple[Path, list[str]]], order: list[str]) -> None:
        """Train these runs at the same time (spread over the GPUs)."""
        gpus = visible_gpus(self.args.device)
        jobs = [TrainJob(name, run, self.train_command(run, overrides),
                         self.out / ("train.stdout.log" if name == "default" else f"train-{name}.stdout.log"),
                         gpu_env(child_env(), self.train_gpu(name, order.index(name), gpus), gpus))
                for name, (run, overrides) in wave.items()]
        ends = run_trainings(jobs, self.runner, self.args.train_stop_margin_s, self.log)
        for name, (_, seconds) in ends.items():  # wall time of each training process (its share of this call)
            self.runner.add_time("train_s" if name == "default" else f"train_s:{name}", seconds)
        for job in jobs:
            self.check_training(job, ends[job.name][0])

    def check_training(self, job: TrainJob, code: int) -> None:
        """A run's exit: done or stopped at the deadline (3) are fine; the default's failure ends the call, a
        variant's is reported and leaves it out of the comparison."""
        if code in (0, 3):  # done, or stopped at the deadline (resumes next call)
            return
        if job.name == "default":
            raise ChildFailed(f"training failed (exit {code}); see {job.log_path} and {job.run / 'train.log'}")
        text = job.log_path.read_text(errors="replace") if job.log_path.is_file() else ""
        tail = text.strip().splitlines()[-1:]
        self.log(f"train {job.name}: FAILED (exit {code}): {' '.join(tail)}; see {job.log_path}")
        self.failed[job.name] = f"exit {code}: {' '.join(tail)}"

    # ------------------------------------------------------------------ eval

    def stage_eval(self) -> dict:
        """Tau of the drafter(s) on every eval prompt, then summary.json and summary.md (printed). Unfinished
        while prompts are left (the deadline)."""
        from dflash_train.commands.pipeline import Unfinished

        items, info = self.eval_items()
        if self.args.method == "decode":
            complete, info = self.decode(items, info)
            summary = self.summarize(complete, info)
        else:
            complete, info, extra = self.eval_by_replay(items, info)
            summary = self.summarize(complete, info, extra)
        print(summary_markdown(summary), flush=True)
        if not complete:
            raise Unfinished("prompts are left to decode; run the same command again")
        return summary

    def print_summary(self) -> dict:
        """An eval done in an earlier call: its summary, printed again."""
        print((self.out / "summary.md").read_text(), flush=True)
        return json.loads((self.out / "summary.json").read_text())

    def eval_items(self) -> tuple[list[dict], dict]:
        items, info, self.overlap_data = load_eval_items(self.args.eval or list(DEFAULT_EVAL), self.args.data,
                                                         self.args.limit, self.args.overlap_prefix, self.log)
        return items, info

    def workers(self) -> int:
        if self.args.workers:
            return self.args.workers
        cpus = os.cpu_count() or 2
        return max(1, min(12, cpus - 2)) if visible_gpus(self.args.device) else 1

    def settings_for(self, drafter: Path, **changes) -> "EvalSettings":
        """This call's eval settings for `drafter`, with `changes`: without DDTree budgets for a drafter that refuses
        DDTree (its tree modes are not applicable, `drafter_facts`)."""
        settings = EvalSettings(**{**self.settings.__dict__, **changes})
        if drafter_facts(drafter)["tree"] is not None:
            settings.tree_budgets = ()
        return settings

    def decode(self, items: list[dict], info: dict) -> tuple[bool, dict]:
        """Real decoding of `items` with the drafter under test by worker processes: (complete, eval info)."""
        job = DecodeJob(self.drafter_dir, items, info, self.eval_dir, self.settings_for(self.drafter_dir))
        return self.decode_jobs({"default": job})["default"]

    def decode_jobs(self, jobs: dict[str, "DecodeJob"]) -> dict[str, tuple[bool, dict]]:
        """Real decoding of each job's prompts with its drafter, the worker processes of every job at once (the
        --workers shared between the jobs by their prompts left, at least one each): per job (complete, eval
        info). Records of an earlier call with the same prompts, settings and drafter are kept; other ones are
        moved aside."""
        todo = {name: self.decode_plan(name, job) for name, job in jobs.items()}
        left = sum(len(t) for t in todo.values())
        if left:
            cmds, sizes = [], []
            for name, job in jobs.items():
                if todo[name]:
                    n = max(1, round(self.workers() * len(todo[name]) / left))
                    shard_cmds, shards = self.worker_commands(todo[name], job, n)
                    cmds += shard_cmds
                    sizes.append(f"{name}: {'+'.join(str(len(sh)) for sh in shards)}")
            env = child_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
            codes, stopped, seconds = run_eval_workers(
                cmds, env, self.runner, self.args.device, self.log,
                f"eval: {len(cmds)} workers started (prompts per worker, {'; '.join(sizes)}); logs in each "
                "eval folder's attempt-NN/")
            self.runner.add_time("eval_s", seconds)
            failed = [k for k, code in enumerate(codes) if code != 0 and not (stopped and code < 0)]
            if failed:
                tail = cmds[failed[0]][1].read_text(errors="replace")[-3000:]
                raise ChildFailed(f"eval workers failed ({len(failed)} of {len(cmds)}, exit codes "
                                  f"{[codes[k] for k in failed]}: negative = killed by that signal); "
                                  f"{cmds[failed[0]][1]} ends:\n{tail}")
        return {name: self.decode_report(name, job) for name, job in jobs.items()}

    def decode_plan(self, name: str, job: "DecodeJob") -> list[dict]:
        """The job's prompts still to decode; its eval folder made (moved aside first when it holds records of
        other prompts, settings or drafter weights) and its plan written."""
        key = hashlib.sha256(json.dumps({
            "items": [[i["dataset"], i["id"], i["turns"]] for i in job.items],
            "settings": job.settings.__dict__, "drafter": file_sha256(job.drafter / "model.safetensors"),
        }, sort_keys=True, default=list).encode()).hexdigest()
        plan_path = job.eval_dir / "plan.json"
        if plan_path.is_file() and json.loads(plan_path.read_text()).get("key") != key:
            old = job.eval_dir.with_name(f"{job.eval_dir.name}-stale-{int(time.time())}")
            self.log(f"eval {name}: prompts, settings or drafter changed since the last call: moving "
                     f"{job.eval_dir} to {old}")
            job.eval_dir.rename(old)
            self.runner.clear_time("eval_s")
        job.eval_dir.mkdir(parents=True, exist_ok=True)
        plan_path.write_text(json.dumps({"key": key, "settings": job.settings.__dict__, "datasets": job.info},
                                        indent=1, default=list))
        done = read_records(job.eval_dir.glob("records-*.jsonl"))
        todo = [i for i in job.items if record_key(i["dataset"], i["id"]) not in done]
        self.log(f"eval {name}: {len(job.items)} prompts, {len(job.items) - len(todo)} already done, {len(todo)} "
                 "to decode")
        return todo

    def worker_commands(self, todo: list[dict], job: "DecodeJob", n: int) -> tuple[list[tuple[list[str], Path]], list]:
        """The worker processes (command, log file) that decode `todo` with the job's drafter in `n` shards
        (records appended per prompt, up to the deadline), and the shards."""
        shards = plan_shards(todo, min(n, len(todo)))
        attempt = len(list(job.eval_dir.glob("attempt-*")))
        adir = job.eval_dir / f"attempt-{attempt:02d}"
        adir.mkdir()
        deadline = None if self.runner.deadline is None else self.runner.deadline - self.args.eval_stop_margin_s
        cmds = []
        for k, shard in enumerate(shards):
            items_file = adir / f"items-{k:02d}.jsonl"
            items_file.write_text("".join(json.dumps(i) + "\n" for i in shard), encoding="utf-8")
            cmd = [sys.executable, str(ENTRY), "worker", "--target", self.cfg.target.path,
                   "--drafter", str(job.drafter), "--items", str(items_file),
                   "--settings", json.dumps(job.settings.__dict__, default=list),
                   "--out", str(job.eval_dir / f"records-{attempt:02d}-{k:02d}.jsonl")]
            cmds.append((cmd + (["--deadline", str(deadline)] if deadline is not None else []),
                         adir / f"worker-{k:02d}.log"))
        return cmds, shards

    def decode_report(self, name: str, job: "DecodeJob") -> tuple[bool, dict]:
        """(complete, the job's eval info with its merged report under "_report") from its records so far."""
        from dflash_train.infer.evaluate import report_config

        done = read_records(job.eval_dir.glob("records-*.jsonl"))
        missing = {record_key(i["dataset"], i["id"]) for i in job.items} - set(done)
        finished = [i for i in job.items if record_key(i["dataset"], i["id"]) not in missing]
        config = report_config(job.settings.max_new_tokens, job.settings.temperature, drafter_block_size(job.drafter),
                               job.settings.tree_budgets)
        report = merged_report(config, finished, done, job.settings.mode_names())
        (job.eval_dir / "report.json").write_text(json.dumps(report, indent=1))
        job.info["_worker_prompt_s"] = round(sum(r.get("wall_s", 0.0) for r in done.values()), 1)
        job.info["_report"] = report
        if missing:
            self.log(f"eval {name}: {len(missing)} of {len(job.items)} prompts still to decode: run the same command "
                     "again")
        return not missing, job.info

    # ------------------------------------------------------------------ tau by replay

    def replay_drafters(self) -> dict[str, Path]:
        """Exported drafters to replay by name: each run's export and, with --curve-every, each checkpoint of
        the default run (exported once to curve/step-N)."""
        if self.given_drafter is not None:
            return {"default": self.given_drafter}
        out = {name: run / "export" for name, (run, _) in self.runs().items() if name not in self.failed}
        if self.args.curve_every:
            from dflash_train.commands.export import export_checkpoint
            from dflash_train.files.layout import list_checkpoints, step_folder, step_of

            for ckpt in list_checkpoints(self.run / "checkpoints"):
                name = step_folder(step_of(ckpt.name))
                folder = self.out / "curve" / name
                if not (folder / "model.safetensors").is_file():
                    export_checkpoint(ckpt, folder, "float32")
                out[name] = folder
        return out

    def stage_replay(self, items: list[dict]) -> dict[str, dict[str, dict]]:
        """Tau by replay of every eval prompt for every drafter: `{name: {record key: record}}`. The target's
        greedy continuations (the corpus) are made once and shared."""
        rdir = self.out / "replay"
        rdir.mkdir(parents=True, exist_ok=True)
        (rdir / "partial").mkdir(exist_ok=True)
        drafters = self.replay_drafters()
        # the widest step a drafter verifies: the anchor and its drafts (a DSpark block of B slots drafts B)
        block = 1 + max(drafter_facts(d)["drafts_per_block"] for d in drafters.values())
        settings = EvalSettings(**{**self.settings.__dict__, "baseline": False})
        corpus_key = hashlib.sha256(json.dumps({
            "items": [[i["dataset"], i["id"], i["turns"]] for i in items], "target": self.cfg.target.path,
            "max_new": settings.max_new_tokens, "block": block, "dtype": settings.dtype,
            "target_quantize": settings.target_quantize,
        }, sort_keys=True).encode()).hexdigest()
        corpus = rdir / f"corpus-{corpus_key[:16]}.jsonl"
        me, settings_json = str(ENTRY), json.dumps(settings.__dict__, default=list)
        t0 = time.time()
        if not corpus.is_file():
            items_file = rdir / "items.jsonl"
            items_file.write_text("".join(json.dumps(i) + "\n" for i in items), encoding="utf-8")
            self.log(f"replay: generating the target's greedy continuations of {len(items)} prompts -> {corpus}")
            run_helpers([[sys.executable, me, "corpus", "--target", self.cfg.target.path, "--items", str(items_file),
                          "--block-size", str(block), "--settings", settings_json, "--out", str(corpus)]],
                        rdir, "corpus", self.runner, self.args.device, self.log)
            self.runner.add_time("corpus_s", time.time() - t0)
        thresholds = ",".join(f"{c:g}" for c in self.args.confidence_thresholds)
        truncation = ["--confidence-thresholds", thresholds] if thresholds else []
        keys = {name: hashlib.sha256((corpus_key + file_sha256(d / "model.safetensors") + settings_json
                                      + (f"conf:{thresholds}" if thresholds else "")).encode())
                .hexdigest() for name, d in drafters.items()}
        known = json.loads((rdir / "keys.json").read_text()) if (rdir / "keys.json").is_file() else {}
        todo = [n for n in drafters if known.get(n) != keys[n] or not (rdir / f"{n}.jsonl").is_file()]
        if todo:
            # one process per drafter (each appends its records turn by turn): the walk is host-bound Python, so
            # processes overlap well on a GPU; on CPU one process for all (the target pass is shared)
            shards = [[n] for n in todo] if visible_gpus(self.args.device) else [todo]
            self.log(f"replay: {len(todo)} drafter(s) over {len(shards)} process(es): {', '.join(todo)}")
            t1 = time.time()
            run_helpers([[sys.executable, me, "replay", "--target", self.cfg.target.path, "--corpus", str(corpus),
                          "--settings", settings_json, "--out-dir", str(rdir)] + truncation
                         + [a for n in shard for a in ("--drafter", f"{n}={drafters[n]}",
                                                       "--partial", f"{n}={self.replay_partial(n, keys[n])}")]
                         for shard in shards],
                        rdir, "replay", self.runner, self.args.device, self.log)
            self.runner.add_time("replay_s", time.time() - t1)
            known.update({n: keys[n] for n in todo})
            (rdir / "keys.json").write_text(json.dumps(known, indent=1))
        return {name: read_records([rdir / f"{name}.jsonl"]) for name in drafters}

    def replay_partial(self, name: str, key: str) -> Path:
        """Where drafter `name`'s replay appends its turn records (`key`: the drafter, corpus and settings, so a
        changed drafter starts afresh)."""
        return self.out / "replay" / "partial" / f"{name}-{key[:16]}.jsonl"

    def eval_by_replay(self, items: list[dict], info: dict) -> tuple[bool, dict, dict]:
        """Replay every drafter on every eval prompt; with --check-decode, decode some prompts for real too.
        Returns (complete, eval info of the default drafter, the replay sections of the summary)."""
        from dflash_train.infer.evaluate import report_config

        records = self.stage_replay(items)
        drafters = self.replay_drafters()
        facts = {name: drafter_facts(d) for name, d in drafters.items()}
        modes = EvalSettings(**{**self.settings.__dict__, "baseline": False}).mode_names()  # every drafter's, at most
        own = {name: self.settings_for(d, baseline=False) for name, d in drafters.items()}  # no DDTree where refused
        reports = {name: merged_report(report_config(own[name].max_new_tokens, own[name].temperature,
                                                     facts[name]["block_size"], own[name].tree_budgets),
                                       items, recs, own[name].mode_names())
                   for name, recs in records.items()}
        self.eval_dir.mkdir(parents=True, exist_ok=True)
        (self.eval_dir / "report.json").write_text(json.dumps(reports["default"], indent=1))
        info["_report"], info["_worker_prompt_s"] = reports["default"], None
        pooled_names = [n for n in POOLED if n in reports["default"]["datasets"]]
        by_slot = {name: {"drafter": facts[name],
                          "modes": acceptance_by_slot(reports[name], own[name].mode_names(),
                                                      facts[name]["drafts_per_block"], pooled_names)}
                   for name in reports}
        (self.out / "acceptance_by_slot.json").write_text(json.dumps(by_slot, indent=1))
        extra: dict = {"method": "replay", "argmax_mismatches": {
            name: sum(r.get("replay", {}).get("argmax_mismatches", 0) for r in recs.values())
            for name, recs in records.items()}}
        if self.given_drafter is None:
            extra["variants"] = {name: variant_row(self.variants.get(name, []), self.failed.get(name), reports.get(name),
                                                   train_summary(run), modes, pooled_names,
                                                   self.runner.times.get("train_s" if name == "default" else f"train_s:{name}"),
                                                   by_slot.get(name))
                                 for name, (run, _) in self.runs().items()}
        if self.args.confidence_thresholds:
            extra["confidence_truncation"] = self.truncation_section(items, records, facts, reports, pooled_names)
        reranked = self.reranker_section(items, records, facts, reports, pooled_names)
        if reranked:
            extra["reranker"] = reranked
        if self.args.curve_every and self.given_drafter is None:
            from dflash_train.files.layout import step_of

            times = metric_times(self.run)
            extra["curve"] = [{"step": step_of(name), "train_s_after_first_log": times.get(step_of(name)),
                               "tau_mt-bench+sharegpt": pooled_tau(reports[name], modes, pooled_names),
                               "tau_all": pooled_tau(reports[name], modes)}
                              for name in sorted(n for n in reports if step_of(n) is not None)]
        complete = True
        if self.args.check_decode:
            complete, extra["decode_check"] = self.decode_check(items, info, records, drafters)
        return complete, info, extra

    def truncation_section(self, items: list[dict], records: dict[str, dict[str, dict]], facts: dict[str, dict],
                           reports: dict[str, dict], pooled_names: list[str]) -> dict:
        """--confidence-thresholds: the summary's confidence truncation section, per drafter with a confidence head
        (`confidence_truncation`); its truncated modes are kept out of the reports of the other tables."""
        from dflash_train.infer.evaluate import report_config
        from dflash_train.infer.replay import confidence_mode

        thresholds = tuple(self.args.confidence_thresholds)
        modes = [confidence_mode(c) for c in thresholds]
        drafters = {}
        for name, recs in records.items():
            if facts[name]["confidence_head"]:
                truncated = merged_report(report_config(self.settings.max_new_tokens, 0.0, facts[name]["block_size"],
                                                        ()), items, recs, modes)
                drafters[name] = confidence_truncation(reports[name], truncated, thresholds,
                                                       facts[name]["drafts_per_block"], pooled_names)
        return {"thresholds": list(thresholds), "drafters": drafters}

    def reranker_section(self, items: list[dict], records: dict[str, dict[str, dict]], facts: dict[str, dict],
                         reports: dict[str, dict], pooled_names: list[str]) -> dict:
        """The summary's reranker section: for each drafter that reranks its backbone's candidates (its replay
        records hold `replay.ARGMAX_MODE`), block tau of its drafts beside its backbone's argmax (`reranker_rows`)."""
        from dflash_train.infer.evaluate import report_config
        from dflash_train.infer.replay import ARGMAX_MODE

        out = {}
        for name, recs in records.items():
            if recs and all(ARGMAX_MODE in r["modes"] for r in recs.values()):
                plain = merged_report(report_config(self.settings.max_new_tokens, 0.0, facts[name]["block_size"], ()),
                                      items, recs, [ARGMAX_MODE])
                out[name] = reranker_rows(reports[name], plain, pooled_names)
        return out

    def decode_check(self, items: list[dict], info: dict, replayed: dict[str, dict[str, dict]],
                     drafters: dict[str, Path]) -> tuple[bool, dict]:
        """--check-decode N: the first N prompts of each set decoded for real with every trained drafter (the
        default's with the target alone too: its speedup and lossless check), all at once, and compared with their
        replay turn by turn: (complete, the summary's decode_check section)."""
        from dflash_train.files.layout import step_of

        per_ds: dict[str, int] = {}
        check_items = []
        for item in items:
            if per_ds.get(item["dataset"], 0) < self.args.check_decode:
                per_ds[item["dataset"]] = per_ds.get(item["dataset"], 0) + 1
                check_items.append(item)
        names = [n for n in drafters if step_of(n) is None]  # the trained runs, not the curve's checkpoints
        check_info = {k: dict(v) for k, v in info.items() if not k.startswith("_")}
        jobs = {name: DecodeJob(drafters[name], check_items, json.loads(json.dumps(check_info)),
                                self.out / "eval-decode" / name,
                                self.settings_for(drafters[name], baseline=name == "default"))
                for name in names}
        done = self.decode_jobs(jobs)
        checks = {}
        for name, (_, job_info) in done.items():
            rep = job_info["_report"]
            decoded = {record_key(r["dataset"], r["id"]): r for r in rep["outputs"]}
            checks[name] = {
                "agreement": compare_with_decoding(decoded, replayed[name],
                                                   [m for m in jobs[name].settings.mode_names() if m != "target"]),
                "lossless_mismatches": (sum(len(b["lossless_mismatches"]) for b in rep["datasets"].values())
                                        if jobs[name].settings.baseline else None)}
        rep = done["default"][1]["_report"]
        return all(c for c, _ in done.values()), {
            "prompts": len(check_items), "per_dataset": per_ds, "drafters": checks,
            "speedup": {ds: {m: b["modes"][m].get("speedup") for m in b["modes"] if m != "target"}
                        for ds, b in rep["datasets"].items()},
            "decode_tokens_per_s": {ds: {m: b["modes"][m]["decode_tokens_per_s"] for m in b["modes"]}
                                    for ds, b in rep["datasets"].items()},
        }

    # ------------------------------------------------------------------ summary

    def summarize(self, complete: bool, info: dict, extra: Optional[dict] = None) -> dict:
        """summary.json and summary.md of this call's eval (and what was trained); returns the summary."""
        report = info.pop("_report")
        worker_s = info.pop("_worker_prompt_s")
        if self.given_drafter is None:
            manifest = json.loads((self.prepared / "manifest.json").read_text())
            data = {"file": str(self.args.data), "rows_read": manifest["counts"]["rows_read"],
                    "rows_kept": manifest["counts"]["kept"], "rejected": manifest["counts"]["rejected"],
                    "train_rows": manifest["splits"]["train"]["rows"], "val_rows": manifest["splits"]["val"]["rows"]}
            if self.regen:
                data["regen"] = self.regen_summary()
            train = train_summary(self.run)
        else:  # not trained here: the run directory beside an export (run/export), when there is one
            data = {"file": self.overlap_data, "used_for": "the overlap filter only (drafter given)"}
            run = self.given_drafter.parent
            train = train_summary(run) if (run / "metrics.jsonl").is_file() else {"records": 0}
        datasets = dataset_summaries(report, info)
        summary = {
            "complete": complete,
            "reference": REFERENCE,
            "config": str(self.args.config),
            "overrides": list(self.args.overrides),
            "drafter": drafter_origin(self.drafter_dir, self.given_drafter is not None),
            "data": data,
            "train": train,
            "eval": {"settings": {**self.settings.__dict__, "tree_budgets": list(self.settings.tree_budgets),
                                  "overlap_prefix_chars": self.args.overlap_prefix,
                                  "overlap_filter_data": self.overlap_data, "workers": self.workers()},
                     "datasets": datasets,
                     "pooled_tau": pooled_by_mode(datasets, [m for m in self.settings.mode_names() if m != "target"]),
                     "worker_prompt_s": worker_s},
            "wall_s": self.runner.times,
            "dropped_ids": {n: m["dropped_ids"] for n, m in info.items()},
            "method": "decode",
            **(extra or {}),
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1, default=list))
        (self.out / "summary.md").write_text(summary_markdown(summary))
        return summary
