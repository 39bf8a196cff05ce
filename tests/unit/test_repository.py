"""The repository holds the product as it is now: no development-diary words, no raw logs, no path outside the
checkout, and documentation links that resolve."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".sh", ".cfg", ".ini", ".json", ""}
# Words of a development diary, not of the product. (`Session`, the training loop's class, and pytest's
# scope="session" are product words: only "session" followed by a number is a diary's.)
DIARY = re.compile(r"\bsessions? \d+|\bissues? #?\d+|\bthe field\b|/root/|/work/|/tmp/site|\.\./shared|\.gpu/",
                   re.IGNORECASE)
RAW_RESULTS = re.compile(r"\.(log|out)$|(^|/)results-[^/]*\.jsonl$|(^|/)pytest[^/]*\.txt$")
MD_LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def tracked_files() -> list[Path]:
    try:
        names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
        return [REPO / n for n in names.splitlines() if (REPO / n).is_file()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an sdist): every file but the venv
        skip = {".git", ".venv", "runs", ".pytest_cache", "__pycache__"}
        return [p for p in REPO.rglob("*") if p.is_file() and not skip & set(p.relative_to(REPO).parts)]


def text_files() -> list[Path]:
    return [p for p in tracked_files() if p.suffix in TEXT_SUFFIXES and p.name != "test_repository.py"]  # the patterns


def diary_lines(files: list[Path]) -> list[str]:
    found = []
    for path in files:
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if DIARY.search(line):
                shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
                found.append(f"{shown}:{n}: {line.strip()[:100]}")
    return found


def test_no_development_diary_words_in_the_tracked_tree():
    found = diary_lines(text_files())
    assert not found, "development-diary words (say what the product does now):\n" + "\n".join(found)


def test_the_diary_check_catches_what_it_is_for(tmp_path):
    # The diary lines are assembled here, so that this file does not hold them itself.
    diary = [" ".join(words) for words in (("measured in", "ses" + "sion", "12"), ("see", "is" + "sue", "#10"),
                                           ("as", "the", "fi" + "eld", "ran it"), ("from", "../sha" + "red/data"))]
    sample = tmp_path / "x.md"
    sample.write_text("ok: scope='session', class Session\n" + "\n".join(diary) + "\n")
    assert [line.split(": ", 1)[1] for line in diary_lines([sample])] == diary


def test_no_raw_result_files_are_tracked():
    raw = [str(p.relative_to(REPO)) for p in tracked_files() if RAW_RESULTS.search(str(p.relative_to(REPO)))]
    assert not raw, f"raw logs and results belong outside the source tree: {raw}"


def test_every_relative_link_in_the_docs_resolves():
    broken = []
    for doc in [p for p in tracked_files() if p.suffix == ".md"]:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for target, _ in MD_LINK.findall(line):
                if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                    continue
                if not (doc.parent / target).exists():
                    broken.append(f"{doc.relative_to(REPO)}:{n}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)
