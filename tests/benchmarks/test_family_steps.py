"""benchmarks/family_steps.py: a variant names an architecture and run-config overrides, which reach the benchmark's
config (a bad override is refused there, before any GPU work)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
import family_steps  # noqa: E402


def test_a_variant_names_its_architecture_and_overrides():
    assert family_steps.parse_variant("dspark-dpard=dspark,dspark.loss=dpard,dspark.ce_weight=0") == (
        "dspark-dpard", "dspark", ["dspark.loss=dpard", "dspark.ce_weight=0"])
    assert family_steps.parse_variant("plain=domino") == ("plain", "domino", [])
    for bad in ("dspark", "=dspark", "x=", "x=dspark,loss"):
        with pytest.raises(SystemExit, match="expected NAME=ARCHITECTURE"):
            family_steps.parse_variant(bad)


def test_the_overrides_reach_the_run_config_the_benchmark_builds():
    from dflash_train.config.load import config_from_dict
    from dflash_train.errors import ConfigError

    _, architecture, overrides = family_steps.parse_variant("d=dspark,dspark.loss=dpard,dspark.dpard_alpha=0.3")
    cfg = config_from_dict({"drafter": {"architecture": architecture}}, overrides=overrides)
    assert cfg.options.loss == "dpard" and cfg.options.dpard_alpha == 0.3
    with pytest.raises(ConfigError, match="dspark.loss"):
        config_from_dict({"drafter": {"architecture": "dspark"}}, overrides=["dspark.loss=dpard", "dspark.ce_weight=1"])
