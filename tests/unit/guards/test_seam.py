"""The seam between the generic stack and the drafter architectures: an architecture lives wholly in its package.

- the generic code names no architecture and reads none of an architecture's own keys (a scan);
- an architecture's own config keys are a section named after it, accepted only under its drafter.architecture;
  the old flat keys still load (one warning), and a run whose config.yaml has them resumes with no change;
- an architecture defined in a test file alone, registered at run time, trains, decodes, exports and reloads.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import logging
import re
import tokenize
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from dflash_train.architectures import registry
from dflash_train.config.load import config_from_dict, config_to_dict, dump_config, load_config
from dflash_train.config.schema import config_sections
from dflash_train.errors import ConfigError

SRC = Path(__file__).resolve().parents[3] / "src" / "dflash_train"

# ------------------------------------------------------------------------------------------------ no names leak
# Generic code (everything but an architecture's own package and the registry, `architectures/registry.py`) names no
# architecture and reads none of an architecture's own keys: what an architecture adds reaches it through the hooks
# of its `Architecture` and `Options`. Each architecture is scanned for everywhere but in its own package, so no
# architecture's package names another either.


def _case_blind_lines(text: str) -> set[int]:
    """The lines of comments and docstrings (prose about the code, where an architecture is named capitalised)."""
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            lines.add(token.start[0])
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value,
                                                                                                      str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def _generic_keys() -> set[str]:
    """Every generic config key's name (a key an architecture also writes, e.g. `mask_token_id`, is generic), and
    the names of the `Options` hooks."""
    return {f.name for name, section in config_sections() if name not in registry.names()
            for f in dataclasses.fields(section)} | {f.name for f in dataclasses.fields(registry.Options)}


def _export_keys(name: str) -> set[str]:
    """The keys of a tiny drafter's exported config.json under architecture `name`, `dflash_config`'s flattened in."""
    from transformers import Qwen3Config

    from dflash_train.architectures import architecture

    target = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=300)
    arch = architecture(name)
    cfg = config_from_dict({"drafter": {"architecture": name, "block_size": 4, "num_draft_layers": 1}})
    with torch.device("meta"):
        drafter = arch.drafter_class(arch.config_for_run(target, cfg, [0, 2], 5))
    data = arch.config_json(drafter, "float32")
    return set(data) | set(data.get("dflash_config") or {})


def own_words() -> dict[str, list[re.Pattern]]:
    """Architecture name -> what generic code must not hold of it: its name (the default's, which is also the
    package's, as a string literal or its package's module path), its config section's keys and the keys its exported config.json adds to the
    default architecture's, less the generic keys and one-word keys (ordinary words of any code, e.g. `loss`). A key
    the exports of several architectures add (`dflash_config.projector_type`, each with its own value) is theirs
    together: an entry `"a+b"` of its own, which their packages may hold."""
    generic, default_keys = _generic_keys(), _export_keys(registry.DEFAULT)
    added = {name: _export_keys(name) - default_keys for name in registry.names()}
    section_keys = {name: {f.name for f in dataclasses.fields(s)} if (s := registry.options(name).section) else set()
                    for name in registry.names()}
    owners: dict[str, list[str]] = {}
    for name in registry.names():
        for k in (added[name] | section_keys[name]) - generic:
            owners.setdefault(k, []).append(name)
    shared = {k for k, names in owners.items() if len(names) > 1 and "_" in k}
    words: dict[str, list[re.Pattern]] = {}
    for k in sorted(shared):
        words.setdefault("+".join(owners[k]), [re.compile(r"(?!)")]).append(re.compile(rf"\b{re.escape(k)}\b"))
    for name in registry.names():
        keys = (section_keys[name] | added[name]) - shared
        keys = sorted(k for k in keys - generic if "_" in k)
        # (vLLM's `"method": "dflash"` is the engines' name for the whole family's serving, not the architecture)
        named = (re.compile(rf"""(?<!"method": )["']{re.escape(name)}["']|\barchitectures[./]{re.escape(name)}\b"""
                            rf"""|from \.\.{re.escape(name)}\b""")
                 if name == registry.DEFAULT
                 else re.compile(rf"\b{re.escape(name)}\b", re.IGNORECASE))
        words[name] = [named, *(re.compile(rf"\b{re.escape(k)}\b") for k in keys)]
    return words


def _leaks(src: Path, words: dict[str, list[re.Pattern]]) -> list[str]:
    found = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src)
        if rel == Path("architectures/registry.py"):
            continue  # the registry
        text = path.read_text(encoding="utf-8")
        prose = _case_blind_lines(text)
        for name, patterns in words.items():
            if rel.parts[0] == "architectures" and rel.parts[1:2] and rel.parts[1] in name.split("+"):
                continue
            if "+" in name and rel.parts[:2] == ("architectures", "family"):
                continue  # a part several members share (e.g. the block convolution) lives in the family
            for number, line in enumerate(text.splitlines(), 1):
                hit = any(p.search(line) for p in patterns[1:])
                named = patterns[0].search(line)
                if named and not (named.group(0).islower() or number in prose):
                    named = None  # capitalised, in a user-facing string: product text, not code
                if hit or named:
                    found.append((str(rel), number, line.strip()))
    return [f"{rel}:{number}: {line}" for rel, number, line in sorted(set(found))]


def test_generic_code_names_no_architecture_and_reads_none_of_its_keys():
    leaks = _leaks(SRC, own_words())
    assert not leaks, ("architecture names or keys outside their package (move the code behind `Architecture` / "
                       "`registry.Options` hooks):\n" + "\n".join(leaks))


def test_the_leak_check_finds_a_planted_name_and_key(tmp_path):
    words = own_words()
    assert {"selector_top_k", "markov_rank", "gru_hidden_dim", "projector_type"} <= {
        p.pattern.strip("\\b") for patterns in words.values() for p in patterns[1:]}
    (tmp_path / "train").mkdir(parents=True)
    (tmp_path / "train" / "step.py").write_text(
        'if cfg.drafter.architecture == "dflash2":\n    x.selector_top_k\nif arch != "dflash":\n'
        '    pass  # DSpark\'s own head\nhelp = "(DSpark) and dflash-train"\n'
        'shape = {"gru_hidden_dim": 1, "loss": 2}\nfrom ..architectures.dflash.model import DFlashDrafter\n')
    (tmp_path / "architectures" / "dflash2").mkdir(parents=True)
    (tmp_path / "architectures" / "dflash2" / "model.py").write_text("self.selector_top_k = 1\n")
    (tmp_path / "architectures" / "dspark").mkdir(parents=True)
    (tmp_path / "architectures" / "dspark" / "model.py").write_text("from ..dflash2.model import X\n")
    (tmp_path / "architectures" / "dspark" / "options.py").write_text("from ..dflash.options import SERVING\n")
    # a key two members share (the block convolution's) is the family's: its shared parts hold it, generic code not
    (tmp_path / "architectures" / "family").mkdir(parents=True)
    (tmp_path / "architectures" / "family" / "conv.py").write_text('k = d["conv_kernel_size"]\n')
    (tmp_path / "train" / "memory.py").write_text('k = d["conv_kernel_size"]\n')
    assert _leaks(tmp_path, words) == [
        "architectures/dspark/model.py:1: from ..dflash2.model import X",
        "architectures/dspark/options.py:1: from ..dflash.options import SERVING",
        'train/memory.py:1: k = d["conv_kernel_size"]',
        'train/step.py:1: if cfg.drafter.architecture == "dflash2":', "train/step.py:2: x.selector_top_k",
        'train/step.py:3: if arch != "dflash":', "train/step.py:4: pass  # DSpark's own head",
        'train/step.py:6: shape = {"gru_hidden_dim": 1, "loss": 2}',
        "train/step.py:7: from ..architectures.dflash.model import DFlashDrafter"]


# ------------------------------------------------------------------------------------------------ the sections


def test_an_architecture_section_loads_and_dumps_in_the_new_shape(tmp_path):
    cfg = config_from_dict({"drafter": {"architecture": "dflash2"}, "dflash2": {"selector_top_k": 16}},
                           ["dflash2.selector_rows=all"])
    assert (cfg.options.selector_top_k, cfg.options.selector_rows, cfg.options.conv_kernel_size) == (16, "all", 2)
    dump_config(cfg, tmp_path / "c.yaml")
    written = yaml.safe_load((tmp_path / "c.yaml").read_text())
    assert written["dflash2"]["selector_top_k"] == 16 and "selector_top_k" not in written["drafter"]
    assert "selector_rows" not in written["objective"] and "options" not in written
    assert config_to_dict(load_config(tmp_path / "c.yaml")) == config_to_dict(cfg)
    plain = config_from_dict({})
    assert plain.options is None and "dflash2" not in config_to_dict(plain)


@pytest.mark.parametrize("tree,overrides,message", [
    ({"dflash2": {"selector_top_k": 16}}, [],
     r"^config key 'dflash2.selector_top_k': applies to DFlash2's .*drafter.architecture is 'dflash': set "
     r"drafter.architecture=dflash2 or remove the dflash2 section$"),
    ({}, ["dflash2.selector_rank=8"], r"'dflash2.selector_rank'.*remove the dflash2 section \(override "),
    ({"drafter": {"architecture": "dflash2"}, "dflash2": {"selector_top_k": 0}}, [],
     r"'dflash2.selector_top_k': must be a positive integer"),
    ({"drafter": {"architecture": "dflash2"}, "dflash2": {"nope": 1}}, [],
     r"unknown config key 'dflash2.nope'; valid keys in dflash2: acceptance_from, "),
    ({"drafter": {"architecture": "dflash2", "block_size": 4}, "dflash2": {"conv_kernel_size": 5}}, [],
     r"'dflash2.conv_kernel_size': must be between 1 and drafter.block_size=4"),
    ({"drafter": {"architecture": "dflash2"}, "dflash2": {"acceptance_from": "selector"},
      "objective": {"slot_weighting": "gamma"}}, [], r"'dflash2.acceptance_from'.*'gamma'"),
    ({"drafter": {"selector_top_k": 8}, "dflash2": {"selector_top_k": 8}}, [],
     r"'drafter.selector_top_k' is the old name of 'dflash2.selector_top_k', which is given too"),
    ({"options": {}}, [], r"unknown config key 'options'; valid keys in the top level: data, dflash2, domino, drafter"),
])
def test_a_section_is_refused_naming_the_key_and_what_to_do(tree, overrides, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(tree, overrides)


def test_a_section_given_before_its_architecture_in_the_overrides_is_accepted():
    cfg = config_from_dict({}, ["dflash2.selector_top_k=64", "drafter.architecture=dflash2"])
    assert cfg.options.selector_top_k == 64


# ------------------------------------------------------------------------------------------------ the old flat keys


def _old_shape(cfg) -> dict:
    """The config as dump_config wrote it before the sections: the architecture's keys flat under drafter and
    objective (every key, at its value)."""
    plain = config_to_dict(cfg)
    section = plain.pop(cfg.drafter.architecture, None) or dataclasses.asdict(
        registry.options("dflash2").section())
    for old, new in registry.options("dflash2").aliases.items():
        where, key = old.split(".")
        plain[where][key] = section[new]
    return plain


def test_old_flat_keys_load_under_their_new_names_with_one_warning(caplog, monkeypatch):
    from dflash_train.config import load as config_load

    monkeypatch.setattr(config_load, "_WARNED", set())  # warned once per process: this test's keys may have been before
    with caplog.at_level(logging.WARNING, logger="dflash_train.config.load"):
        cfg = config_from_dict({"drafter": {"architecture": "dflash2", "selector_top_k": 12},
                                "objective": {"selector_loss_weight": 0.5}}, ["drafter.selector_rank=4"])
    assert (cfg.options.selector_top_k, cfg.options.selector_rank, cfg.options.selector_loss_weight) == (12, 4, 0.5)
    lines = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(lines) == 1, lines
    for old, new in (("drafter.selector_top_k", "dflash2.selector_top_k"), ("drafter.selector_rank",
                                                                            "dflash2.selector_rank"),
                     ("objective.selector_loss_weight", "dflash2.selector_loss_weight")):
        assert f"{old} -> {new}" in lines[0]


def test_old_flat_keys_keep_their_refusals_and_name_the_key_as_written():
    with pytest.raises(ConfigError, match=r"^config key 'drafter.selector_lr_scale' \(now dflash2.selector_lr_scale\)"
                                          r": applies to .*set drafter.architecture=dflash2 or leave "
                                          r"drafter.selector_lr_scale at 1.0"):
        config_from_dict({"drafter": {"selector_lr_scale": 10}})
    with pytest.raises(ConfigError, match=r"^override 'drafter.selector_top_k=0': config key 'drafter.selector_top_k' "
                                          r"\(now dflash2.selector_top_k\): must be a positive integer"):
        config_from_dict({"drafter": {"architecture": "dflash2"}}, ["drafter.selector_top_k=0"])


def test_a_dflash_config_yaml_written_before_the_sections_loads_unchanged():
    """Every older config.yaml holds the flat keys at their defaults, whatever the architecture: for dflash they
    are dropped (they never applied), and the config is the one written."""
    cfg = config_from_dict({"optim": {"lr": 1e-3}})
    old = _old_shape(cfg)
    assert old["drafter"]["selector_top_k"] == 32
    again = config_from_dict(old)
    assert again == cfg and again.options is None


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_a_run_whose_config_yaml_has_the_old_keys_resumes_with_no_change(tmp_path, arch, tiny_target_dir,
                                                                       counting_jsonl, caplog, monkeypatch):
    from dflash_train.config import load as config_load
    from dflash_train.run.directory import RunDir
    from dflash_train.train.start.directory_admission import admit_start, flatten

    fresh = config_from_dict({"target": {"path": str(tiny_target_dir)}, "data": {"train_files": [str(counting_jsonl)]},
                              "drafter": {"architecture": arch, "block_size": 4},
                              **({"dflash2": {"selector_top_k": 8, "selector_rows": "all"}} if arch == "dflash2" else {}),
                              "optim": {"max_steps": 4}})
    run = RunDir(tmp_path / "run")
    (run.checkpoints / "step-00000002").mkdir(parents=True)
    (run.checkpoints / "step-00000002" / "trainer_state.json").write_text("{}")
    run.config.write_text(yaml.safe_dump(_old_shape(fresh), sort_keys=False))
    monkeypatch.setattr(config_load, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="dflash_train.config.load"):
        start = admit_start(None, ["optim.max_steps=6"], run.root, resume=True, check_owner=False)
    assert start.changes == {"optim.max_steps": (4, 6)}
    # the run's config.yaml is read twice (as recorded, as asked): one deprecation line
    assert len([r for r in caplog.records if "deprecated config keys" in r.getMessage()]) == 1
    assert flatten(start.cfg) == {**flatten(fresh), "optim.max_steps": 6}
    # a new-shape CONFIG given with --resume is the same run; a changed section key is refused by its name
    dump_config(fresh, tmp_path / "new.yaml")
    assert admit_start(str(tmp_path / "new.yaml"), [], run.root, resume=True, check_owner=False).changes == {}
    if arch == "dflash2":
        with pytest.raises(ConfigError, match=r"'dflash2.selector_top_k' is 8 in .* and 16 by the override "
                                              r"drafter.selector_top_k=16"):
            admit_start(None, ["drafter.selector_top_k=16"], run.root, resume=True, check_owner=False)


def test_a_resume_that_changes_the_architecture_names_its_keys_not_a_crash(tmp_path):
    from dflash_train.run.directory import RunDir
    from dflash_train.train.start.directory_admission import resume_changes

    dflash2 = config_from_dict({"drafter": {"architecture": "dflash2"}})
    with pytest.raises(ConfigError, match=r"'drafter.architecture' is 'dflash2' .* and 'dflash'"):
        resume_changes(dflash2, config_from_dict({}), RunDir(tmp_path), None, ["drafter.architecture=dflash"], None)


# ------------------------------------------------------------------------------------------------ a toy architecture
# Defined here alone: a DFlash drafter whose final hidden states go through one trained scalar gate, started at
# the value of its one config key (`toy.gate_init`), written into its drafter config and exported; the gate's FLOPs
# and the rows it keeps for its gradient are its own terms in the step's FLOPs and memory estimate.

from dflash_train.architectures.contract import Architecture, StepFlops, StepMemory  # noqa: E402
from dflash_train.architectures.stats import DraftWork  # noqa: E402
from dflash_train.architectures.family.backend import resolve_backend  # noqa: E402
from dflash_train.architectures.family.config import drafter_config_from_dict, drafter_config_json  # noqa: E402
from dflash_train.architectures.dflash.config import config_for_run as dflash_config_for_run  # noqa: E402
from dflash_train.architectures.dflash.model import DFlashDrafter  # noqa: E402
from dflash_train.architectures.dflash.objective import DFlashObjective  # noqa: E402
from dflash_train.numbers import POSITIVE_NUMBER  # noqa: E402

TOY_HF = "ToyGateDraftModel"


@dataclasses.dataclass
class ToyOptions:
    # The start value of the toy drafter's gate on its final hidden states.
    gate_init: float = 1.0


class ToyDrafter(DFlashDrafter):
    architecture = "toy"

    def __init__(self, config):
        super().__init__(config)
        self.toy_gate = nn.Parameter(torch.tensor(float(config.dflash_config["toy_gate_init"])))

    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs) * self.toy_gate.to(args[1].dtype)


def _toy_config_for_run(target_config, cfg, target_layer_ids, mask_token_id):
    out = dflash_config_for_run(target_config, cfg, target_layer_ids, mask_token_id)
    out.architectures = [TOY_HF]
    out.dflash_config["toy_gate_init"] = cfg.options.gate_init
    return out


@dataclasses.dataclass(frozen=True)
class ToyStepFlops(StepFlops):
    hidden: int

    def parts(self, work: DraftWork) -> dict[str, float]:
        return {"toy_gate": 3.0 * work.block_tokens * self.hidden}  # the product, its input and weight gradients


@dataclasses.dataclass(frozen=True)
class ToyStepMemory(StepMemory):
    hidden: int

    def loss_rows(self, counted: int, e: int) -> int:
        return counted * self.hidden * 4  # the gate's input rows, kept for its gradient


TOY_PLAIN = Architecture(name="toy", hf_architecture=TOY_HF, drafter_class=ToyDrafter,
                         config_for_run=_toy_config_for_run,
                         config_from_dict=lambda data: drafter_config_from_dict(data, TOY_HF),
                         config_json=drafter_config_json, resolve_backend=resolve_backend, objective=DFlashObjective)
TOY = dataclasses.replace(TOY_PLAIN, step_flops=lambda c: ToyStepFlops(c.hidden_size),
                          step_memory=lambda c: ToyStepMemory(c.hidden_size))
TOY_OPTIONS = registry.Options(section=ToyOptions, number_rules={"gate_init": POSITIVE_NUMBER},
                                    about="the toy drafter's gate")


@pytest.fixture
def toy_registered():
    registry.register("toy", TOY_HF, TOY, TOY_OPTIONS)
    try:
        yield
    finally:
        registry.unregister("toy")
    assert "toy" not in registry.names()


def test_a_toy_section_is_checked_like_any_other(toy_registered):
    assert config_from_dict({"drafter": {"architecture": "toy"}}).options == ToyOptions()
    with pytest.raises(ConfigError, match=r"'toy.gate_init': must be a number > 0"):
        config_from_dict({"drafter": {"architecture": "toy"}, "toy": {"gate_init": 0}})
    with pytest.raises(ConfigError, match=r"'toy.gate_init': applies to the toy drafter's gate; drafter.architecture "
                                          r"is 'dflash': set drafter.architecture=toy or remove the toy section"):
        config_from_dict({"toy": {"gate_init": 2.0}})


def test_a_reduced_draft_vocabulary_is_a_declared_capability(toy_registered):
    """`drafter.draft_vocab_size` is accepted under an architecture whose options declare `draft_vocabulary`, and
    refused under one that does not, naming those that do."""
    tree = {"drafter": {"architecture": "toy", "draft_vocab_size": 10}}
    with pytest.raises(ConfigError, match=r"'drafter.draft_vocab_size': a reduced draft vocabulary is implemented "
                                          r"for drafter.architecture=dflash only; toy scores"):
        config_from_dict(tree)
    capable = dataclasses.replace(TOY_OPTIONS, draft_vocabulary=True)
    registry._REGISTRY["toy"] = dataclasses.replace(registry._REGISTRY["toy"], options=capable)
    assert config_from_dict(tree).drafter.draft_vocab_size == 10
    with pytest.raises(ConfigError, match=r"drafter.architecture=dflash / toy only; dflash2 scores"):
        config_from_dict({"drafter": {"architecture": "dflash2", "draft_vocab_size": 10}})


def test_the_onpolicy_stage_is_declared_and_built_together(toy_registered):
    """An architecture whose options declare `on_policy` names the stage's objective in its `Architecture`, and one
    that does not names none; the stage under one that does not is refused before any model loads, naming those
    that do."""
    from dflash_train.architectures import architecture
    from dflash_train.architectures.family.onpolicy import OnPolicyObjective

    for name in registry.names():
        stage = architecture(name).onpolicy_objective
        assert registry.options(name).on_policy == (stage is not None), name
        assert stage is None or issubclass(stage, OnPolicyObjective), name
    with pytest.raises(ConfigError, match=r"'onpolicy.start_from': the on-policy stage trains drafter.architecture="
                                          r"dflash / .* it does not train toy yet"):
        config_from_dict({"drafter": {"architecture": "toy"}, "onpolicy": {"start_from": "runs/finished"}})


def _train(main, config: Path, run: Path) -> list[dict]:
    """Three steps of `train CONFIG` into `run`: its metrics records."""
    assert main(["train", str(config), "--run-dir", str(run), "--max-steps", "3"]) == 0
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_activation_estimate_counts_the_toys_own_memory_terms(toy_registered, tiny_target_dir):
    """The preflight's activation estimate reads the architecture's `step_memory`: the toy's gate rows are in it."""
    from transformers import AutoConfig

    from dflash_train.train.plan.activation_memory import activation_estimate

    target = AutoConfig.from_pretrained(tiny_target_dir)
    cfg = config_from_dict({"drafter": {"architecture": "toy", "num_draft_layers": 1, "block_size": 4},
                            "data": {"max_length": 256, "token_budget": 1024, "max_batch_size": 4}})
    drafter_config = TOY.config_for_run(target, cfg, [1, 4], 5)

    def estimate():
        return activation_estimate("colocated", cfg, target, drafter_config, [1, 4], torch.float32, torch.float32,
                                   "cpu")

    own = estimate()
    registry._REGISTRY["toy"] = dataclasses.replace(registry._REGISTRY["toy"], package=TOY_PLAIN)
    plain = estimate()
    assert own.shape == plain.shape
    assert own.parts["loss rows"] - plain.parts["loss rows"] == ToyStepMemory(64).loss_rows(own.shape.counted, 4) > 0


def test_a_toy_architecture_from_a_test_file_trains_decodes_exports_and_reloads(toy_registered, tmp_path,
                                                                             tiny_target_dir, counting_jsonl):
    from dflash_train.cli import main
    from dflash_train.architectures.io import load_drafter

    cfg = {
        "target": {"path": str(tiny_target_dir)},
        "drafter": {"architecture": "toy", "num_draft_layers": 1, "block_size": 4, "attention_backend": "sdpa"},
        "toy": {"gate_init": 0.5},
        "data": {"train_files": [str(counting_jsonl)], "max_length": 256, "token_budget": 1024, "max_batch_size": 4},
        "objective": {"max_anchors": 16, "gamma": 4.0},
        "optim": {"lr": 3e-3, "epochs": 10, "warmup_ratio": 0.05},
        "run": {"device": "cpu", "log_every": 1, "save_every": 3, "progress_bar": False, "eval_every": 0,
                "export_dtype": "float32", "mfu_peak_tflops": 1.0},
    }
    (tmp_path / "toy.yaml").write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    records = _train(main, tmp_path / "toy.yaml", run)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert yaml.safe_load((run / "config.yaml").read_text())["toy"] == {"gate_init": 0.5}

    # the step's model FLOPs and MFU count the toy's own FLOP term: the same run without it logs that much less
    registry._REGISTRY["toy"] = dataclasses.replace(registry._REGISTRY["toy"], package=TOY_PLAIN)
    plain = _train(main, tmp_path / "toy.yaml", tmp_path / "plain")
    for r, p in zip(records, plain):
        assert (r["target_flops"], r["drafted_blocks"]) == (p["target_flops"], p["drafted_blocks"])
        gate = ToyStepFlops(64).parts(DraftWork(block_tokens=r["drafted_blocks"] * 4))["toy_gate"]
        assert gate > 0 and r["drafter_flops"] == pytest.approx(p["drafter_flops"] + gate, rel=1e-12)
        assert r["drafter_mfu"] == pytest.approx(r["mfu"] * r["drafter_flops"] / r["step_flops"], rel=1e-9)
    registry._REGISTRY["toy"] = dataclasses.replace(registry._REGISTRY["toy"], package=TOY)

    exported = load_drafter(run / "export")
    assert type(exported) is ToyDrafter and exported.config.dflash_config["toy_gate_init"] == 0.5
    gate = float(exported.toy_gate.detach())
    assert gate != 0.5 and abs(gate - 0.5) < 0.1  # trained, from the key's start
    assert json.loads((run / "export" / "config.json").read_text())["architectures"] == [TOY_HF]

    out = tmp_path / "eval.json"
    assert main(["eval", "--target", str(tiny_target_dir), "--drafter", str(run / "export"), "--data",
                 str(counting_jsonl), "--limit", "2", "--max-new-tokens", "8", "--out", str(out), "--no-progress",
                 "--device", "cpu"]) == 0
    result = json.loads(out.read_text())
    body = result["datasets"][str(counting_jsonl)]
    assert body["modes"]["block"]["tau"] >= 1 and body["lossless_mismatches"] == []

    assert main(["export", str(run / "checkpoints" / "step-00000003"), "--out", str(tmp_path / "E"),
                 "--dtype", "float32"]) == 0
    again = load_drafter(tmp_path / "E")
    assert type(again) is ToyDrafter
    for (name, a), (_, b) in zip(exported.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


# ------------------------------------------------------------------------ exports sharing an architectures name


def test_exports_sharing_an_architectures_name_are_told_apart_by_their_marks():
    """Two architectures may export the same `architectures` name: the registry tells their config.json files
    apart by the keys each one marks, and refuses a marked key holding a value none of them claims."""
    marks = {"dflash_config.projector_type": "toy_projector"}
    registry.register("toy", "DFlashDraftModel", TOY, TOY_OPTIONS, export_marks=marks)
    try:
        def of(**dflash):
            return registry.entry_of_export({"architectures": ["DFlashDraftModel"], "dflash_config": dflash}).name

        assert of(projector_type="toy_projector") == "toy"
        assert of(mask_token_id=3) == registry.DEFAULT  # no mark: the plain one
        with pytest.raises(registry.NotAnExport, match=r"DFlashDraftModel config with "
                                                            r"dflash_config.projector_type 'other': this version reads "
                                                            r".*'toy_projector' \(toy\).*absent \(dflash\)"):
            of(projector_type="other")
        with pytest.raises(registry.NotAnExport, match=r"architectures is \['NoSuchModel'\]"):
            registry.entry_of_export({"architectures": ["NoSuchModel"]})
        with pytest.raises(ValueError, match="already registered with the marks"):
            registry.register("toy2", "DFlashDraftModel", TOY, None, export_marks=marks)
    finally:
        registry.unregister("toy")


def test_an_architecture_changes_a_generic_default_and_a_given_value_stays(toy_registered):
    options = dataclasses.replace(TOY_OPTIONS, defaults={"objective.slot_weighting": "gamma"})
    registry._REGISTRY["toy"] = dataclasses.replace(registry._REGISTRY["toy"], options=options)
    assert config_from_dict({"drafter": {"architecture": "toy"}}).objective.slot_weighting == "gamma"
    given = {"drafter": {"architecture": "toy"}, "objective": {"slot_weighting": "dpace"}}
    assert config_from_dict(given).objective.slot_weighting == "dpace"
    overridden = config_from_dict({}, ["drafter.architecture=toy", "objective.slot_weighting=acceptance"])
    assert overridden.objective.slot_weighting == "acceptance"
    assert config_from_dict({}).objective.slot_weighting == "acceptance"  # the generic default elsewhere
