"""The one atomic write of a file and replace of a folder (files/io.py): whatever stood at the destination is gone
after (or, asked to keep it, moved aside beside it), nothing else is left beside it, and a folder another process
finished first stays."""
import os
import stat
from pathlib import Path

import pytest

from dflash_train.files.io import replace_dir, temp_dir_beside, write_text_atomic


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


def test_kept_the_old_folder_is_moved_aside_and_its_new_name_returned(tmp_path):
    final = tmp_path / "export"
    final.mkdir()
    (final / "model.safetensors").write_text("old")
    moved = replace_dir(_finished(final), final, keep_old=True)
    assert moved is not None and moved.name.startswith("export.old-")
    assert (moved / "model.safetensors").read_text() == "old"
    assert (final / "model.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["export", moved.name])


def test_a_folder_another_process_finished_first_stays(tmp_path):
    final = tmp_path / "export"
    final.mkdir()
    (final / "model.safetensors").write_text("theirs")
    tmp = _finished(final)
    assert replace_dir(tmp, final, complete=lambda p: (p / "model.safetensors").is_file()) is None
    assert (final / "model.safetensors").read_text() == "theirs"
    assert tmp.is_dir()  # the caller's to delete


def test_a_text_file_is_written_whole_with_ordinary_modes_and_a_failed_write_leaves_no_temp_file(tmp_path):
    path = tmp_path / "status.json"
    write_text_atomic(path, "{}")
    mask = os.umask(0)
    os.umask(mask)
    assert path.read_text() == "{}" and stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask
    with pytest.raises(UnicodeEncodeError):
        write_text_atomic(path, "half \udc80")  # a lone surrogate cannot be encoded: the write fails midway
    assert path.read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["status.json"]


def test_a_replace_whose_new_folder_cannot_move_in_puts_the_old_one_back(tmp_path):
    final = tmp_path / "step-00000008"
    final.mkdir()
    (final / "trainer_state.json").write_text("old")
    with pytest.raises(FileNotFoundError):
        replace_dir(tmp_path / ".gone.tmp", final, durable=True)  # the finished folder vanished before its rename
    assert (final / "trainer_state.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000008"]
    new = temp_dir_beside(final)
    (new / "trainer_state.json").write_text("new")
    assert replace_dir(new, final, durable=True) is None
    assert (final / "trainer_state.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000008"]
