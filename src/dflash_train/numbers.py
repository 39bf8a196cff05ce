"""The valid range of every number a user gives, one `Rule` per meaning.

A CLI flag takes its rule as its argparse `type=` (`Rule.flag`) and a config key through
`config.NUMBER_RULES`; a flag and a key that mean the same number share one rule object, so both
refuse the same values in the same words ("must be a positive integer, got -5").
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

Number = Union[int, float]
_INT64 = 2**63  # counts, ids and seeds: beyond int64 nothing downstream can hold them


def _plain(bound: float) -> str:
    return str(int(bound)) if float(bound).is_integer() else str(bound)


def _cut(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else f"{text[:limit - 20]}...{text[-10:]} ({len(text)} characters)"


def shown(value: Any) -> str:
    """A value as a message shows it: numbers as they are, anything else quoted; cut short."""
    try:
        return _cut(str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value))
    except ValueError:  # an int beyond Python's 4300-digit str limit
        return "an integer of more than 4300 digits"


@dataclass(frozen=True)
class Rule:
    """The numbers of one meaning: `int` or `float`, between `low` and `high` (each included unless it is
    `*_open`; None: unbounded). `zero` says what 0 means where 0 is allowed and special."""

    kind: type
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    zero: str = ""

    def describe(self) -> str:
        noun = "an integer" if self.kind is int else "a number"
        if self.kind is int and self.low == 1 and self.high is None:
            text = "a positive integer"
        elif self.low is not None and self.high is not None:
            text = (f"{noun} in {'(' if self.low_open else '['}{_plain(self.low)}, "
                    f"{_plain(self.high)}{')' if self.high_open else ']'}")
        elif self.low is not None:
            text = f"{noun} {'>' if self.low_open else '>='} {_plain(self.low)}"
        elif self.high is not None:
            text = f"{noun} {'<' if self.high_open else '<='} {_plain(self.high)}"
        else:
            text = noun
        return f"{text} ({self.zero})" if self.zero else text

    def problem(self, value: Any, or_null: bool = False, typed: Optional[str] = None) -> Optional[str]:
        """None when `value` is inside the rule, else "must be <rule>[ or null], got <value>" (`typed`: the value
        as the user wrote it, shown instead)."""
        got = shown(value) if typed is None else typed
        refusal = f"must be {self.describe()}{' or null' * or_null}, got {got}"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return refusal
        if self.kind is int and not isinstance(value, int):
            return refusal
        if self.kind is int and not -_INT64 <= value < _INT64:
            return f"must be {self.describe()}{' or null' * or_null} below 2**63, got {got}"
        if self.kind is float and not math.isfinite(value):
            return refusal
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return refusal
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return refusal
        return None

    def parse(self, text: str) -> Number:
        """`text` as this rule's number; ValueError("must be ..., got ...") when it is not one."""
        try:
            value: Any = self.kind(text.strip())
        except (ValueError, OverflowError):
            value = text
        problem = self.problem(value, typed=_cut(text.strip()) if value is not text else None)
        if problem:
            raise ValueError(problem)
        return value

    @property
    def flag(self) -> Callable[[str], Number]:
        """The argparse `type=` of a flag of this rule: its errors read "argument --flag: must be ..., got ..."."""

        def parse_flag(text: str) -> Number:
            try:
                return self.parse(text)
            except ValueError as e:
                raise argparse.ArgumentTypeError(str(e)) from None

        parse_flag.rule = self  # type: ignore[attr-defined]  # the domain, for the checks that sweep the parser
        return parse_flag


def rule_of(action: argparse.Action) -> Optional[Rule]:
    """The rule an argparse action parses its values with (None: not a number flag, or one without a rule)."""
    return getattr(action.type, "rule", None)


POSITIVE_INT = Rule(int, low=1)
POSITIVE_NUMBER = Rule(float, low=0, low_open=True)
NON_NEGATIVE_NUMBER = Rule(float, low=0)
FRACTION = Rule(float, low=0, high=1)  # a share or a weight, both ends allowed
ALL_IF_ZERO = Rule(int, low=0, zero="0 = all")
NO_BOUND_IF_ZERO = Rule(int, low=0, zero="0 = no bound")
INDEX = Rule(int, low=0)  # a token id or a layer index
TEMPERATURE = Rule(float, low=0, zero="0 = greedy")
TOP_P = Rule(float, low=0, high=1, low_open=True)
# drafter.block_size, prepare --block-size, eval --block-size: the anchor plus at least one drafted token.
BLOCK_SIZE = Rule(int, low=2)
VAL_FRACTION = Rule(float, low=0, high=1, high_open=True)
# eval --tree-budget: DDTree's node budgets run 16..1024 (published budgets mostly 16-128). A step verifies budget + 1
# tokens under a mask of (budget + 1) x (context + budget + 1) entries: at 1024, 38 MB in float32 at 8k context; at
# 100,000 nodes, 40 GB before the context.
TREE_BUDGET = Rule(int, low=1, high=1024)
# run.seed: the training generators are seeded with ((seed * 1000003 + step) * 1024 + rank) * 64 + k, which
# torch holds in 64 bits, and numpy's batch order refuses negatives.
TRAINING_SEED = Rule(int, low=0, high=2**28 - 1)
SEED = Rule(int, low=0)
