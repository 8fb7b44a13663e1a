"""The two test tiers (``make test-fast``, ``make test-integration``; ``make test`` runs both, fast first).

- **fast**: in-process unit tests: no subprocess, no corpus or tokenizer built, no training run; seconds each.
- **integration** (marker ``integration``, set here at collection): multi-process (``multiproc``), SLURM, training
  runs, the command-line tools run as processes, and everything using a built corpus/tokenizer fixture.

A test is integration when it is marked ``multiproc`` (or ``integration`` by hand), uses one of
:data:`BUILT_FIXTURES`, or its file calls one of :data:`PROCESS_HELPERS`. The fast tier keeps the rule true:
there, starting a subprocess fails the test with the reason (:func:`forbid_subprocesses`), so a test that needs
one must be classified integration.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from pathlib import Path

import pytest

FAST = "fast"
BUILT_FIXTURES = frozenset(
    {
        "run_cli",
        "tokenize",
        "minipile_dir",
        "tokenizer_model",
        "tokenizer_model_200k",
        "bpe_tokenizer_json",
        "big_tiktoken",
        "minipile_shards",
        "slurm_cluster",
        "trained_run",
    }
)
# helpers that start processes (tests/multiproc.py, conftest.py, trained.py, compare_runs.py, workers/train_common.py),
# subprocess
PROCESS_HELPERS = re.compile(
    r"\b(run_python|run_ranks|run_module|run_tokenize|subprocess|Popen|dp_tp_runs)\b"
    r"|\bshard\(\)|tests(\.| import )(trained|compare_runs)\b"
)


@functools.cache
def _calls_processes(path: str) -> bool:
    return bool(PROCESS_HELPERS.search(Path(path).read_text()))


def is_integration(item) -> bool:
    return (
        item.get_closest_marker("multiproc") is not None
        or item.get_closest_marker("integration") is not None  # marked by hand (e.g. DeepSpeed's op checks run gcc)
        or bool(BUILT_FIXTURES.intersection(item.fixturenames))
        or _calls_processes(str(item.path))
    )


def mark(items) -> None:
    for item in items:
        if is_integration(item):
            item.add_marker(pytest.mark.integration)


def fast_tier() -> bool:
    return os.environ.get("LEVIATHAN_TEST_TIER") == FAST


def forbid_subprocesses(monkeypatch) -> None:
    """In the fast tier: ``subprocess.Popen`` fails the test, naming the rule."""
    real = subprocess.Popen.__init__

    def refuse(self, args, *a, **kw):
        monkeypatch.setattr(subprocess.Popen, "__init__", real)  # pytest's own reporting may need it
        pytest.fail(
            f"the fast tier starts no subprocess, and this test ran {args!r}: it is an integration test "
            "(tests/tiers.py: mark it multiproc, or use a process helper or built fixture it already needs)",
            pytrace=True,
        )

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
