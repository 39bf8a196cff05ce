"""The OpenAI batch JSONL format, as `vllm run-batch` and SGLang read and write it.

Request line (one per conversation and round):
    {"custom_id": "<row id>#turn<k>", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": ..., "messages": [...], "max_tokens": N, "temperature": T, "top_p": P, ...}}
Response line:
    {"id": ..., "custom_id": ..., "response": {"status_code": 200, "body": {"choices": [{"message":
     {"content": ...}}]}}, "error": null}

A request asks for assistant turn k of a row: its messages are the row's system turn (if any), its
user turns 0..k and the target's own answers to turns 0..k-1 (imported from earlier rounds).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

TURN_SEP = "#turn"
CHAT_URL = "/v1/chat/completions"


def custom_id(row_id: str, turn: int) -> str:
    return f"{row_id}{TURN_SEP}{turn}"


def split_custom_id(cid: str) -> Optional[tuple[str, int]]:
    """(row id, turn) of a custom_id written by `custom_id`, else None."""
    row_id, sep, turn = cid.rpartition(TURN_SEP)
    if not sep or not turn.isdigit():
        return None
    return row_id, int(turn)


def make_request(cid: str, messages: list[dict[str, str]], *, model: str, max_tokens: int, temperature: float,
                 top_p: float, seed: Optional[int] = None, thinking: Optional[bool] = None,
                 stop_token_ids: Optional[list[int]] = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens,
                            "temperature": temperature, "top_p": top_p}
    if seed is not None:
        body["seed"] = seed
    if thinking is not None:  # vLLM and SGLang pass these to the chat template
        body["chat_template_kwargs"] = {"enable_thinking": thinking}
    if stop_token_ids:  # a vLLM / SGLang extension of the OpenAI API
        body["stop_token_ids"] = list(stop_token_ids)
    return {"custom_id": cid, "method": "POST", "url": CHAT_URL, "body": body}


@dataclass
class Response:
    custom_id: str
    content: Optional[str]  # None when the request failed
    error: Optional[str] = None
    finish_reason: Optional[str] = None
    where: str = ""  # file:line of the response


def parse_response(record: Any) -> Response:
    """One response line. Raises ValueError when it has no usable custom_id."""
    if not isinstance(record, dict) or not isinstance(record.get("custom_id"), str):
        raise ValueError("no custom_id")
    cid = record["custom_id"]
    err = record.get("error")
    if err:
        msg = err.get("message") if isinstance(err, dict) else None
        return Response(cid, None, f"error: {msg or json.dumps(err)[:200]}")
    resp = record.get("response")
    if not isinstance(resp, dict):
        return Response(cid, None, "no response")
    status = resp.get("status_code", 200)
    body = resp.get("body")
    if body is None and "choices" in resp:  # some writers put the completion itself under "response"
        body = resp
    if status != 200:
        detail = ""
        if isinstance(body, dict):
            e = body.get("error")
            detail = (e.get("message") if isinstance(e, dict) else None) or body.get("message") or ""
        return Response(cid, None, f"status {status}" + (f": {str(detail)[:200]}" if detail else ""))
    try:
        choice = body["choices"][0]
        content = choice["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return Response(cid, None, "no choices[0].message.content in the response body")
    if not isinstance(content, str):
        return Response(cid, None, f"content is {type(content).__name__}, not a string")
    return Response(cid, content, None, choice.get("finish_reason"))


def read_responses(paths: list[Path]) -> tuple[dict[str, Response], list[tuple[str, str]]]:
    """custom_id -> response over all files (a successful response wins over a failed one; among
    successes, the first one read wins), and the unreadable lines as (file:line, reason)."""
    responses: dict[str, Response] = {}
    unreadable: list[tuple[str, str]] = []
    for path in paths:
        for where, record in _iter_jsonl(path):
            if isinstance(record, Exception):
                unreadable.append((where, str(record)))
                continue
            try:
                r = parse_response(record)
            except ValueError as e:
                unreadable.append((where, str(e)))
                continue
            r.where = where
            old = responses.get(r.custom_id)
            if old is None or (old.content is None and r.content is not None):
                responses[r.custom_id] = r
    return responses, unreadable


def _iter_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                yield where, json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                yield where, ValueError(f"unreadable line ({type(e).__name__})")
