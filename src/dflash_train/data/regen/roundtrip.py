"""Regen on a serving cluster: export OpenAI batch requests for vLLM / SGLang, import their responses
(see the package docstring)."""

from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Union

from ...files.io import replace_file, write_text_atomic
from ..formats import RowError, check_readable
from . import batch_api
from .inputs import Convo, RegenSettings, batch_seed, check_sources, iter_entries
from .journal import Appender, Summary, check_settings, read_done_ids, reject_record, side_paths


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
    sources = check_sources(sources)
    imports, export_path, out = _check_paths(imports, export_path, out, model_name)
    settings = settings or RegenSettings()
    if not settings.skip_damaged_files:
        check_readable(sources, settings.limit)  # a damaged file: said before anything is written
    responses, unreadable = batch_api.read_responses(imports)
    rt = _Round(settings, responses, model_name)
    done: set[str] = set()
    if out is not None:
        check_settings(out, "batch", {"data": sources})
        done = set(read_done_ids(out))
        rt.summary.out = str(out)
    rejects_path = side_paths(out)[1] if out is not None else export_path.with_name(export_path.name + ".rejects.jsonl")
    rt.summary.rejects_file = str(rejects_path)
    for where, detail in unreadable:
        rt.reject(where, "unreadable response line", detail)
    requests = _RequestFile(export_path) if export_path is not None else None
    try:
        rt.walk(sources, done, Appender(out) if out is not None else None, requests)
        if out is not None or rt.rejects:
            write_text_atomic(rejects_path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rt.rejects))
    except BaseException:
        if requests is not None:
            requests.discard()
        raise
    if requests is not None:
        requests.publish()
    rt.add_notes(imports, export_path)
    return rt.summary.as_dict() | {"requests": rt.n_requests, "waiting": rt.waiting}


def _check_paths(imports: Iterable[Union[str, Path]], export_path: Optional[Union[str, Path]],
                 out: Optional[Union[str, Path]], model_name: Optional[str]) -> tuple[list[Path], Optional[Path],
                                                                                     Optional[Path]]:
    """(imports, export_path, out) as paths, after refusing a call that cannot do anything sensible."""
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
    return imports, Path(export_path) if export_path is not None else None, Path(out) if out is not None else None


class _RequestFile:
    """The exported requests, streamed into a temporary file beside `path` and renamed into place by
    `publish` (a failed run leaves no half-written file)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        self.f = open(self.tmp, "w", encoding="utf-8")

    def write(self, request: dict) -> None:
        self.f.write(json.dumps(request, ensure_ascii=False) + "\n")

    def discard(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)

    def publish(self) -> None:
        self.f.close()
        replace_file(self.tmp, self.path)


@dataclass
class _Pending:
    """The first unanswered turn of a row: its index, the history up to it and the failed response, if any."""

    turn: int
    history: list[dict]
    failed: Optional[batch_api.Response]


@dataclass
class _Round:
    """One import/export round: what happened to each row, counted into the summary."""

    settings: RegenSettings
    responses: dict[str, batch_api.Response]
    model_name: Optional[str]
    summary: Summary = field(default_factory=Summary)
    rejects: list[dict] = field(default_factory=list)
    used: set[str] = field(default_factory=set)  # custom_ids of responses that matched a row
    n_requests: int = 0
    turns_exported: Counter = field(default_factory=Counter)
    retried: int = 0
    waiting: int = 0

    def reject(self, where: str, reason: str, detail: str) -> None:
        self.summary.reject(where, reason, detail)
        self.rejects.append(reject_record(where, reason, detail))

    def walk(self, sources: list[str], done: set[str], out_f: Optional[Appender],
             requests: Optional[_RequestFile]) -> None:
        """Every row of `sources`: complete conversations appended to `out_f` in chunks, the next turn of
        the others exported to `requests` (or reported); closes `out_f`."""
        rows: list[dict] = []

        def flush_rows() -> None:
            if out_f is not None:
                out_f.write(rows)
                self.summary.rows_written += len(rows)
            rows.clear()

        try:
            damaged: Optional[list] = [] if self.settings.skip_damaged_files else None
            for where, e in iter_entries(sources, self.settings.limit, damaged, self.settings.max_turns):
                if isinstance(e, RowError):
                    self.reject(where, e.reason, e.detail)
                elif where in done:
                    self.summary.already_done += 1
                    self.used.update(batch_api.custom_id(where, k) for k in range(len(e.users)))
                else:
                    row = self.conversation(where, e, requests)
                    if row is not None:
                        rows.append(row)
                        if len(rows) >= 1024:
                            flush_rows()
            flush_rows()
            self.summary.damaged_files = [e.record() for e in damaged or ()]
        finally:
            if out_f is not None:
                out_f.close()

    def conversation(self, where: str, e: Convo, requests: Optional[_RequestFile]) -> Optional[dict]:
        """The row as a complete conversation, or None when a turn is still unanswered or it is rejected."""
        msgs, pending, ended = self.answered_turns(where, e)
        if pending is not None:
            self.unanswered(where, pending, requests)
            return None
        answered = sum(1 for m in msgs if m["role"] == "assistant")
        if answered == 0:
            self.reject(where, "empty response", "the first answer is empty")
            return None
        if answered < len(e.users):
            self.summary.truncated[ended] += 1
        return {"id": where, "messages": msgs}

    def answered_turns(self, where: str, e: Convo) -> tuple[list[dict], Optional[_Pending], Optional[str]]:
        """(history with every answer found, the first unanswered turn or None, why it ended early or None)."""
        msgs = list(e.system)
        for k, user in enumerate(e.users):
            hist = msgs + [{"role": "user", "content": user}]
            cid = batch_api.custom_id(where, k)
            r = self.responses.get(cid)
            if r is not None:
                self.used.add(cid)
            if r is None or r.content is None:
                return msgs, _Pending(k, hist, r), None
            if not r.content.strip():
                return msgs, None, "empty response"
            msgs = hist + [{"role": "assistant", "content": r.content}]
        return msgs, None, None

    def unanswered(self, where: str, pending: _Pending, requests: Optional[_RequestFile]) -> None:
        """Export the request for the pending turn, or report it: rejected, missing, or waiting for a round."""
        k, failed = pending.turn, pending.failed
        cid = batch_api.custom_id(where, k)
        if requests is not None:
            s = self.settings
            seed = batch_seed(s.seed, cid) % (1 << 31) if s.temperature > 0 else None
            requests.write(batch_api.make_request(
                cid, pending.history, model=self.model_name, max_tokens=s.max_new_tokens, temperature=s.temperature,
                top_p=s.top_p, seed=seed, thinking=s.thinking, stop_token_ids=s.stop_token_ids))
            self.n_requests += 1
            self.turns_exported[k] += 1
            self.retried += failed is not None
        elif failed is not None:
            self.reject(where, "batch error", f"turn {k}: {failed.error} ({failed.where})")
        elif k == 0:
            self.reject(where, "missing response", f"no response with custom_id {cid}")
        else:
            self.waiting += 1

    def add_notes(self, imports: list[Path], export_path: Optional[Path]) -> None:
        """What the summary says beyond the counts: responses read and unmatched, requests exported, the next step."""
        extra = self.summary.extra
        unmatched = len(set(self.responses) - self.used)
        if imports:
            extra["responses read"] = len(self.responses)
            if unmatched:
                extra["responses matching no row"] = unmatched
            if self.responses and unmatched == len(self.responses):
                extra["hint"] = ("warning: no response matches a row: pass the same --data, spelled the same way "
                                 "(row ids are `file:line`), as for --export-batch")
        if export_path is not None:
            per_turn = f" (per turn: {dict(sorted(self.turns_exported.items()))})" if self.n_requests else ""
            retries = f", {self.retried} of them retry a failed response" if self.retried else ""
            extra["requests exported"] = f"{self.n_requests} to {export_path}{per_turn}{retries}"
            if self.n_requests:
                extra["hint"] = (f"next: vllm run-batch -i {export_path} -o RESULTS.jsonl --model {self.model_name}, "
                                 "then run regen with --import-batch listing every results file so far (and "
                                 "--export-batch for the next round, until nothing is exported)")
        elif self.waiting:
            extra["conversations waiting for another round"] = self.waiting
            extra["hint"] = ("multi-turn rows need one round per turn: add --export-batch NEXT.jsonl to export "
                             "their next turn")
