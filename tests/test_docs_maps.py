"""The maps of the code stay true: docs/architecture.md's module map and trainer/__init__.py's module list.

Both are read as text (no import of the product, no torch): a new module fails here until it is named.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("data_prep", "leviathan_pretrain", "launchers")  # the top-level packages the module map covers
ARCHITECTURE = REPO / "docs/architecture.md"
TRAINER = REPO / "leviathan_pretrain/trainer"


def modules_on_disk(*packages: str) -> set[str]:
    """Repo-relative paths of every ``.py`` module under ``packages`` on disk, ``__init__.py`` excluded."""
    return {
        p.relative_to(REPO).as_posix()
        for package in packages
        for p in (REPO / package).rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    }


def section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section of a Markdown text (up to the next ``## `` heading)."""
    match = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/architecture.md has no '## {heading}' section"
    return match.group(1)


def module_map(text: str) -> set[str]:
    """Repo-relative module paths named in the first column of the "Module map" table.

    The table's conventions: a row ``| **package/** | |`` starts that package's rows; a name is relative to
    the current package (``model/lev.py`` under **leviathan_pretrain/**) unless it starts with a top-level
    package (``launchers/local.py``); in a row naming several modules (``model/head.py``, ``loss.py``) a name
    without a directory is in the directory of the row's first name."""
    named: set[str] = set()
    package = ""
    for line in section(text, "Module map").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.lstrip().startswith("|") or not cells:
            continue
        heading = re.fullmatch(r"\*\*([\w/]+/)\*\*", cells[0])
        if heading:
            package = heading.group(1)
            continue
        row_dir = None
        for name in re.findall(r"`([^`]+\.py)`", cells[0]):
            if name.split("/")[0] in PACKAGES:
                path = name
            elif "/" in name or row_dir is None:
                path = package + name
            else:
                path = row_dir + name
            if row_dir is None:
                row_dir = path.rpartition("/")[0] + "/"
            named.add(path)
    return named


def test_module_map_names_every_module():
    named = module_map(ARCHITECTURE.read_text())
    missing = sorted(modules_on_disk(*PACKAGES) - named)
    assert not missing, (
        "docs/architecture.md's 'Module map' table does not name these modules; add them to the table "
        "(module column, backticked, relative to their package's **heading** row) with what each owns:\n  "
        + "\n  ".join(missing)
    )


def test_module_map_names_only_modules_that_exist():
    named = module_map(ARCHITECTURE.read_text())
    stale = sorted(p for p in named if not (REPO / p).is_file())
    assert not stale, "docs/architecture.md's 'Module map' names modules that do not exist:\n  " + "\n  ".join(stale)


def test_trainer_package_docstring_lists_every_trainer_module():
    doc = ast.get_docstring(ast.parse((TRAINER / "__init__.py").read_text())) or ""
    listed = set(re.findall(r":mod:`\.(\w+)`", doc))
    present = {p.stem for p in TRAINER.glob("*.py") if p.name != "__init__.py"}
    missing = sorted(present - listed)
    assert not missing, (
        "leviathan_pretrain/trainer/__init__.py's docstring does not list these trainer modules; add a "
        "':mod:`.name`  what it owns' line for each: " + ", ".join(missing)
    )
    stale = sorted(listed - present)
    assert not stale, f"leviathan_pretrain/trainer/__init__.py's docstring lists modules that do not exist: {stale}"
