"""Local regen: the target generates every assistant turn, batched, resumable (see the package docstring)."""

from __future__ import annotations

import inspect
import logging
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig

from ... import assets
from ...target.capture import load_target_model, load_tokenizer, read_target_config
from ...runtime import resolve_device, resolve_dtype
from ..batch import left_pad
from ..chat import prompt_ids
from ..formats import RowError, check_readable, count_rows
from .inputs import ENGINES, Convo, RegenSettings, batch_seed, check_sources, iter_entries, windows
from .journal import Appender, Summary, check_settings, read_done_ids, reject_record, side_paths

log = logging.getLogger(__name__)


def check_engine(engine: str, temperature: float) -> None:
    if engine not in ENGINES:
        raise ValueError(f"--engine {engine}: expected one of {', '.join(ENGINES)}")
    if engine == "continuous" and temperature > 0:
        raise ValueError(f"--engine continuous generates greedily only, and --temperature is {temperature}: its "
                         "sampled tokens would depend on which rows share a step, so a resume could not draw them "
                         "again; use --engine generate for sampling, or --temperature 0")


def token_batches(lengths: list[int], max_rows: int, max_tokens: int, new_tokens: int) -> list[range]:
    """Consecutive slices of prompts (in the given order, longest first for full batches) of at most `max_rows`
    prompts whose padded width, rows x (longest prompt + `new_tokens`), stays within `max_tokens` (0: no token
    bound). A prompt wider than the budget on its own goes alone."""
    out, start = [], 0
    while start < len(lengths):
        end, widest = start, 0
        while end < len(lengths) and end - start < max_rows:
            widest_next = max(widest, lengths[end])
            if max_tokens and end > start and (end - start + 1) * (widest_next + new_tokens) > max_tokens:
                break
            widest, end = widest_next, end + 1
        out.append(range(start, end))
        start = end
    return out


class LocalGenerator:
    """Batched generation with the target (HF `generate`, left padding, KV cache). `batch_tokens` (0: off)
    bounds each generate call's padded width, rows x (longest prompt + max_new_tokens), which is what its
    memory grows with: a wider call is split, longest prompts first."""

    def __init__(self, model, tokenizer, *, stop_token_ids: list[int], max_new_tokens: int, temperature: float,
                 top_p: float, seed: int, template_kwargs: Optional[dict] = None, batch_tokens: int = 0,
                 engine: str = "generate"):
        check_engine(engine, temperature)
        self._model, self.tokenizer = model, tokenizer  # model: a module, or a callable that loads it
        self.max_new_tokens, self.batch_tokens, self.engine = max_new_tokens, batch_tokens, engine
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
        """New tokens per prompt, up to and including the first stop token; in calls within `batch_tokens`."""
        if self.engine == "continuous":  # unpadded: batch_tokens does not apply
            return [self._cut(toks) for toks in self._generate_continuous(prompts)]
        if not self.batch_tokens:
            return self._generate(prompts, seed_key)
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        chunks = token_batches([len(prompts[i]) for i in order], len(prompts), self.batch_tokens, self.max_new_tokens)
        result: list[list[int]] = [[] for _ in prompts]
        for n, chunk in enumerate(chunks):
            picked = [order[j] for j in chunk]
            key = seed_key if len(chunks) == 1 else f"{seed_key}|{n}"
            for i, toks in zip(picked, self._generate([prompts[i] for i in picked], key)):
                result[i] = toks
        return result

    def _generate(self, prompts: list[list[int]], seed_key: str) -> list[list[int]]:
        device = next(self.model.parameters()).device
        ids, mask = left_pad(prompts, self.pad_id)
        width = ids.shape[1]
        if self.sampling:
            torch.manual_seed(batch_seed(self.seed, seed_key))
        with torch.no_grad():
            out = self.model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                      generation_config=self.gen_config)
        return [self._cut(row) for row in out[:, width:].tolist()]

    def _generate_continuous(self, prompts: list[list[int]]) -> list[list[int]]:
        """transformers' continuous batching (`generate_batch`) of these prompts. It logs, not raises, a request
        that failed or went missing: either stops the run here, before anything of the batch is written. Answers
        are matched to prompts by their token ids (identical prompts get identical greedy answers), which holds
        whatever order a transformers version returns them in."""
        if not log.isEnabledFor(logging.DEBUG):  # its per-call INFO lines (cache sizes, thread stops): -v shows them
            logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)
        call = self.model.generate_batch
        kw = {"warmup": self.model.device.type == "cuda"} if "warmup" in inspect.signature(call).parameters else {}
        with torch.no_grad():  # warmup: CUDA graphs, none on a CPU
            out = call(inputs=prompts, generation_config=self.gen_config, progress_bar=False, **kw)
        results = list(out.values()) if isinstance(out, dict) else list(out)
        by_prompt = {tuple(r.prompt_ids): r for r in results if r.error is None}
        failed = [r.error for r in results if r.error is not None]
        missing = sum(tuple(p) not in by_prompt for p in prompts)
        if failed or missing:
            why = failed[0] if failed else f"{missing} of {len(prompts)} requests missing"
            raise RuntimeError(f"regen --engine continuous: transformers' continuous batching failed ({why}); "
                               "run the same command again with --engine generate (the rows written so far are kept)")
        return [list(by_prompt[tuple(p)].generated_tokens) for p in prompts]

    def _cut(self, row: list[int]) -> list[int]:
        """`row` up to and including its first stop token."""
        cut = next((j for j, t in enumerate(row) if t in self.stops), None)
        return row if cut is None else row[: cut + 1]

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


def max_prompt_tokens(s: RegenSettings, config) -> int:
    """--max-prompt-tokens, else the target's context less --max-new-tokens (no bound for a target without one)."""
    if s.max_prompt_tokens is not None:
        return s.max_prompt_tokens
    context = getattr(config, "max_position_embeddings", None)
    max_prompt = (context - s.max_new_tokens) if context else 1 << 30
    if max_prompt <= 0:
        raise ValueError(f"--max-new-tokens {s.max_new_tokens} leaves no room for a prompt in the target's "
                         f"context of {context} tokens")
    return max_prompt


def guarded_settings(s: RegenSettings, target: Union[str, Path], target_path: Path, sources: list[str],
                     stops: list[int], dtype: torch.dtype) -> dict:
    """The settings an output's rows depend on: a resume must give the same ones (--limit, --batch-size and
    --sort-window may change between runs, e.g. a smaller batch after an OOM)."""
    return {"target": assets.target_identity(str(target), target_path), "data": sources,
            "max_new_tokens": s.max_new_tokens,
            "temperature": s.temperature, "top_p": s.top_p if s.temperature > 0 else None,
            "seed": s.seed if s.temperature > 0 else None, "stop_token_ids": stops, "thinking": s.thinking,
            "max_prompt_tokens": s.max_prompt_tokens, "dtype": str(dtype).replace("torch.", ""),
            **({"max_turns": s.max_turns} if s.max_turns else {})}  # absent when 0: older outputs continue


def count_earlier(where: str, done_rejects: dict, summary: Summary) -> None:
    """A row an earlier run finished: its rejection again in the summary, else one more row already done."""
    if where in done_rejects:
        rec = done_rejects[where] or {}
        summary.reject(where, rec.get("reason", "?"), rec.get("detail", ""))
    else:
        summary.already_done += 1


def window_prompts(window: list, gen: LocalGenerator, max_prompt: int, done: set,
                   summary: Summary) -> tuple[list[tuple], list[dict]]:
    """A window's conversations with their first prompts, (prompt length, position, convo, prompt ids), longest
    first; and the reject records of its rows new to this run (unreadable, or a first prompt over `max_prompt`)."""
    new_rejects: list[dict] = []
    items = []
    for pos, (where, e) in enumerate(window):
        if isinstance(e, Convo):
            ids = gen.prompt_ids(e.system + [{"role": "user", "content": e.users[0]}])
            if len(ids) <= max_prompt:
                items.append((len(ids), pos, e, ids))
                continue
            e = RowError("prompt too long", f"{len(ids)} tokens > max prompt tokens {max_prompt}")
        summary.reject(where, e.reason, e.detail)
        if where not in done:
            new_rejects.append(reject_record(where, e.reason, e.detail))
    items.sort(key=lambda t: (-t[0], t[1]))
    return items, new_rejects


def answered_rows(convos: list[Convo], results: list, done: set, summary: Summary) -> tuple[list[dict], list[dict]]:
    """A batch's new output rows and reject records (a conversation whose first answer is empty)."""
    rows, rejected = [], []
    for c, (msgs, answered, ended, ntok) in zip(convos, results):
        if c.id in done:
            continue
        summary.new_tokens += ntok
        if answered == 0:
            reason, detail = ended or "empty response", "the target's first answer is empty"
            summary.reject(c.id, reason, detail)
            rejected.append(reject_record(c.id, reason, detail))
            continue
        if answered < len(c.users):
            summary.truncated[ended] += 1
        rows.append({"id": c.id, "messages": msgs})
    return rows, rejected


def regenerate(target: Union[str, Path], sources: Iterable[str], out: Union[str, Path],
               settings: Optional[RegenSettings] = None, *, model=None, tokenizer=None) -> dict:
    """Generate the assistant turns of `sources` with `target` into `out` (resumable; see the package
    docstring). Returns the summary as a dict (`Summary.as_dict`)."""
    s = settings or RegenSettings()
    if s.max_new_tokens <= 0 or s.batch_size <= 0 or s.sort_window <= 0 or s.batch_tokens < 0:
        raise ValueError("--max-new-tokens, --batch-size and --sort-window must be positive, --batch-tokens >= 0")
    check_engine(s.engine, s.temperature)
    sources = check_sources(sources)
    if not s.skip_damaged_files:
        check_readable(sources, s.limit)  # a damaged file: said before anything is loaded or written
    out = Path(out)
    target_path = assets.resolve_target(str(target))
    config = read_target_config(target_path)
    if tokenizer is None:
        tokenizer = load_tokenizer(target_path)
    stops = assets.stop_token_ids(target_path, tokenizer, config, s.stop_token_ids)
    device = resolve_device(s.device)
    dtype = resolve_dtype(s.dtype, device)
    max_prompt = max_prompt_tokens(s, config)
    check_settings(out, "generate", guarded_settings(s, target, target_path, sources, stops, dtype),
                   also_accepted={"target": str(target_path)})
    sidecar, rejects_path = side_paths(out)
    done_rejects = read_done_ids(rejects_path, full=True)
    done = set(read_done_ids(out)) | set(done_rejects)

    def load_model():  # on first use: a run with nothing left to do never loads the target
        log.info("loading target %s (%s, %s)", target_path, device, dtype)
        return load_target_model(target_path, dtype, device)

    template_kwargs = {"enable_thinking": s.thinking} if s.thinking is not None else None
    gen = LocalGenerator(model if model is not None else load_model, tokenizer, stop_token_ids=stops,
                         max_new_tokens=s.max_new_tokens,
                         temperature=s.temperature, top_p=s.top_p, seed=s.seed, template_kwargs=template_kwargs,
                         batch_tokens=s.batch_tokens, engine=s.engine)

    summary = Summary(out=str(out), rejects_file=str(rejects_path))
    total = count_rows(sources, s.limit)
    bar = tqdm(total=total, initial=min(len(done), total), unit="row", dynamic_ncols=True, disable=not s.progress,
               desc="regen", file=sys.stderr)
    out_f, rej_f = Appender(out), Appender(rejects_path)
    t0 = time.perf_counter()
    damaged: Optional[list] = [] if s.skip_damaged_files else None
    try:
        for window in windows(iter_entries(sources, s.limit, damaged, s.max_turns), s.sort_window):
            if all(where in done for where, _ in window):  # finished: no need to tokenise it to sort it
                for where, _ in window:
                    count_earlier(where, done_rejects, summary)
                continue
            items, new_rejects = window_prompts(window, gen, max_prompt, done, summary)
            rej_f.write(new_rejects)
            bar.update(len(new_rejects))
            for rows in token_batches([it[0] for it in items], s.batch_size, s.batch_tokens, s.max_new_tokens):
                batch = items[rows.start: rows.stop]
                todo = sum(1 for it in batch if it[2].id not in done)
                for it in batch:
                    if it[2].id in done:
                        count_earlier(it[2].id, done_rejects, summary)
                if not todo:
                    continue
                convos = [it[2] for it in batch]
                written, rejected = answered_rows(convos, gen.converse(convos, [it[3] for it in batch], max_prompt),
                                                  done, summary)
                out_f.write(written)
                rej_f.write(rejected)
                summary.rows_written += len(written)
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
    summary.damaged_files = [e.record() for e in damaged or ()]
    if summary.rows_written + summary.already_done == 0:
        raise ValueError(f"no usable row in {', '.join(sources)}: " + summary.format())
    return summary.as_dict()
