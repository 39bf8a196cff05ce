"""The split planner's arithmetic: the pipeline runs at its slower side."""

import importlib.util
import json
from pathlib import Path

spec = importlib.util.spec_from_file_location("plan_split", Path(__file__).parent.parent / "benchmarks" / "plan_split.py")
plan = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plan)


def test_prediction_is_bound_by_the_slower_side():
    assert plan.predict(10_000, 2_000, 2, 6) == 12_000
    assert plan.predict(10_000, 2_000, 1, 7) == 10_000


def test_best_split_is_the_argmax_over_all_splits():
    t, d, p = plan.best_split(8_000, 2_000, 8)
    assert (t, d) == (2, 6) and p == 12_000
    brute = max(min(t * 8_000, (8 - t) * 2_000) for t in range(1, 8))
    assert p == brute


def test_rates_read_from_benchmark_json(tmp_path):
    f = tmp_path / "b.jsonl"
    f.write_text(json.dumps({"shape": "s", "part": "target", "tokens_per_s": 5}) + "\n"
                 + json.dumps({"shape": "s", "part": "drafter", "tokens_per_s": 3}) + "\n")
    assert plan.rates_from_json(str(f), "s") == (5, 3)
