"""Rules CONTRIBUTING.md states, kept true: no Python file over ~500 lines (product, tests, benchmarks), and no
tracker numbers in the repository (a user has no such tracker: a text names the behaviour it means). Read as text."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TREES = ("common", "data_prep", "leviathan_pretrain", "launchers", "tests", "benchmarks", "scripts", "configs",
         "docs", "results", ".ci")  # fmt: skip
MAX_LINES = 500
TRACKER = re.compile(r"\bissues? #?[0-9]+\b|\banchors? [A-D](/[A-D])?\b", re.I)


def repository_texts() -> list[Path]:
    files = [p for p in REPO.iterdir() if p.is_file() and p.suffix in (".md", ".toml", ".txt", "")]
    for tree in TREES:
        files += [p for p in (REPO / tree).rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return sorted(p for p in files if p.suffix not in (".png", ".npy", ".pt", ".bin", ".idx", ".zst"))


def test_no_python_file_is_over_500_lines():
    long = {
        p.relative_to(REPO).as_posix(): n
        for tree in ("common", "data_prep", "leviathan_pretrain", "launchers", "tests", "benchmarks")
        for p in (REPO / tree).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines (CONTRIBUTING.md): split by concern: {long}"


def test_no_tracker_numbers_in_the_repository():
    found = []
    for p in repository_texts():
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        found += [
            f"{p.relative_to(REPO)}:{text[: m.start()].count(chr(10)) + 1}: {m.group(0)}"
            for m in TRACKER.finditer(text)
        ]
    assert not found, "name the behaviour, not a tracker issue:\n  " + "\n  ".join(found[:20])


def test_the_rules_see_what_they_check():
    word = "issue"  # spelled apart, or this file would hold what it forbids
    assert TRACKER.search(f"as {word} 44 said") and TRACKER.search(f"{word} #7") and TRACKER.search("anchor" + "s C/D")
    assert not TRACKER.search("an issue with 4 GPUs") and not TRACKER.search("tissue 3")
    texts = {p.relative_to(REPO).as_posix() for p in repository_texts()}
    assert {"README.md", "docs/architecture.md", "leviathan_pretrain/trainer/loop.py", ".ci/run"} <= texts
