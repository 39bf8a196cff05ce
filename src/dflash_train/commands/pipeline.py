"""Resumable stages, shared by `dflash-train demo` and `benchmarks/quality.py`.

A root directory holds one pipeline's work and one state file (JSON): the recipe the root was made
with; per stage whether it is done, what it was run with (its key), its seconds over every call; and
named times the stages add (`StageRunner.add_time`). On each call the runner

- refuses a root made with another recipe, naming what differs (a root holds one recipe's work);
- skips a stage that is done, when every stage before it was skipped too, its key is unchanged and its
  outputs are all there; any other stage runs (a stage after one that ran runs again, as its inputs
  may have changed; stages reuse what they find, so that costs little);
- records a stage that raises as failed (the next call runs it again) and re-raises; a stage that
  raises `Unfinished` (a deadline, a stop request) ends the call, recorded as not done;
- says what it skipped and what it ran, with times.

    runner = StageRunner(root, {"size": 3}, say=print)
    report = runner.run([Stage("prepare", prepare, outputs=(root / "data",)), Stage("train", train)])
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ..errors import UserError
from ..files.io import write_text_atomic

STATE_FORMAT = 1


class RecipeMismatch(UserError):
    """The root was made with another recipe (or by an older version): its stages are not this run's."""


class Unfinished(Exception):
    """Raised by a stage that stopped before it was done (a deadline, a stop request): the same command
    continues it. The message says why."""


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[], Any]  # does the stage's work; its return value is the stage's result
    outputs: tuple[Path, ...] = ()  # a done stage with one of these missing runs again
    # JSON-able, or a function giving it when the runner reaches the stage: what the stage depends on beyond
    # the recipe; a done stage whose key changed runs again
    key: Any = None
    reuse: Optional[Callable[[], Any]] = None  # the result of a skipped stage (None without it)
    min_remaining_s: float = 0.0  # with a deadline: not started with less time left (Unfinished)


@dataclass
class Outcome:
    name: str
    status: str  # "ran", "skipped" (done in an earlier call), "unfinished"
    seconds: float  # in this call
    total_s: float  # over every call
    result: Any = None
    reason: str = ""  # why it is unfinished


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return not any(o.status == "unfinished" for o in self.outcomes)

    def result(self, name: str) -> Any:
        return next(o.result for o in self.outcomes if o.name == name)

    def describe(self) -> str:
        """One line: each stage, whether it ran or was skipped, and its seconds."""
        parts = []
        for o in self.outcomes:
            if o.status == "skipped":
                parts.append(f"{o.name} skipped (done earlier in {o.total_s:.0f} s)")
            elif o.status == "ran":
                parts.append(f"{o.name} ran ({o.seconds:.0f} s)")
            else:
                parts.append(f"{o.name} unfinished ({o.seconds:.0f} s this call)")
        return "stages: " + (", ".join(parts) if parts else "none")


class StageRunner:
    """The stages of one root (see the module docstring). `state_file` is the state's name in `root`;
    `label` names the pipeline in messages ("demo"); `remedy` ends a refusal ("remove it or pass
    --run-dir NEW_DIR"). A non-empty root without a state file is refused (files of an earlier version)
    unless `adopt_unstamped` (then its stages run and reuse what they find). `deadline`: epoch seconds."""

    def __init__(self, root: Path, recipe: dict, *, state_file: str = "pipeline.json", label: str = "pipeline",
                 remedy: str = "remove it or choose another directory", adopt_unstamped: bool = False,
                 deadline: Optional[float] = None, say: Callable[[str], None] = print):
        self.root = Path(root)
        self.path = self.root / state_file
        self.deadline = deadline
        self.say = say
        self.root.mkdir(parents=True, exist_ok=True)
        recipe = _as_json(recipe)
        if self.path.is_file():
            self.state = _read_state(self.path)
            if self.state["recipe"] != recipe:
                diffs = "; ".join(_differences(self.state["recipe"], recipe))
                raise RecipeMismatch(f"{self.root} holds a {label} made with another recipe or other overrides "
                                     f"({diffs}); {remedy}")
        elif any(self.root.iterdir()) and not adopt_unstamped:
            raise RecipeMismatch(f"{self.root} holds files from an earlier {label} version (no {state_file}); "
                                 f"{remedy}")
        else:
            self.state = {"format": STATE_FORMAT, "recipe": recipe, "stages": {}, "times": {}}
        self._save()

    # ------------------------------------------------------------------ time

    def remaining(self) -> float:
        """Seconds left before the deadline (infinite without one)."""
        return float("inf") if self.deadline is None else self.deadline - time.time()

    def add_time(self, key: str, seconds: float) -> None:
        """Add `seconds` to the named time `key` (kept over calls, like the stages' own)."""
        times = self.state["times"]
        times[key] = round(times.get(key, 0.0) + seconds, 2)
        self._save()

    def clear_time(self, key: str) -> None:
        """Forget the named time `key` (its work was thrown away)."""
        if self.state["times"].pop(key, None) is not None:
            self._save()

    @property
    def times(self) -> dict[str, float]:
        return dict(self.state["times"])

    def stage_record(self, name: str) -> dict:
        """What the state file holds on a stage: done, key, seconds, calls, last ("done", "unfinished: ...",
        "failed: ...", "running"), at (when it last ended)."""
        return dict(self.state["stages"].get(name, {}))

    # ------------------------------------------------------------------ stages

    def run(self, stages: Sequence[Stage]) -> Report:
        """Run or skip each stage in order; stops after an unfinished one. A failure is re-raised."""
        report = Report()
        ran_before: Optional[str] = None  # the first stage that ran in this call
        for stage in stages:
            rec = self.state["stages"].get(stage.name, {})
            why = self._why_run(stage, rec, ran_before)
            if why is None:
                self.say(f"{stage.name}: done in an earlier call ({rec.get('seconds', 0.0):.0f} s): skipped")
                result = stage.reuse() if stage.reuse is not None else None
                report.outcomes.append(Outcome(stage.name, "skipped", 0.0, rec.get("seconds", 0.0), result))
                continue
            if why:
                self.say(f"{stage.name}: {why}: running it again")
            if self.remaining() < stage.min_remaining_s:
                reason = (f"too little time left before the deadline ({max(self.remaining(), 0):.0f} s, "
                          f"it needs {stage.min_remaining_s:.0f} s)")
                self.say(f"{stage.name}: not started: {reason}; run the same command again")
                report.outcomes.append(Outcome(stage.name, "unfinished", 0.0, rec.get("seconds", 0.0), reason=reason))
                break
            ran_before = ran_before or stage.name
            outcome = self._run_one(stage)
            report.outcomes.append(outcome)
            if outcome.status == "unfinished":
                break
        self.say(report.describe())
        return report

    def _why_run(self, stage: Stage, rec: dict, ran_before: Optional[str]) -> Optional[str]:
        """None: skip the stage. Otherwise why it runs again ("" when it was never done)."""
        if not rec.get("done"):
            return ""
        if ran_before is not None:
            return f"done in an earlier call, but {ran_before} ran before it"
        if rec.get("key") != _key(stage):
            return "done in an earlier call with other inputs"
        gone = [p for p in stage.outputs if not Path(p).exists()]
        if gone:
            return f"done in an earlier call, but {gone[0]} is missing"
        return None

    def _run_one(self, stage: Stage) -> Outcome:
        rec = self.state["stages"].setdefault(stage.name, {"seconds": 0.0, "calls": 0})
        key = _key(stage)  # what it runs with (a stage may change what a later key would read)
        rec.update(done=False, last="running", started=_now())
        self._save()
        self.say(f"{stage.name} ...")
        t0 = time.time()
        try:
            result = stage.run()
        except Unfinished as e:
            seconds = self._end(rec, t0, f"unfinished: {e}")
            self.say(f"{stage.name}: not finished after {seconds:.0f} s: {e}")
            return Outcome(stage.name, "unfinished", seconds, rec["seconds"], reason=str(e))
        except BaseException as e:
            seconds = self._end(rec, t0, f"failed: {type(e).__name__}: {e}"[:500])
            self.say(f"{stage.name} failed after {seconds:.0f} s ({type(e).__name__}); the next call runs it again")
            raise
        rec["key"] = key
        seconds = self._end(rec, t0, "done", done=True)
        self.say(f"{stage.name} done in {seconds:.0f} s")
        return Outcome(stage.name, "ran", seconds, rec["seconds"], result)

    def _end(self, rec: dict, t0: float, last: str, done: bool = False) -> float:
        seconds = time.time() - t0
        rec.update(done=done, last=last, at=_now(), seconds=round(rec.get("seconds", 0.0) + seconds, 2),
                   calls=rec.get("calls", 0) + 1)
        rec.pop("started", None)
        self._save()
        return seconds

    def _save(self) -> None:
        write_text_atomic(self.path, json.dumps(self.state, indent=1) + "\n")


def _read_state(path: Path) -> dict:
    """The state file; a bare recipe stamp (what the demo wrote before this runner: no "stages") is read
    as that recipe with no stage done yet."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise RecipeMismatch(f"{path} is not valid JSON ({e}); remove it to start that directory over") from None
    if not isinstance(data, dict):
        raise RecipeMismatch(f"{path} does not hold a pipeline state; remove it to start that directory over")
    if "stages" not in data:
        return {"format": STATE_FORMAT, "recipe": data, "stages": {}, "times": {}}
    return {"format": data.get("format", STATE_FORMAT), "recipe": data.get("recipe"), "stages": data["stages"],
            "times": data.get("times", {})}


_MISSING = object()


def _differences(old: Any, new: Any, where: str = "") -> list[str]:
    """`key.sub: OLD there, NEW here` for every leaf that differs between two JSON values."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            out += _differences(old.get(k, _MISSING), new.get(k, _MISSING), f"{where}.{k}" if where else str(k))
        return out
    if old == new:
        return []
    show = lambda v: "(none)" if v is _MISSING else repr(v)  # noqa: E731
    return [f"{where or 'recipe'}: {show(old)} there, {show(new)} here"]


def _key(stage: Stage) -> Any:
    return _as_json(stage.key() if callable(stage.key) else stage.key)


def _as_json(value: Any) -> Any:
    """`value` as it reads back from JSON (tuples become lists), so that comparisons with the file hold."""
    return json.loads(json.dumps(value, sort_keys=True))


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")
