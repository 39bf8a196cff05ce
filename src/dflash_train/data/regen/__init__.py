"""`dflash-train regen`: the target writes the assistant turns of a prompts / conversations file.

Input: any row shape `data/formats.py` reads (ShareGPT, OpenAI messages, `{prompt, response}`,
`{prompt}`, `{turns}`) in JSONL / JSON / Parquet, or a built-in prompt set (`sharegpt` (training split),
`mt-bench`, `humaneval`). Only the system turn and the user turns of a row are kept: the target
answers user turn 0, then user turn 1 with its own first answer in the history, and so on.

Output: JSONL, one `{"id": <file:line of the input row>, "messages": [...]}` per conversation
(OpenAI messages), which `prepare` and `train` read. Beside it:
- `OUT.regen.json`: the settings the file is produced with (a resume with other settings is refused);
- `OUT.rejects.jsonl`: `{"id", "reason", "detail"}` per row that was skipped.

Local generation (`regenerate`), resumable after a kill at any moment:
- order: the input is cut into windows of `sort_window` consecutive rows; within a window the rows
  are sorted by prompt length (longest first, ties by input position) and cut into batches of at most
  `batch_size` rows and, when `batch_tokens` is set, at most that many padded tokens (rows x (longest prompt
  + max_new_tokens)). The batches depend only on the input and these numbers, never on what is done.
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

Modules: `inputs` (settings, the rows to answer), `journal` (the files beside the output: resume, the
settings sidecar, rejects, the summary), `local` (generation with the target, imports torch),
`roundtrip` (the serving-engine round trip, no torch) and `batch_api` (the OpenAI batch file format).
"""
