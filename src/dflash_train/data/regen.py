"""`dflash-train regen`: the target writes the assistant turns of a prompts / conversations file.

Input: any row shape `formats.py` knows (ShareGPT, OpenAI messages, `{prompt, response}`,
`{prompt}`) in JSONL / JSON / Parquet, or a built-in prompt set (`sharegpt` (training split),
`mt-bench`, `humaneval`). Only the system turn and the user turns of a row are kept: the target
answers user turn 0, then user turn 1 with its own first answer in the history, and so on.

Output: JSONL, one `{"id": <file:line of the input row>, "messages": [...]}` per conversation
(OpenAI messages), which `prepare` and `train` read. Beside it:
- `OUT.regen.json`: the settings the file is produced with (a resume with other settings is refused);
- `OUT.rejects.jsonl`: `{"id", "reason", "detail"}` per row that was skipped.

Local generation (`regenerate`), resumable after a kill at any moment:
- order: the input is cut into windows of `sort_window` consecutive rows; within a window the rows
  are sorted by prompt length (longest first, ties by input position) and cut into batches of
  `batch_size`. The batches depend only on the input and these two numbers, never on what is done.
- each batch is generated turn by turn (turn k of every row of the batch that has one, in one
  `generate` call, left padded, KV cache), then its rows are appended to the output in one write,
  flushed and fsynced. A batch with some rows already done is generated again whole (so every row
  sees exactly the same batch as in an uninterrupted run) and only its missing rows are written.
- on start, the output and rejects files are read back: a torn last line (a write cut by the kill)
  is cut off, the ids of complete lines are done and skipped.
  Greedy decoding on the same machine therefore gives a byte-identical file whether or not the run
  was interrupted; sampling too, since each batch and turn reseeds from (seed, first row id, turn).

Serving engines (`batch_roundtrip`): `--export-batch` writes OpenAI batch requests (see
`batch_api.py`) for `vllm run-batch` / SGLang; `--import-batch` reads their responses back. A
request asks for one assistant turn of one row; multi-turn rows take one round per turn: each
export asks for the next unanswered turn of every row, with the imported answers of the earlier
turns in its history, so the target's own answers are fed back exactly as in local regen.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Union

from .. import assets
from ..runtime import publish, resolve_device, resolve_dtype, stop_token_ids, write_text_atomic
from . import batch_api
from .chat import prompt_ids
from .formats import BUILTIN_SOURCES, RowError, builtin_file, count_rows, iter_source, prompt_turns

log = logging.getLogger(__name__)

SIDECAR_FORMAT = 1
SHOW_REJECTS = 10  # rejects listed in the summary (all of them are in the rejects file)


class SettingsMismatch(ValueError):
    """The output exists but was produced with other settings."""


@dataclass
class RegenSettings:
    max_new_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    stop_token_ids: Optional[list[int]] = None  # None: the target's (dflash_target.json), else its eos
    thinking: Optional[bool] = None  # enable_thinking for the chat template (None: not passed)
    seed: int = 0
    batch_size: int = 16
    limit: int = 0  # the first N input rows (bad ones included); 0 = all
    sort_window: int = 4096  # rows sorted by prompt length together
    max_prompt_tokens: Optional[int] = None  # None: the target's context minus max_new_tokens
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    device: str = "auto"
    progress: bool = True
    model_name: Optional[str] = None  # batch export: body.model (default: --target as given)


# --------------------------------------------------------------------------- input rows


@dataclass
class Convo:
    """What regen keeps of a good input row: its id, an optional system turn and the user turns."""

    id: str
    system: list[dict[str, str]]
    users: list[str]


Entry = tuple[str, Union[Convo, RowError]]


def _convo(where: str, row: Any) -> Union[Convo, RowError]:
    if isinstance(row, RowError):
        return row
    try:
        prompts = prompt_turns(row)
    except RowError as e:
        return e
    return Convo(where, prompts.system, prompts.users)


def check_sources(sources: Iterable[str]) -> list[str]:
    """Fail before any model loads: every source must be a built-in name or an existing file."""
    sources = [str(s) for s in sources]
    if not sources:
        raise ValueError("no --data given")
    dup = [s for s, n in Counter(sources).items() if n > 1]
    if dup:
        raise ValueError(f"--data lists {dup[0]!r} twice")
    for spec in sources:
        if spec in BUILTIN_SOURCES:
            builtin_file(spec)
        elif not Path(spec).is_file():
            raise FileNotFoundError(
                f"--data {spec!r}: no such file (built-in sets: {', '.join(BUILTIN_SOURCES)}; "
                "files: JSONL, JSON, Parquet)")
    return sources


def iter_entries(sources: list[str], limit: int = 0) -> Iterator[Entry]:
    """(id, Convo or RowError) per row of the sources (ids as `formats` gives them), the first `limit`."""
    n = 0
    for spec in sources:
        for where, row in iter_source(spec):
            if limit and n >= limit:
                return
            n += 1
            yield where, _convo(where, row)


def _windows(entries: Iterator[Entry], size: int) -> Iterator[list[Entry]]:
    buf: list[Entry] = []
    for e in entries:
        buf.append(e)
        if len(buf) >= size:
            yield buf
            buf = []
    if buf:
        yield buf


# --------------------------------------------------------------------------- output files


def side_paths(out: Path) -> tuple[Path, Path]:
    """(settings sidecar, rejects file) of an output file."""
    return out.with_name(out.name + ".regen.json"), out.with_name(out.name + ".rejects.jsonl")


_ID_PREFIX = b'{"id": '
_DECODER = json.JSONDecoder()


def _line_id(raw: bytes, full: bool) -> tuple[Optional[str], Optional[dict]]:
    """(id, record if `full`) of a complete line, (None, None) if unreadable. Lines this module writes
    start with the id, so a resume reads a huge output fast without decoding whole conversations."""
    try:
        if not full and raw.startswith(_ID_PREFIX):
            rid, _ = _DECODER.raw_decode(raw[len(_ID_PREFIX):].decode("utf-8"))
            return (rid, None) if isinstance(rid, str) else (None, None)
        rec = json.loads(raw)
        return (rec["id"], rec) if isinstance(rec["id"], str) else (None, None)
    except (ValueError, KeyError, TypeError):
        return None, None


def read_done_ids(path: Path, full: bool = False) -> dict[str, Optional[dict]]:
    """Ids of the complete records of a JSONL file this module appends to (-> the record when `full`).
    A torn last line (a write cut short by a kill) is removed from the file; a broken line before the
    last one is an error."""
    ids: dict[str, Optional[dict]] = {}
    if not path.exists():
        return ids
    good_end = 0
    bad: Optional[int] = None  # line number of an unreadable line
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if bad is not None:
                raise ValueError(f"{path}:{bad} is not a valid record and is not the last line: the file was "
                                 "edited or damaged; repair or remove it")
            rid, rec = _line_id(raw, full) if raw.endswith(b"\n") else (None, None)
            if rid is None:
                bad = lineno
                continue
            ids[rid] = rec
            good_end += len(raw)
    if bad is not None:
        log.warning("%s: dropping a torn last line (line %d, cut short by an interrupted run)", path, bad)
        with open(path, "r+b") as f:
            f.truncate(good_end)
            f.flush()
            os.fsync(f.fileno())
    return ids


class Appender:
    """Appends JSON lines; each `write` is one write call, flushed and fsynced."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "ab")

    def write(self, records: list[dict]) -> None:
        if not records:
            return
        self.f.write(b"".join(json.dumps(r, ensure_ascii=False).encode("utf-8") + b"\n" for r in records))
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self) -> None:
        self.f.close()


def check_settings(out: Path, mode: str, settings: dict[str, Any]) -> None:
    """Refuse to extend an output produced with other settings; record the settings otherwise."""
    sidecar, rejects = side_paths(out)
    has_rows = any(p.exists() and p.stat().st_size > 0 for p in (out, rejects))
    start_over = (f"run with the original settings to continue, or choose another --out (or delete {out}, "
                  f"{sidecar.name} and {rejects.name} to start over)")
    if has_rows:
        if not sidecar.exists():
            raise SettingsMismatch(f"{out} exists but {sidecar} does not, so the settings it was produced with are "
                                   f"unknown; {start_over}")
        try:
            prev = json.loads(sidecar.read_text(encoding="utf-8"))
            prev_mode, prev_settings = prev["mode"], prev["settings"]
        except (ValueError, KeyError, TypeError):
            raise SettingsMismatch(f"{sidecar} is unreadable; {start_over}") from None
        if prev_mode != mode:
            raise SettingsMismatch(f"{out} was produced by {prev_mode!r} (this run is {mode!r}); {start_over}")
        diffs = [f"{k}: {prev_settings.get(k)!r} there, {settings.get(k)!r} now"
                 for k in sorted(set(prev_settings) | set(settings)) if prev_settings.get(k) != settings.get(k)]
        if diffs:
            raise SettingsMismatch(f"{out} was produced with other settings ({'; '.join(diffs)}); {start_over}")
        return
    from .. import __version__ as version

    record = {"format": SIDECAR_FORMAT, "mode": mode, "settings": settings,
              "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "dflash_train": version}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(sidecar, json.dumps(record, indent=1) + "\n")


def _reject(where: str, reason: str, detail: str = "") -> dict:
    return {"id": where, "reason": reason, "detail": detail}


def _detail(e: RowError) -> str:
    """The message of a RowError without its leading reason."""
    msg = str(e)
    return msg[len(e.reason) + 2:] if msg.startswith(e.reason + ": ") else ("" if msg == e.reason else msg)


@dataclass
class Summary:
    out: str = ""
    rejects_file: str = ""
    rows_written: int = 0
    already_done: int = 0
    rejected: Counter = field(default_factory=Counter)
    truncated: Counter = field(default_factory=Counter)
    new_tokens: int = 0
    elapsed_s: float = 0.0
    first_rejects: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # batch mode: requests, missing, unmatched, ...

    def reject(self, where: str, reason: str, detail: str = "") -> None:
        self.rejected[reason] += 1
        if len(self.first_rejects) < SHOW_REJECTS:
            self.first_rejects.append((where, reason, detail))

    def as_dict(self) -> dict:
        d = asdict(self)
        d["rejected"], d["truncated"] = dict(self.rejected), dict(self.truncated)
        d["tokens_per_s"] = self.new_tokens / self.elapsed_s if self.elapsed_s else 0.0
        d["rows_per_s"] = self.rows_written / self.elapsed_s if self.elapsed_s else 0.0
        return d

    def format(self) -> str:
        def counts(c: Counter) -> str:
            return ", ".join(f"{k}: {v}" for k, v in c.most_common())

        n_rej = sum(self.rejected.values())
        rejected = f"{n_rej} rejected" + (f" ({counts(self.rejected)})" if n_rej else "")
        lines = [f"regen: {self.rows_written} conversations written, {self.already_done} already done, {rejected}"
                 if self.out else f"regen: {rejected}"]
        if self.truncated:
            lines.append(f"  {sum(self.truncated.values())} conversations end early ({counts(self.truncated)}): "
                         "their later user turns are dropped")
        if self.new_tokens:
            d = self.as_dict()
            lines.append(f"  {self.new_tokens} new tokens in {self.elapsed_s:.1f} s: {d['tokens_per_s']:.1f} tokens/s, "
                         f"{d['rows_per_s']:.2f} rows/s")
        for where, reason, detail in self.first_rejects:
            lines.append(f"  rejected {where}: {reason}" + (f" ({detail})" if detail else ""))
        if n_rej > len(self.first_rejects):
            lines.append(f"  ... and {n_rej - len(self.first_rejects)} more")
        for k, v in self.extra.items():
            if k != "hint":
                lines.append(f"  {k}: {v}")
        if self.out:
            lines.append(f"output: {self.out}" + (f"   rejects: {self.rejects_file}" if n_rej else ""))
        elif n_rej and self.rejects_file:
            lines.append(f"rejects: {self.rejects_file}")
        if self.extra.get("hint"):
            lines.append(self.extra["hint"])
        return "\n".join(lines)


# --------------------------------------------------------------------------- local generation


def _batch_seed(seed: int, key: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}|{key}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


class LocalGenerator:
    """Batched generation with the target (HF `generate`, left padding, KV cache)."""

    def __init__(self, model, tokenizer, *, stop_token_ids: list[int], max_new_tokens: int, temperature: float,
                 top_p: float, seed: int, template_kwargs: Optional[dict] = None):
        from transformers import GenerationConfig

        self._model, self.tokenizer = model, tokenizer  # model: a module, or a callable that loads it
        self.stops = set(stop_token_ids)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_token_ids[0]
        self.sampling = temperature > 0
        self.seed = seed
        self.template_kwargs = template_kwargs or {}
        kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, do_sample=self.sampling,
                                  eos_token_id=list(stop_token_ids), pad_token_id=self.pad_id, repetition_penalty=1.0)
        if self.sampling:  # explicit, so that the model's own sampling defaults (top_k, ...) do not apply
            kw.update(temperature=temperature, top_p=top_p, top_k=0)
        self.gen_config = GenerationConfig(**kw)

    @property
    def model(self):
        if callable(self._model) and not hasattr(self._model, "generate"):
            self._model = self._model()
        return self._model

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return prompt_ids(self.tokenizer, messages, self.template_kwargs)

    def generate(self, prompts: list[list[int]], seed_key: str = "") -> list[list[int]]:
        """New tokens per prompt, up to and including the first stop token."""
        import torch

        from .batch import left_pad

        device = next(self.model.parameters()).device
        ids, mask = left_pad(prompts, self.pad_id)
        width = ids.shape[1]
        if self.sampling:
            torch.manual_seed(_batch_seed(self.seed, seed_key))
        with torch.no_grad():
            out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                      generation_config=self.gen_config)
        result = []
        for row in out[:, width:].tolist():
            cut = next((j for j, t in enumerate(row) if t in self.stops), None)
            result.append(row if cut is None else row[: cut + 1])
        return result

    def text(self, tokens: list[int]) -> str:
        if tokens and tokens[-1] in self.stops:
            tokens = tokens[:-1]
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def converse(self, batch: list[Convo], first_prompts: list[list[int]], max_prompt_tokens: int
                 ) -> list[tuple[list[dict[str, str]], int, Optional[str], int]]:
        """Answer every user turn of every row, turn by turn, batched across rows by turn index.
        Per row: (messages, answered turns, why it ended early or None, new tokens)."""
        msgs = [list(c.system) for c in batch]
        answered = [0] * len(batch)
        ended: list[Optional[str]] = [None] * len(batch)
        ntok = [0] * len(batch)
        for k in range(max(len(c.users) for c in batch)):
            active, prompts = [], []
            for i, c in enumerate(batch):
                if ended[i] or k >= len(c.users):
                    continue
                hist = msgs[i] + [{"role": "user", "content": c.users[k]}]
                ids = first_prompts[i] if k == 0 else self.prompt_ids(hist)
                if len(ids) > max_prompt_tokens:
                    ended[i] = "context full"
                    continue
                active.append((i, hist))
                prompts.append(ids)
            if not active:
                break
            for (i, hist), toks in zip(active, self.generate(prompts, seed_key=f"{batch[0].id}|{k}")):
                ntok[i] += len(toks)
                answer = self.text(toks)
                if not answer.strip():
                    ended[i] = "empty response"
                    continue
                msgs[i] = hist + [{"role": "assistant", "content": answer}]
                answered[i] += 1
        return [(msgs[i], answered[i], ended[i], ntok[i]) for i in range(len(batch))]


def regenerate(target: Union[str, Path], sources: Iterable[str], out: Union[str, Path],
               settings: Optional[RegenSettings] = None, *, model=None, tokenizer=None) -> dict:
    """Generate the assistant turns of `sources` with `target` into `out` (resumable; see the module
    docstring). Returns the summary as a dict (`Summary.as_dict`)."""
    from tqdm.auto import tqdm

    from ..model.target import load_target_model, load_tokenizer, read_target_config

    s = settings or RegenSettings()
    if s.max_new_tokens <= 0 or s.batch_size <= 0 or s.sort_window <= 0:
        raise ValueError("--max-new-tokens, --batch-size and --sort-window must be positive")
    sources = check_sources(sources)
    out = Path(out)
    target_path = assets.resolve_target(str(target))
    config = read_target_config(target_path)
    if tokenizer is None:
        tokenizer = load_tokenizer(target_path)
    stops = stop_token_ids(target_path, tokenizer, config, s.stop_token_ids)
    device = resolve_device(s.device)
    dtype = resolve_dtype(s.dtype, device)
    max_prompt = s.max_prompt_tokens
    if max_prompt is None:
        context = getattr(config, "max_position_embeddings", None)
        max_prompt = (context - s.max_new_tokens) if context else 1 << 30
        if max_prompt <= 0:
            raise ValueError(f"--max-new-tokens {s.max_new_tokens} leaves no room for a prompt in the target's "
                             f"context of {context} tokens")
    # --limit, --batch-size and --sort-window may change between runs (e.g. a smaller batch after an OOM).
    guarded = {"target": str(target_path), "data": sources, "max_new_tokens": s.max_new_tokens,
               "temperature": s.temperature, "top_p": s.top_p if s.temperature > 0 else None,
               "seed": s.seed if s.temperature > 0 else None, "stop_token_ids": stops, "thinking": s.thinking,
               "max_prompt_tokens": s.max_prompt_tokens, "dtype": str(dtype).replace("torch.", "")}
    check_settings(out, "generate", guarded)
    sidecar, rejects_path = side_paths(out)
    done_rejects = read_done_ids(rejects_path, full=True)
    done = set(read_done_ids(out)) | set(done_rejects)

    def load_model():  # on first use: a run with nothing left to do never loads the target
        log.info("loading target %s (%s, %s)", target_path, device, dtype)
        return load_target_model(target_path, dtype, device)

    template_kwargs = {"enable_thinking": s.thinking} if s.thinking is not None else None
    gen = LocalGenerator(model if model is not None else load_model, tokenizer, stop_token_ids=stops,
                         max_new_tokens=s.max_new_tokens,
                         temperature=s.temperature, top_p=s.top_p, seed=s.seed, template_kwargs=template_kwargs)

    summary = Summary(out=str(out), rejects_file=str(rejects_path))
    total = count_rows(sources, s.limit)
    bar = tqdm(total=total, initial=min(len(done), total), unit="row", dynamic_ncols=True, disable=not s.progress,
               desc="regen", file=sys.stderr)
    out_f, rej_f = Appender(out), Appender(rejects_path)
    t0 = time.perf_counter()
    try:
        for window in _windows(iter_entries(sources, s.limit), s.sort_window):
            if all(where in done for where, _ in window):  # finished: no need to tokenise it to sort it
                for where, e in window:
                    if where in done_rejects:
                        rec = done_rejects[where] or {}
                        summary.reject(where, rec.get("reason", "?"), rec.get("detail", ""))
                    else:
                        summary.already_done += 1
                continue
            new_rejects: list[dict] = []
            items = []  # (prompt length, position, convo, prompt ids)
            for pos, (where, e) in enumerate(window):
                if isinstance(e, Convo):
                    ids = gen.prompt_ids(e.system + [{"role": "user", "content": e.users[0]}])
                    if len(ids) <= max_prompt:
                        items.append((len(ids), pos, e, ids))
                        continue
                    e = RowError("prompt too long", f"{len(ids)} tokens > max prompt tokens {max_prompt}")
                summary.reject(where, e.reason, _detail(e))
                if where not in done:
                    new_rejects.append(_reject(where, e.reason, _detail(e)))
            rej_f.write(new_rejects)
            bar.update(len(new_rejects))
            items.sort(key=lambda t: (-t[0], t[1]))
            for b in range(0, len(items), s.batch_size):
                batch = items[b: b + s.batch_size]
                todo = sum(1 for it in batch if it[2].id not in done)
                for it in batch:
                    if it[2].id in done_rejects:
                        rec = done_rejects[it[2].id] or {}
                        summary.reject(it[2].id, rec.get("reason", "?"), rec.get("detail", ""))
                    elif it[2].id in done:
                        summary.already_done += 1
                if not todo:
                    continue
                convos = [it[2] for it in batch]
                results = gen.converse(convos, [it[3] for it in batch], max_prompt)
                rows, rejected = [], []
                for c, (msgs, answered, ended, ntok) in zip(convos, results):
                    if c.id in done:
                        continue
                    summary.new_tokens += ntok
                    if answered == 0:
                        reason, detail = ended or "empty response", "the target's first answer is empty"
                        summary.reject(c.id, reason, detail)
                        rejected.append(_reject(c.id, reason, detail))
                        continue
                    if answered < len(c.users):
                        summary.truncated[ended] += 1
                    rows.append({"id": c.id, "messages": msgs})
                out_f.write(rows)
                rej_f.write(rejected)
                summary.rows_written += len(rows)
                bar.update(todo)
                elapsed = time.perf_counter() - t0
                bar.set_postfix_str(f"{summary.new_tokens / max(elapsed, 1e-9):.1f} tok/s", refresh=False)
    except KeyboardInterrupt:
        summary.elapsed_s = time.perf_counter() - t0
        bar.close()
        print(summary.format() + "\ninterrupted: run the same command again to continue", file=sys.stderr)
        raise
    finally:
        out_f.close()
        rej_f.close()
    bar.close()
    summary.elapsed_s = time.perf_counter() - t0
    if summary.rows_written + summary.already_done == 0:
        raise ValueError(f"no usable row in {', '.join(sources)}: " + summary.format())
    return summary.as_dict()


# --------------------------------------------------------------------------- serving engines (OpenAI batch)


def batch_roundtrip(sources: Iterable[str], *, imports: Iterable[Union[str, Path]] = (),
                    export_path: Optional[Union[str, Path]] = None, out: Optional[Union[str, Path]] = None,
                    settings: Optional[RegenSettings] = None, model_name: Optional[str] = None) -> dict:
    """Import batch responses (`imports`) and/or export the next round of requests (`export_path`).

    Per row, the answers of turns 0, 1, ... are looked up by custom_id (`<id>#turn<k>`):
    - every user turn answered: the conversation is appended to `out` (rows already there are skipped);
    - the next turn unanswered (no response, or a failed one): exported as a request when
      `export_path` is given (its history holds the imported answers), otherwise reported: a failed
      response is rejected with its error, a missing first answer as `missing response`, and a
      missing later answer is counted as waiting for another round;
    - an empty answer ends the conversation there (rejected when it is the first one).
    The rejects file is rewritten on each run (it describes the last import).
    """
    s = settings or RegenSettings()
    sources = check_sources(sources)
    imports = [Path(p) for p in imports]
    for p in imports:
        if not p.is_file():
            raise FileNotFoundError(f"--import-batch {p}: no such file")
    if imports and out is None:
        raise ValueError("--import-batch needs --out (the conversations file to write)")
    if export_path is None and not imports:
        raise ValueError("nothing to do: give --export-batch and/or --import-batch")
    if export_path is not None and not model_name:
        raise ValueError("--export-batch needs --model NAME (the served model name) or --target")
    out = Path(out) if out is not None else None
    export_path = Path(export_path) if export_path is not None else None

    responses, unreadable = batch_api.read_responses(imports)
    summary = Summary()
    done: set[str] = set()
    out_f = None
    if out is not None:
        check_settings(out, "batch", {"data": sources})
        done = set(read_done_ids(out))
        out_f = Appender(out)
        summary.out = str(out)
    if out is not None:
        rejects_path = side_paths(out)[1]
    else:
        rejects_path = export_path.with_name(export_path.name + ".rejects.jsonl")
    summary.rejects_file = str(rejects_path)
    rejects: list[dict] = []

    def reject(where: str, reason: str, detail: str) -> None:
        summary.reject(where, reason, detail)
        rejects.append(_reject(where, reason, detail))

    for where, detail in unreadable:
        reject(where, "unreadable response line", detail)
    n_requests = 0
    export_f = None
    if export_path is not None:  # streamed into a temporary file, renamed into place at the end
        export_path.parent.mkdir(parents=True, exist_ok=True)
        export_tmp = export_path.with_name(f".{export_path.name}.tmp-{os.getpid()}")
        export_f = open(export_tmp, "w", encoding="utf-8")
    rows: list[dict] = []  # complete conversations, appended to `out` in chunks

    def flush_rows() -> None:
        if out_f is not None:
            out_f.write(rows)
            summary.rows_written += len(rows)
        rows.clear()

    turns_exported: Counter = Counter()
    retried = waiting = 0
    used: set[str] = set()
    try:
        for where, e in iter_entries(sources, s.limit):
            if isinstance(e, RowError):
                reject(where, e.reason, _detail(e))
                continue
            if where in done:
                summary.already_done += 1
                used.update(batch_api.custom_id(where, k) for k in range(len(e.users)))
                continue
            msgs = list(e.system)
            pending = None  # (turn, history, failed response or None)
            ended = None
            for k, user in enumerate(e.users):
                hist = msgs + [{"role": "user", "content": user}]
                cid = batch_api.custom_id(where, k)
                r = responses.get(cid)
                if r is not None:
                    used.add(cid)
                if r is None or r.content is None:
                    pending = (k, hist, r)
                    break
                if not r.content.strip():
                    ended = "empty response"
                    break
                msgs = hist + [{"role": "assistant", "content": r.content}]
            answered = sum(1 for m in msgs if m["role"] == "assistant")
            if pending is not None:
                k, hist, failed = pending
                cid = batch_api.custom_id(where, k)
                if export_f is not None:
                    seed = _batch_seed(s.seed, cid) % (1 << 31) if s.temperature > 0 else None
                    request = batch_api.make_request(
                        cid, hist, model=model_name, max_tokens=s.max_new_tokens, temperature=s.temperature,
                        top_p=s.top_p, seed=seed, thinking=s.thinking, stop_token_ids=s.stop_token_ids)
                    export_f.write(json.dumps(request, ensure_ascii=False) + "\n")
                    n_requests += 1
                    turns_exported[k] += 1
                    retried += failed is not None
                elif failed is not None:
                    reject(where, "batch error", f"turn {k}: {failed.error} ({failed.where})")
                elif k == 0:
                    reject(where, "missing response", f"no response with custom_id {cid}")
                else:
                    waiting += 1
                continue
            if answered == 0:
                reject(where, "empty response", "the first answer is empty")
                continue
            if answered < len(e.users):
                summary.truncated[ended] += 1
            rows.append({"id": where, "messages": msgs})
            if len(rows) >= 1024:
                flush_rows()
        flush_rows()
    except BaseException:
        if export_f is not None:
            export_f.close()
            export_tmp.unlink(missing_ok=True)
            export_f = None
        raise
    finally:
        if out_f is not None:
            out_f.close()
        if export_f is not None:
            export_f.close()
    if out is not None or rejects:
        write_text_atomic(rejects_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rejects))
    unmatched = len(set(responses) - used)
    if imports:
        summary.extra["responses read"] = len(responses)
        if unmatched:
            summary.extra["responses matching no row"] = unmatched
        if responses and unmatched == len(responses):
            summary.extra["hint"] = ("warning: no response matches a row: pass the same --data, spelled the same way "
                                     "(row ids are `file:line`), as for --export-batch")
    if export_f is not None:
        publish(export_tmp, export_path)
        per_turn = f" (per turn: {dict(sorted(turns_exported.items()))})" if n_requests else ""
        retries = f", {retried} of them retry a failed response" if retried else ""
        summary.extra["requests exported"] = f"{n_requests} to {export_path}{per_turn}{retries}"
        if n_requests:
            summary.extra["hint"] = (f"next: vllm run-batch -i {export_path} -o RESULTS.jsonl --model {model_name}, "
                                     "then run regen with --import-batch listing every results file so far (and "
                                     "--export-batch for the next round, until nothing is exported)")
    elif waiting:
        summary.extra["conversations waiting for another round"] = waiting
        summary.extra["hint"] = ("multi-turn rows need one round per turn: add --export-batch NEXT.jsonl to export "
                                 "their next turn")
    return summary.as_dict() | {"requests": n_requests, "waiting": waiting}


def format_summary(d: dict) -> str:
    """The human summary of a dict returned by `regenerate` or `batch_roundtrip`."""
    s = Summary(out=d["out"], rejects_file=d["rejects_file"], rows_written=d["rows_written"],
                already_done=d["already_done"], rejected=Counter(d["rejected"]), truncated=Counter(d["truncated"]),
                new_tokens=d["new_tokens"], elapsed_s=d["elapsed_s"], first_rejects=d["first_rejects"],
                extra=d["extra"])
    return s.format()
