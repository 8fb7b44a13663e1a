"""The test processes share what they should: a test file that calls one of tests/workers/train_common.py's cached
launches (``functools.cache``: once per process) is in conftest's ``trainer`` group, so pytest-xdist runs it in the
process that already ran them; outside it, a second process would run the same trainings again (minutes of CI).

Read as text (no import of the product)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import GROUPS

TESTS = Path(__file__).resolve().parent


def cached_launches() -> set[str]:
    """The names of train_common's ``@functools.cache`` functions that launch trainings (``launch(...)``)."""
    tree = ast.parse((TESTS / "workers" / "train_common.py").read_text())
    out = set()
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        cached = any(ast.unparse(d) in ("functools.cache", "cache") for d in fn.decorator_list)
        launches = any(isinstance(n, ast.Call) and ast.unparse(n.func) == "launch" for n in ast.walk(fn))
        if cached and launches:
            out.add(fn.name)
    return out


def test_every_file_calling_a_cached_launch_is_in_the_trainer_group():
    names = cached_launches()
    assert {"single_process_runs", "pipe_runs", "four_process_runs"} <= names and len(names) >= 6, names
    calls = re.compile(r"\b(" + "|".join(sorted(names)) + r")\(")
    users = {p.name for p in TESTS.glob("test_*.py") if calls.search(p.read_text())}
    missing = sorted(users - set(GROUPS["trainer"]))
    assert not missing, f"add {missing} to GROUPS['trainer'] in tests/conftest.py: they call {sorted(names)}"
