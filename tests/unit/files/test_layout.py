"""A step's checkpoint folder has one name (files/layout.py): the writer's name reads back as its step, zero-padded or
not, and the complete checkpoints of a folder come in step order."""
from pathlib import Path

from dflash_train.files.layout import STATE, list_checkpoints, step_folder, step_of


def _checkpoint(root: Path, name: str, complete: bool = True) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    if complete:
        (folder / STATE).write_text("{}")
    return folder


def test_a_step_folder_name_reads_back_as_its_step():
    for step in (0, 7, 120, 10**8 + 3):
        assert step_of(step_folder(step)) == step
    assert step_folder(120) == "step-00000120" and step_of("step-120") == 120
    for other in ("best", "step-", "step-12a", ".step-00000012.tmp", "step-00000012.old-20250101-000000"):
        assert step_of(other) is None


def test_checkpoints_come_in_step_order_whatever_the_padding(tmp_path):
    nine = _checkpoint(tmp_path, "step-9")
    ten = _checkpoint(tmp_path, step_folder(10))
    two = _checkpoint(tmp_path, step_folder(2))
    _checkpoint(tmp_path, step_folder(11), complete=False)  # killed mid-write: not a checkpoint
    _checkpoint(tmp_path, "best")
    _checkpoint(tmp_path, "step-old")
    assert list_checkpoints(tmp_path) == [two, nine, ten]
