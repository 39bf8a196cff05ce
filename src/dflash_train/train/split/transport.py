"""Split placement: target ranks stream hidden states to drafter ranks over torch.distributed p2p.

Schedule. Optimizer step s consumes G = D * grad_accum micro-batches, numbered m = s * G + j in
the order of the shared data plan. Target rank t (of T) produces every m with m % T == t; drafter
rank d (of D) consumes every m with m % D == d. Both sides walk the same deterministic plan, so
there is no coordinator and a resumed run replays exactly.

Flow control. When step s starts, a drafter asks for its micro-batches of step s + 1: a ticket
[m, GO] to each producer, with the receives posted at once. The target computes them while the
drafter trains on step s (double buffering) and its sends complete as soon as they arrive. At
the end each target receives exactly one [m, STOP] ticket in place of the next GO it waits for.

Messages have fixed sizes, so a receive can be posted before the shapes are known: `meta` (int64:
header, input ids, loss mask, lengths, note) and `hidden` (`token_budget * width` elements); the header
gives the real shapes and the micro-batch number, which the receiver checks.

Notes. A target rank has no stop vote of its own: what it must tell the drafter ranks travels in its
messages. Once its compiled code nears the recompile limit, every capture it sends carries a note
(UTF-8, up to `NOTE_BYTES`) saying which function and guard; the drafter rank that receives it brings
the note to its recompile vote, and the drafter ranks stop together at a step boundary with a
checkpoint, sending the usual STOP tickets. The target keeps serving real captures until its STOP
comes: `SplitLayout.captures_until_stop` bounds how many that can be, so it can decide early enough.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from ...data.batch import Batch
from ..loop.step import MicroBatch

GO, STOP = 1, 0
HEADER = 8  # m, B, S, width, dtype code, note bytes, then spare
NOTE_BYTES = 2048  # a note's UTF-8, 8 bytes to an int64 slot at the end of `meta`
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class SplitLayout:
    """Ranks 0..D-1 train the drafter (rank 0 writes status and checkpoints); ranks D..D+T-1 run the target."""

    world: int
    target_ranks: int
    grad_accum: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.target_ranks < self.world:
            raise ValueError(
                f"parallel.target_ranks={self.target_ranks} does not fit {self.world} rank(s): the split placement "
                f"needs at least one target rank and one drafter rank (1 <= target_ranks <= {self.world - 1})"
            )

    @property
    def drafter_ranks(self) -> int:
        return self.world - self.target_ranks

    @property
    def per_step(self) -> int:
        return self.drafter_ranks * self.grad_accum

    def is_target(self, rank: int) -> bool:
        return rank >= self.drafter_ranks

    def producer(self, m: int) -> int:
        return self.drafter_ranks + m % self.target_ranks

    def consumer(self, m: int) -> int:
        return m % self.drafter_ranks

    def consumed(self, rank: int, step: int) -> list[int]:
        """The micro-batches drafter `rank` trains on in `step`, in order."""
        first = step * self.per_step
        return [m for m in range(first, first + self.per_step) if self.consumer(m) == rank]

    def stop_tickets(self, rank: int, first_unasked_step: int) -> list[int]:
        """The micro-batches for which drafter `rank` sends STOP: for every target, the first one it
        would wait for after the last step asked for, when this rank is its consumer."""
        first = first_unasked_step * self.per_step
        nexts = [first + (t - first) % self.target_ranks for t in range(self.target_ranks)]
        return [m for m in nexts if self.consumer(m) == rank]

    def captures_until_stop(self) -> int:
        """At most how many micro-batches a target rank computes from the first one whose message carries a
        note to its STOP ticket. The note's step k reaches its drafter rank when that rank takes step k; the
        loop stops at the boundary after it with one drafter rank, one step later with several (their vote
        agrees a step late); and the step after the last trained one was asked for ahead. So steps k, k + 1
        and, with several drafter ranks, k + 2, of which a target rank computes ceil(per_step / T) each."""
        return -(-self.per_step // self.target_ranks) * (3 if self.drafter_ranks > 1 else 2)

    def produced(self, rank: int, groups: Iterator[list], start_step: int) -> Iterator[tuple[int, list]]:
        """`(m, rows)` of every micro-batch target `rank` computes, from the step-ordered groups of rows."""
        t = rank - self.drafter_ranks
        for step, group in enumerate(groups, start=start_step):
            for j, rows in enumerate(group):
                m = step * self.per_step + j
                if m % self.target_ranks == t:
                    yield m, rows


_NOTE_SLOTS = NOTE_BYTES // 8


def _meta_len(capacity: int, max_batch: int) -> int:
    return HEADER + 2 * capacity + max_batch + _NOTE_SLOTS


def _note_offset(capacity: int, max_batch: int) -> int:
    return HEADER + 2 * capacity + max_batch


def encode_note(note: str) -> tuple[torch.Tensor, int]:
    """`note` as int64 slots (its UTF-8 cut to `NOTE_BYTES` at a character boundary) and its byte length."""
    raw = note.encode()[:NOTE_BYTES].decode(errors="ignore").encode()
    padded = raw + bytes(-len(raw) % 8)
    return torch.from_numpy(np.frombuffer(padded, dtype="<i8").copy()), len(raw)


def decode_note(slots: torch.Tensor, length: int) -> str:
    return slots.cpu().numpy().astype("<i8").tobytes()[:length].decode(errors="replace")


class TargetOutbox:
    """A target rank's side: wait for a ticket, then send the capture; at most `depth` sends in flight."""

    def __init__(self, layout: SplitLayout, capacity: int, max_batch: int, device: torch.device, depth: int = 2):
        self.layout, self.capacity, self.max_batch, self.device, self.depth = layout, capacity, max_batch, device, depth
        self.in_flight: deque = deque()
        self.wait_s = 0.0  # time spent waiting for tickets (the drafters are behind) or for sends to land
        self.sent = 0

    def next_ticket(self, m: int) -> bool:
        """Block until the consumer of `m` asks for it (True) or tells this rank to stop (False)."""
        t0 = time.perf_counter()
        ticket = torch.empty(2, dtype=torch.long, device=self.device)
        dist.recv(ticket, self.layout.consumer(m))
        got, op = ticket.tolist()
        self.wait_s += time.perf_counter() - t0
        if op == STOP:
            return False
        if got != m:
            raise RuntimeError(f"split transport out of step: target rank waited for a ticket for micro-batch {m}, "
                               f"drafter rank {self.layout.consumer(m)} asked for {got}")
        return True

    def send(self, m: int, batch: Batch, hidden: torch.Tensor, note: Optional[str] = None) -> None:
        """Send micro-batch `m`'s capture to its drafter rank, with `note` for it (see the module's Notes)."""
        b, s = batch.input_ids.shape
        width = hidden.shape[-1]
        if b * s > self.capacity or b > self.max_batch:
            raise ValueError(f"micro-batch {m} has {b}x{s} tokens, over the transport capacity "
                             f"{self.max_batch} rows / {self.capacity} tokens (data.max_batch_size / data.token_budget)")
        meta = torch.zeros(_meta_len(self.capacity, self.max_batch), dtype=torch.long, device=self.device)
        meta[:5] = torch.tensor([m, b, s, width, _DTYPE_CODES[hidden.dtype]])
        n = b * s
        meta[HEADER:HEADER + n] = batch.input_ids.reshape(-1)
        meta[HEADER + self.capacity:HEADER + self.capacity + n] = batch.loss_mask.reshape(-1)
        meta[HEADER + 2 * self.capacity:HEADER + 2 * self.capacity + b] = batch.lengths
        if note:
            slots, length = encode_note(note)
            meta[5] = length
            start = _note_offset(self.capacity, self.max_batch)
            meta[start:start + len(slots)] = slots.to(self.device)
        flat = torch.empty(self.capacity * width, dtype=hidden.dtype, device=self.device)
        flat[: n * width] = hidden.reshape(-1)
        dst = self.layout.consumer(m)
        self.in_flight.append(([dist.isend(meta, dst), dist.isend(flat, dst)], meta, flat))
        self.sent += 1
        while len(self.in_flight) > self.depth:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        t0 = time.perf_counter()
        works, _, _ = self.in_flight.popleft()
        for w in works:
            w.wait()
        self.wait_s += time.perf_counter() - t0

    def close(self) -> None:
        while self.in_flight:
            self._wait_oldest()


class DrafterInbox:
    """A drafter rank's side: ask for a step's micro-batches ahead of time, take them when training."""

    def __init__(self, layout: SplitLayout, rank: int, capacity: int, max_batch: int, width: int,
                 hidden_dtype: torch.dtype, device: torch.device, start_step: int = 0):
        self.layout, self.rank, self.capacity, self.max_batch = layout, rank, capacity, max_batch
        self.width, self.hidden_dtype, self.device = width, hidden_dtype, device
        self.pending: dict[int, tuple] = {}
        self.tickets: list = []
        self.asked_until = start_step  # steps below this have been asked for (or were done before a resume)
        self.wait_s = 0.0
        self.target_note: Optional[str] = None  # the first note a target rank sent (see the module's Notes)

    def ask(self, step: int) -> None:
        """Request this rank's micro-batches of `step` and post their receives (no waiting)."""
        self.tickets = [(w, t) for w, t in self.tickets if not w.is_completed()]
        for m in self.layout.consumed(self.rank, step):
            src = self.layout.producer(m)
            ticket = torch.tensor([m, GO], dtype=torch.long, device=self.device)
            self.tickets.append((dist.isend(ticket, src), ticket))
            meta = torch.empty(_meta_len(self.capacity, self.max_batch), dtype=torch.long, device=self.device)
            hidden = torch.empty(self.capacity * self.width, dtype=self.hidden_dtype, device=self.device)
            self.pending[m] = ([dist.irecv(meta, src), dist.irecv(hidden, src)], meta, hidden)
        self.asked_until = max(self.asked_until, step + 1)

    def take(self, step: int) -> list[MicroBatch]:
        """This rank's micro-batches of `step` (asked for earlier), waiting for any still in transit."""
        if self.device.type == "cuda":
            # Measure the transport alone, not the compute queued before. The compute stream only: a
            # device-wide sync would also wait for the receives of the step asked ahead, serialising
            # the target's work with the drafter's.
            torch.cuda.current_stream(self.device).synchronize()
        t0 = time.perf_counter()
        out = [self._unpack(m, *self.pending.pop(m)) for m in self.layout.consumed(self.rank, step)]
        self.wait_s += time.perf_counter() - t0
        return out

    def _unpack(self, m: int, works: list, meta: torch.Tensor, hidden: torch.Tensor) -> MicroBatch:
        for w in works:
            w.wait()
        got, b, s, width, code, note_bytes = meta[:6].tolist()
        if got != m:
            raise RuntimeError(f"split transport out of step: drafter rank {self.rank} expected micro-batch {m} from "
                               f"rank {self.layout.producer(m)}, received {got}")
        if width != self.width or code != _DTYPE_CODES[self.hidden_dtype]:
            raise RuntimeError(f"split transport: micro-batch {m} has hidden width {width} (dtype code {code}), "
                               f"the drafter expects {self.width} ({self.hidden_dtype})")
        if note_bytes and self.target_note is None:
            start = _note_offset(self.capacity, self.max_batch)
            note = decode_note(meta[start:start + -(-note_bytes // 8)], note_bytes)
            self.target_note = f"target rank {self.layout.producer(m)}: {note}"
        n, c = b * s, self.capacity
        batch = Batch(meta[HEADER:HEADER + n].view(b, s), meta[HEADER + c:HEADER + c + n].view(b, s),
                      meta[HEADER + 2 * c:HEADER + 2 * c + b])
        return MicroBatch(batch, hidden[: n * width].view(b, s, width))

    def close(self) -> None:
        """Drain what was asked for but not trained on, then send each target its STOP ticket."""
        for works, _, _ in self.pending.values():
            for w in works:
                w.wait()
        self.pending.clear()
        for m in self.layout.stop_tickets(self.rank, self.asked_until):
            dist.send(torch.tensor([m, STOP], dtype=torch.long, device=self.device), self.layout.producer(m))
        for work, _ in self.tickets:
            work.wait()
        self.tickets.clear()
