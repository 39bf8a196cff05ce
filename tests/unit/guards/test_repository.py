"""The repository holds the product as it is now: no development-diary words, no raw logs, no path outside the
checkout, and documentation links (and the docs anchors code comments cite) that resolve."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".sh", ".cfg", ".ini", ".json", ""}
# Words of a development diary, not of the product. (`Session`, the training loop's class, and pytest's
# scope="session" are product words: only "session" followed by a number is a diary's.)
DIARY = re.compile(r"\bsessions? \d+|\bissues? #?\d+|\bthe field\b|/root/|/work/|/tmp/site|\.\./shared|\.gpu/",
                   re.IGNORECASE)
RAW_RESULTS = re.compile(r"\.(log|out)$|(^|/)results-[^/]*\.jsonl$|(^|/)pytest[^/]*\.txt$")
MD_LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")
ANCHOR_LINK = re.compile(r"\]\(([^)#\s]*)#([^)\s]+)\)")  # [text](page.md#anchor) or [text](#anchor)
CODE_DOC_REF = re.compile(r"((?:docs|benchmarks)/[\w/.-]+\.md)#([\w-]+)")  # a comment's docs/page.md#anchor


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


def heading_anchors(page: Path) -> set[str]:
    """The anchors a Markdown renderer gives the page's headings (GitHub's rule: lower case, punctuation dropped,
    spaces to hyphens, a repeated heading suffixed -1, -2, ...); headings inside code fences are not headings."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        heading = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def broken_anchors(files: list[Path]) -> list[str]:
    """`page.md#anchor` links of Markdown files and docs references of Python comments whose page exists but has no
    such heading."""
    broken = []
    for path in files:
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            pairs = [(REPO / page, anchor) for page, anchor in CODE_DOC_REF.findall(line)]
            if path.suffix == ".md":
                pairs += [(path.parent / page if page else path, anchor) for page, anchor in ANCHOR_LINK.findall(line)
                          if not re.match(r"[a-z]+:", page)]
            for page, anchor in pairs:
                if page.suffix == ".md" and page.is_file() and anchor not in heading_anchors(page):
                    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
                    broken.append(f"{shown}:{n}: {page.name}#{anchor}")
    return broken


def test_every_anchor_a_doc_or_a_comment_cites_is_a_heading():
    files = [p for p in tracked_files() if p.suffix in (".md", ".py")]
    broken = broken_anchors(files)
    assert not broken, "links to headings that do not exist (rename the link or the heading):\n" + "\n".join(broken)


def test_the_anchor_check_catches_what_it_is_for(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n## DSpark's and Domino's steps\n\n## Runs\n\n## Runs\n\n```\n## not a heading\n```\n")
    assert heading_anchors(page) == {"page", "dsparks-and-dominos-steps", "runs", "runs-1"}
    doc = tmp_path / "doc.md"
    doc.write_text("[ok](page.md#runs-1) [ok](#top) [bad](page.md#runs-2) [bad](page.md#not-a-heading)\n# Top\n")
    assert broken_anchors([doc]) == ["doc.md:1: page.md#runs-2", "doc.md:1: page.md#not-a-heading"]


def pages_within(start: Path, hops: int) -> set[Path]:
    """The Markdown pages reachable from `start` by following at most `hops` relative links."""
    seen, frontier = {start.resolve()}, {start.resolve()}
    for _ in range(hops):
        nxt = set()
        for page in frontier:
            for target, _ in MD_LINK.findall(page.read_text()):
                linked = (page.parent / target).resolve()
                if not re.match(r"[a-z]+:", target) and linked.suffix == ".md" and linked.is_file() and linked not in seen:
                    nxt.add(linked)
        seen |= nxt
        frontier = nxt
    return seen


def test_every_docs_page_and_the_benchmarks_readme_are_at_most_two_clicks_from_the_readme():
    wanted = {p.resolve() for p in tracked_files() if p.suffix == ".md" and p.is_relative_to(REPO / "docs")}
    wanted.add((REPO / "benchmarks" / "README.md").resolve())
    far = sorted(str(p.relative_to(REPO)) for p in wanted - pages_within(REPO / "README.md", 2))
    assert not far, "pages a reader cannot reach from README.md in two clicks (link them from README.md or a page " \
                    "it links):\n" + "\n".join(far)


def test_the_two_click_check_catches_what_it_is_for(tmp_path):
    (tmp_path / "README.md").write_text("[a](a.md)\n")
    (tmp_path / "a.md").write_text("[b](b.md) [web](https://example.com/c.md)\n")
    (tmp_path / "b.md").write_text("[c](c.md)\n")
    (tmp_path / "c.md").write_text("end\n")
    assert {p.name for p in pages_within(tmp_path / "README.md", 2)} == {"README.md", "a.md", "b.md"}


MAX_FUNCTION_LINES = 120


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Every function or method under `root` longer than `limit` lines (its `def` line to its last), by file."""
    import ast

    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_no_function_in_the_package_is_longer_than_120_lines():
    long = long_functions(REPO / "src" / "dflash_train")
    assert not long, (f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps):\n" + "\n".join(long))


def test_the_function_length_check_catches_what_it_is_for(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(f"def fits():\n{body}\n\nclass C:\n    def too_long(self):\n"
                                           + body.replace("    ", "        ") + "        return 1\n")
    assert long_functions(tmp_path / "pkg") == [f"pkg/m.py:{MAX_FUNCTION_LINES + 4} too_long: {MAX_FUNCTION_LINES + 1} lines"]  # fits: 120
