"""The split planner's arithmetic: the pipeline runs at its slower side."""

import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
spec = importlib.util.spec_from_file_location("plan_split", Path(__file__).parents[2] / "benchmarks" / "plan_split.py")
plan = importlib.util.module_from_spec(spec)
sys.modules["plan_split"] = plan  # its dataclasses look their module up
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


def _sharded(**over):
    from throughput import SHAPES

    args = dict(shape=SHAPES["llama3-70b-class"], group=8, last_layer=77, batch=4, seq=4096, mfu=0.68,
                peak_tflops=790.0, busbw_gbs=350.0)
    return plan.ShardedTarget(**{**args, **over})


def test_sharded_capture_overlaps_each_gather_with_the_previous_layer_and_pays_the_first():
    t = _sharded()
    layer_bytes = 2 * (8192 * 128 * (64 * 2 + 8 * 2) + 3 * 8192 * 28672)
    assert t.gather_s() == layer_bytes * 7 / 8 / 350e9
    assert t.compute_s() > t.gather_s()  # 70B layers on 8 GPUs: compute-bound
    assert t.capture_s() == 78 * t.compute_s() + t.gather_s()
    slow = _sharded(busbw_gbs=5.0)  # a slow link: the gathers set the pace
    assert slow.capture_s() == 78 * slow.gather_s() + slow.gather_s()
    assert _sharded(group=1).gather_s() == 0  # one rank gathers nothing


def test_sharded_memory_is_the_preflight_count_of_the_readme_table():
    assert abs(_sharded().target_gib() - 24.6) < 0.1  # README: Llama-3.1-70B over 8 (norms aside)
    assert abs(_sharded(group=4).target_gib() - 40.6) < 0.1


def test_sharded_plans_name_what_fits_and_what_the_trainer_allows():
    rows = plan.sharded_plans(_sharded(), 3000.0, 8, drafter_gib=69.0, head_gib=2.0)
    by_plan = {r["plan"]: r for r in rows}
    colocated = by_plan["colocated, fsdp over 8"]
    t = _sharded()
    assert colocated["tokens_per_s"] == 8 * t.tokens / (t.capture_s() + t.tokens / 3000.0)
    assert all(r["fits"] == (r["gib_per_gpu"] <= plan.GPU_GIB) for r in rows)
    assert by_plan["split 1 + 7, fsdp over 1"]["gib_per_gpu"] > 131  # the whole 70B target on one GPU
    assert colocated["gib_per_gpu"] == t.target_gib() + 69.0 + 2.0
    assert by_plan["split 4 + 4, fsdp over 4"]["allowed"] and not by_plan["split 3 + 5, fsdp over 3"]["allowed"]
    assert by_plan["split 4 + 4, fsdp over 4"]["tokens_per_s"] == min(4 * t.tokens / _sharded(group=4).capture_s(),
                                                                        4 * 3000.0)
