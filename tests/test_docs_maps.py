"""The maps of the code stay true: docs/architecture.md's module map and each package's ``__init__`` docstring.

Both are read as text (no import of the product, no torch): a new module fails here until it is named.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("common", "data_prep", "leviathan_pretrain", "launchers")  # the top-level packages the module map covers
ARCHITECTURE = REPO / "docs/architecture.md"


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


def packages_with_maps() -> list[Path]:
    """The packages whose ``__init__`` docstring maps their modules: every package below a top-level one, and
    ``common`` (data_prep's and the launchers' maps are docs/architecture.md's table)."""
    found = [REPO / "common"]
    for top in ("leviathan_pretrain", "data_prep", "launchers"):
        found += sorted(p.parent for p in (REPO / top).rglob("*/__init__.py") if "__pycache__" not in p.parts)
    return found


def test_every_package_docstring_lists_its_modules():
    problems = []
    for package in packages_with_maps():
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        listed = set(re.findall(r":mod:`\.(\w+)`", doc))
        present = {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}
        present |= {p.parent.name for p in package.glob("*/__init__.py")}  # its subpackages
        name = package.relative_to(REPO).as_posix()
        if present - listed:
            problems.append(f"{name}/__init__.py does not list {sorted(present - listed)}")
        if listed - present:
            problems.append(f"{name}/__init__.py lists modules that do not exist: {sorted(listed - present)}")
    assert not problems, (
        "a package's docstring is its map (':mod:`.name`  what it owns', one line a module):\n  "
        + "\n  ".join(problems)
    )


def test_a_package_init_is_its_map_and_no_code():
    """Code lives in modules named for it; an ``__init__`` holds the package's docstring, except the two package
    APIs docs/architecture.md names (and data_prep's ``__version__``, and leviathan_pretrain's installing of
    model/deferred_compile.py, which must run before any of its modules imports megatron-core)."""
    allowed = {"leviathan_pretrain/config", "data_prep/tokenizer", "data_prep", "leviathan_pretrain"}
    coded = []
    for init in sorted(p for top in PACKAGES for p in (REPO / top).rglob("__init__.py")):
        package = init.parent.relative_to(REPO).as_posix()
        if package in allowed:
            continue
        body = [n for n in ast.parse(init.read_text()).body if not isinstance(n, ast.Expr)]
        if body:
            coded.append(package)
    assert not coded, f"these packages' __init__.py hold code: move it into a module named for it: {coded}"
