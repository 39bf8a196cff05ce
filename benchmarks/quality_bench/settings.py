"""The bench's fixed facts: the reference run it compares with, the data stage's defaults, the eval sets."""

from __future__ import annotations

import sys
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent.parent
ENTRY = REPO / "benchmarks" / "quality.py"  # the children run its worker, corpus and replay commands
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))

from dflash_train.data.regen.inputs import ENGINES as REGEN_ENGINES  # noqa: E402 (src is on the path from here)

REFERENCE = {
    "trainer": "a published DFlash trainer (its reported figure)",
    "data": "7,728 ShareGPT first turns answered by SmolLM2-135M-Instruct, greedy, 256 new tokens (7,337 usable)",
    "recipe": "5 layers, block 16, 512 anchors, gamma 7, lr 6e-4, batch 16, 759 steps (1.65 epochs)",
    "tau": 1.37,
    "tau_on": "MT-Bench + held-out ShareGPT (a small sample), greedy, 256 new tokens, block verification",
    "train_wall_s": 180,
}
DEFAULT_CONFIG = REPO / "configs" / "smollm2-reference.yaml"
# The data stage: the target answers the first REGEN_LIMIT conversations of the built-in ShareGPT training split
# (10,577 usable; 7,728 = the reference's data size), greedy, at most REGEN_MAX_NEW_TOKENS a turn.
REGEN_SOURCE = "sharegpt"
REGEN_LIMIT = 7728
REGEN_MAX_NEW_TOKENS = 256
REGEN_MAX_TURNS = 1  # first turns, as the reference's data: every turn (0) of 7,728 conversations takes hours
# Wider batches go faster (a decode step at 512 rows: ~0.1 s on an H100, mostly the GPU's GQA and KV-cache copies);
# 256 conversations of the longest prompts took ~77 GB of an H200 at 256 new tokens a turn.
REGEN_BATCH_SIZE = 1024
REGEN_BATCH_TOKENS = 400_000  # padded tokens a generate call: ~60 GB for SmolLM2-135M on the H200
REGEN_FILE = Path("data") / "regen.jsonl"  # under --out
DEFAULT_EVAL = ("mt-bench", "humaneval", "sharegpt")
POOLED = ("mt-bench", "sharegpt")  # the reference's tau was measured on these two
EXIT_UNFINISHED = 3
