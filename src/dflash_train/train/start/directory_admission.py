"""May this `train` command start in its run directory? Decided before anything is written there.

A run directory has one owner and one history:
- a fresh start needs a directory that holds no run (`--overwrite` moves one aside, never deletes it);
- `--resume` continues the run with its own config.yaml; overrides (and a CONFIG given anyway) may only
  change the keys in RESUMABLE, which keep the run's meaning and its exact resume; any other difference
  is refused, naming the key and both values;
- nobody starts in a directory whose run is still alive;
- a refused start writes nothing: config, status, metrics, checkpoints and export stay byte-identical;
- a start that failed on a user error before its first checkpoint leaves no run behind: the process that owns
  the start removes what it wrote (`undo_refused_start`), and a trace left anyway (a detached or torchrun start)
  does not block the same command, fixed: the next fresh start clears it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ... import assets
from ...config.load import config_to_dict, load_config, old_key_names
from ...config.schema import Config
from ...data.formats import DamagedDataFile, check_readable, expand_source
from ...data.store import SPLITS, PreparedDataset, is_prepared
from ...errors import ConfigError, UserError
from ...files.layout import list_checkpoints
from ...run.directory import ENDED, RunDir
from ...run.status import liveness

log = logging.getLogger(__name__)

# Keys a resumed run may change: how long it trains, how often it logs, saves and validates, which trackers it
# reports to, and whether the target is sharded (an fsdp capture is the same numbers, a tp one the same up to the
# all-reduce's rounding: a run that outgrew its GPUs' memory continues sharded). The data order, anchors,
# optimizer and model are untouched by them.
RESUMABLE = ("optim.max_steps", "optim.epochs", "run.log_every", "run.save_every", "run.keep_last",
             "run.eval_every", "run.progress_bar", "run.compile_cache_dir", "run.report_to", "target.sharding",
             "target.shard_group_size")
LENGTH_KEYS = ("optim.max_steps", "optim.epochs")


@dataclass
class Start:
    """An admitted start: the config to run and, on resume, the changes accepted against the run's own."""

    cfg: Config
    run_dir: Path
    resume: bool
    changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    moved_aside: Optional[Path] = None
    cleared: list[str] = field(default_factory=list)  # the trace of a refused start this start removed
    already_done: Optional[str] = None  # a resume of a finished run with nothing to add: what to say


def with_step_cap(cfg: Config, max_steps: Optional[int]) -> Config:
    """`--max-steps N` as part of the run's config (optim.max_steps), so that a resume, which reads the
    run's config.yaml, trains to the same end."""
    if not max_steps:
        return cfg
    cap = min(max_steps, cfg.optim.max_steps) if cfg.optim.max_steps else max_steps
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, max_steps=cap))


def with_max_steps_flag(cfg: Config, overrides: list[str], max_steps: Optional[int]) -> Config:
    """`--max-steps N` is `optim.max_steps=N` given on the command line: it replaces the config file's value, and
    beside an override of optim.max_steps that says otherwise it is refused (which one was meant is not ours to
    guess)."""
    if not max_steps:
        return cfg
    given = [o for o in overrides if o.split("=", 1)[0].strip() == "optim.max_steps"]
    if given and cfg.optim.max_steps != max_steps:
        raise ConfigError(f"--max-steps {max_steps} and the override {given[-1]} both set optim.max_steps: give one "
                          "of them")
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, max_steps=max_steps))


def flatten(cfg: Config) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for section, values in config_to_dict(cfg).items():
        for key, value in values.items():
            out[f"{section}.{key}"] = value
    return out


def live_owner(run: RunDir) -> Optional[str]:
    """Who is training in `run` right now (a message), or None."""
    try:
        status = json.loads(run.status.read_text())
        alive_at = run.status.stat().st_mtime
    except (OSError, ValueError):
        return None
    if status.get("phase") in ENDED or liveness(status, alive_at)[0] != "alive":
        return None
    return (f"{run.root} is in use: pid {status.get('pid')} on {status.get('host')} is running it (phase "
            f"{status.get('phase')}, step {status.get('step')}); stop it first: dflash-train stop {run.root}")


def holds_run_message(run: RunDir) -> str:
    return (f"{run.root} already holds a run ({'; '.join(run.contents())}). Continue it with --resume, start a new "
            "one with another --run-dir, or add --overwrite to move this one aside (it is renamed, not deleted)")


def admit_start(config_path: Optional[str], overrides: list[str], run_dir: Path, *, resume: bool,
                overwrite: bool = False, max_steps: Optional[int] = None, check_owner: bool = True) -> Start:
    """Check the start against the run directory; raises UserError (ConfigError) with what to do. The
    only write it makes is `--overwrite`'s rename of the old run, after every check has passed.
    `check_owner=False`: a process started by an admitted start (a rank, the detached launcher) only
    rebuilds the config; the directory is already its run's."""
    run = RunDir(run_dir)
    if resume:
        if overwrite:
            raise UserError("--resume continues the run in --run-dir, --overwrite moves it aside: give one of them")
        return _admit_resume(config_path, overrides, run, max_steps, check_owner)
    if config_path is None:
        raise UserError("train needs a CONFIG (e.g. configs/tiny-cpu.yaml), or --resume to continue the run in "
                        "--run-dir with its own config.yaml")
    cfg = with_max_steps_flag(load_config(config_path, overrides), overrides, max_steps)
    check_inputs_exist(cfg, config_path, overrides)
    if check_owner:
        check_data_readable(cfg)
    found = run.contents() if check_owner and run.root.is_dir() else []
    moved, cleared = None, []
    if found and run.holds_only_a_refused_start():
        cleared = run.remove_start_trace(keep_root=True)
        log.warning("removed the trace of an earlier start in %s that failed before training (%s)", run.root,
                    ", ".join(cleared))
        found = []
    if found:
        owner = live_owner(run)
        if owner:
            raise UserError(owner)
        if not overwrite:
            raise UserError(holds_run_message(run))
        moved = run.move_aside()
        log.warning("moved the run that was in %s aside to %s (--overwrite)", run.root, moved)
    return Start(cfg, run.root, False, moved_aside=moved, cleared=cleared)


@dataclass(frozen=True)
class Footprint:
    """The run directory as a start found it, once admitted: what the start may remove if it is refused later."""

    existed: bool
    names: frozenset[str]

    @classmethod
    def of(cls, run_dir: Path) -> "Footprint":
        existed = run_dir.is_dir()
        return cls(existed, frozenset(p.name for p in run_dir.iterdir()) if existed else frozenset())


def undo_refused_start(start: Start, before: Footprint) -> Optional[str]:
    """After a fresh start failed on a user error before its first checkpoint: remove what it wrote and put back
    the run `--overwrite` moved aside, so that the same command, fixed, just works. Returns what was done, or None
    when the directory holds more than such a trace (then nothing is touched)."""
    run = RunDir(start.run_dir)
    if start.resume or not run.holds_only_a_refused_start():
        return None
    run.remove_start_trace(before.names, keep_root=before.existed)
    done = f"removed what the failed start wrote in {run.root}"
    if start.moved_aside is not None and not run.root.exists():
        start.moved_aside.rename(run.root)
        done += f" and moved the old run back from {start.moved_aside}"
    return done


def _admit_resume(config_path: Optional[str], overrides: list[str], run: RunDir, max_steps: Optional[int],
                  check_owner: bool) -> Start:
    if not run.root.is_dir():
        raise UserError(f"--resume: {run.root} does not exist, so there is no run to continue; start one without "
                        "--resume")
    if not run.config.is_file():
        raise UserError(f"--resume: {run.root} holds no config.yaml, so it is not a run this tool started; start "
                        "one without --resume (or give the right --run-dir)")
    owner = live_owner(run) if check_owner else None
    if owner:
        raise UserError(owner)
    if not list_checkpoints(run.checkpoints):
        raise UserError(f"--resume: {run.root} has no checkpoint yet ({_phase_of(run)}), so there is nothing to "
                        "continue from; start it again with --overwrite (the old attempt is moved aside) or use "
                        "another --run-dir")
    recorded = load_config(run.config)
    asked = with_max_steps_flag(load_config(config_path or run.config, overrides), overrides, max_steps)
    changes = resume_changes(recorded, asked, run, config_path, overrides, max_steps)
    check_inputs_exist(asked, config_path or str(run.config), overrides)
    if check_owner:
        check_data_readable(asked)
    already = None
    if check_owner and _phase_of(run, raw=True) == "done" and not any(k in changes for k in LENGTH_KEYS):
        already = (f"{run.root} is already done ({_phase_of(run)}; the drafter is in {run.export}); nothing to "
                   "resume. To train it longer: --resume optim.max_steps=N (or optim.epochs=N)")
    return Start(asked, run.root, True, changes=changes, already_done=already)


def resume_changes(recorded: Config, asked: Config, run: RunDir, config_path: Optional[str],
                   overrides: list[str], max_steps: Optional[int]) -> dict[str, tuple[Any, Any]]:
    """The keys `asked` changes against the run's own config: RESUMABLE ones are returned, any other is refused
    with both values and where the new one came from."""
    before, after = flatten(recorded), flatten(asked)
    # An architecture's section exists only under its drafter.architecture: a key on one side only is a change too.
    changes = {k: (before.get(k), after.get(k)) for k in dict.fromkeys([*before, *after])
               if k not in before or k not in after or before[k] != after[k]}
    refused = [k for k in changes if k not in RESUMABLE]
    if refused:
        parts = [f"'{k}' is {changes[k][0]!r} in {run.config} and {changes[k][1]!r} by "
                 f"{_source_of(k, config_path, overrides, max_steps)}" for k in refused]
        raise ConfigError(
            f"--resume keeps the run's config, but {'; '.join(parts)}. A resumed run may change only "
            f"{', '.join(RESUMABLE)}; drop the change, or train a new run with another --run-dir")
    return changes


def _source_of(key: str, config_path: Optional[str], overrides: list[str], max_steps: Optional[int]) -> str:
    names = {key, *(old for old, new in old_key_names().items() if new == key)}  # an override may use an old name
    given = [o for o in overrides if o.split("=", 1)[0].strip() in names]
    if given:
        return f"the override {given[-1]}"
    if key == "optim.max_steps" and max_steps:
        return f"--max-steps {max_steps}"
    return f"the config file {config_path}"


def _phase_of(run: RunDir, raw: bool = False) -> str:
    try:
        status = json.loads(run.status.read_text())
    except (OSError, ValueError):
        return "" if raw else "no status.json"
    if raw:
        return str(status.get("phase"))
    where = f" in {status['failed_phase']}" if status.get("failed_phase") else ""
    return f"status: {status.get('phase')}{where} at step {status.get('step')}"


def check_inputs_exist(cfg: Config, config_path: Optional[str], overrides: list[str]) -> None:
    """The target and every data entry exist (cheap: no tokenising, no loading), so that a typo is reported
    in a second, naming the key and whether it came from the config file or an override."""
    def where(key: str) -> str:
        given = [o for o in overrides if o.split("=", 1)[0].strip() == key]
        return f"override {given[-1]}" if given else f"config file {config_path}"

    if not cfg.data.train_files:
        raise ConfigError(f"config key 'data.train_files' ({where('data.train_files')}) is empty: give conversation "
                          "files, prepared dataset directories (dflash-train prepare) or 'sharegpt'")
    if not assets.is_builtin_target(cfg.target.path) and not Path(cfg.target.path).expanduser().exists():
        raise ConfigError(f"config key 'target.path' ({where('target.path')}): {cfg.target.path} does not exist; "
                          "give a Hugging Face model folder, a .gguf file or 'smollm2'")
    for key in ("data.train_files", "data.val_files"):
        for entry in getattr(cfg.data, key.split(".")[1]):
            if is_prepared(entry):
                continue
            try:
                expand_source(entry)
            except FileNotFoundError as e:
                raise ConfigError(f"config key '{key}' ({where(key)}): {e}") from None


def check_data_readable(cfg: Config) -> None:
    """Every data entry can be read to its end before the run directory is written: a prepared dataset's
    manifest and shards open and hold the rows it counts; a raw file is read through (not tokenised), unless
    `data.skip_damaged_files` takes its rows before a damage as they load. A damaged file raises
    DamagedFileError naming it."""
    for entry in [*cfg.data.train_files, *cfg.data.val_files]:
        if is_prepared(entry):
            for split in SPLITS:
                PreparedDataset(entry, split).check_rows()
        elif not cfg.data.skip_damaged_files:
            try:
                check_readable([entry])
            except DamagedDataFile as e:
                e.skip_option = "data.skip_damaged_files=true (an override or in the config)"
                raise
