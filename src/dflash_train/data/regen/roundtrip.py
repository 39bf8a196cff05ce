"""Regen on a serving cluster: export OpenAI batch requests for vLLM / SGLang, import their responses
(see the package docstring)."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Iterable, Optional, Union

from ...runtime import publish, write_text_atomic
from ..formats import RowError
from . import batch_api
from .inputs import RegenSettings, batch_seed, check_sources, iter_entries
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
        rejects.append(reject_record(where, reason, detail))

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
                reject(where, e.reason, e.detail)
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
                    seed = batch_seed(s.seed, cid) % (1 << 31) if s.temperature > 0 else None
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
