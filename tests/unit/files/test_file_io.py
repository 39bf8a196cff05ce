"""Atomic placement of finished folders (runtime.replace_dir): whatever stood at the destination is gone after, and
nothing is left beside it."""
from pathlib import Path

from dflash_train.runtime import replace_dir, temp_dir_beside


def _finished(final: Path) -> Path:
    tmp = temp_dir_beside(final)
    (tmp / "model.safetensors").write_text("new")
    return tmp


def test_an_old_folder_is_replaced_and_nothing_stays_beside_it(tmp_path):
    final = tmp_path / "export"
    final.mkdir()
    (final / "model.safetensors").write_text("old")
    replace_dir(_finished(final), final)
    assert (final / "model.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_a_file_where_the_folder_goes_is_replaced_and_not_left_as_a_hidden_copy(tmp_path):
    final = tmp_path / "export"
    final.write_text("a stray file")
    replace_dir(_finished(final), final)
    assert (final / "model.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_a_link_where_the_folder_goes_is_replaced_and_its_target_kept(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("kept")
    final = tmp_path / "export"
    final.symlink_to(elsewhere)
    replace_dir(_finished(final), final)
    assert not final.is_symlink() and (final / "model.safetensors").read_text() == "new"
    assert (elsewhere / "keep.txt").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "export"]
