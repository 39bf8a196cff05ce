"""eval's decoding options against each other and against an exported drafter's config.json (`infer.eval_options`):
what the config.json declares (`registry.Options.confidence_head`, `tree_refusal`) must be what the loaded
drafter does, for every built-in architecture."""

from __future__ import annotations

import json

import pytest

from _drafter_exports import EXPORTS, export_drafter
from dflash_train.architectures import registry
from dflash_train.infer.eval_options import DecodingOptions, check_against_drafter, check_flags, read_export_config


@pytest.fixture(scope="module")
def exports(tmp_path_factory, tiny_target_dir):
    root = tmp_path_factory.mktemp("exports")
    return {case: export_drafter(root, tiny_target_dir, case) for case in EXPORTS}


def test_every_architecture_is_covered():
    assert {arch for arch, _ in EXPORTS.values()} == set(registry.names())


@pytest.mark.parametrize("case", list(EXPORTS))
def test_the_declared_capabilities_are_what_the_drafter_does(exports, case):
    """What eval reads from config.json before loading equals what decoding finds after: the confidence head, and
    DDTree's refusal word for word."""
    folder, drafter = exports[case]
    entry, config = read_export_config(folder)
    declared = registry.options(entry.name)
    assert entry.name == drafter.architecture
    assert bool(declared.confidence_head and declared.confidence_head(config)) == drafter.has_confidence
    try:
        drafter.check_tree_decoding()
        refused = None
    except ValueError as e:
        refused = str(e)
    assert (declared.tree_refusal(config) if declared.tree_refusal else None) == refused
    assert (refused is not None) == (case in ("domino", "dspark-rnn", "lilicorr"))
    assert drafter.has_confidence == (case in ("dspark", "dspark-rnn"))


@pytest.mark.parametrize("case,options,said", [
    ("domino", DecodingOptions(tree_budgets=(4,)), "domino drafts a chain"),
    ("dspark-rnn", DecodingOptions(tree_budgets=(4,)), "markov_head_type is rnn"),
    ("lilicorr", DecodingOptions(tree_budgets=(4,)), "walking that lattice"),
    ("dflash", DecodingOptions(confidence_threshold=0.5),
     "--confidence-threshold 0.5: the dflash drafter in {folder} has no confidence head"),
    ("dspark-no-confidence", DecodingOptions(confidence_threshold=0.5), "dspark drafter in {folder} has no confidence"),
    ("dflash", DecodingOptions(block_size=5), "--block-size 5: larger than the drafter's trained block size 4 "
                                              "({folder}/config.json); give at most 4"),
    ("dflash", DecodingOptions(block_size=3, replay=True), "--replay verifies the drafter's trained block (4, "
                                                           "{folder}/config.json); drop --block-size 3"),
])
def test_what_the_drafter_cannot_do_is_refused_from_its_config(exports, case, options, said):
    folder, _ = exports[case]
    with pytest.raises(ValueError) as e:
        check_against_drafter(options, folder)
    assert said.format(folder=folder) in str(e.value)


@pytest.mark.parametrize("case,options", [
    ("dspark", DecodingOptions(tree_budgets=(4, 16), confidence_threshold=0.0)),
    ("dspark", DecodingOptions(confidence_threshold=0.5, block_size=3)),
    ("dflash2", DecodingOptions(tree_budgets=(1024,))),
    ("domino", DecodingOptions(block_size=4, replay=True)),
])
def test_what_the_drafter_can_do_passes(exports, case, options):
    check_against_drafter(options, exports[case][0])


@pytest.mark.parametrize("options,said", [
    (DecodingOptions(tree_budgets=(16, 4, 16)), "--tree-budget lists 16 twice"),
    (DecodingOptions(tree_budgets=(4,), temperature=0.7), "--tree-budget: DDTree verification is greedy"),
    (DecodingOptions(tree_budgets=(4,), confidence_threshold=0.3), "drop --tree-budget or --confidence-threshold"),
    (DecodingOptions(replay=True, temperature=0.7), "--replay measures greedy decoding"),
    (DecodingOptions(replay=True, confidence_threshold=0.3), "--replay verifies every draft"),
])
def test_flags_that_exclude_each_other(options, said):
    with pytest.raises(ValueError, match=said):
        check_flags(options)


def test_a_config_json_no_architecture_exports_is_named(tmp_path):
    from dflash_train.errors import DamagedFileError, ModelError

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelError, match=rf"^{tmp_path / 'config.json'}: not a DFlash drafter config"):
        read_export_config(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": [')
    with pytest.raises(DamagedFileError, match="config.json is damaged"):
        read_export_config(tmp_path)
