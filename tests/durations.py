"""Where the suite's time goes: every test's setup, call and teardown seconds, recorded by conftest's hooks into
``$LEVIATHAN_TEST_DURATIONS`` (a TSV, one line per phase: tier, worker, phase, seconds, test id; scripts/test.sh sets
it and truncates it first), and summarized at the end of ``make test`` (and so of CI's log)::

    python tests/durations.py FILE [--top N]

The summary: each tier's summed test time, the slowest tests (setup + call + teardown, so a module fixture such as
test_slurm's ``jobs`` counts in the test that built it), the slowest files, and each xdist worker's busy time (a
worker far above the others ends the run alone). pytest's own ``--durations=40`` list (pyproject.toml) stays in each
tier's output above it.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path


def record(path: str, tier: str, worker: str, report) -> None:
    """Append ``report``'s phase (a pytest TestReport) to ``path``."""
    with open(path, "a") as f:
        f.write(f"{tier}\t{worker}\t{report.when}\t{report.duration:.2f}\t{report.nodeid}\n")


def read(path: Path) -> list[tuple[str, str, str, float, str]]:
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) == 5:
            tier, worker, when, seconds, nodeid = parts
            rows.append((tier, worker, when, float(seconds), nodeid))
    return rows


def summary(rows, top: int = 30) -> str:
    tests = collections.defaultdict(float)
    files = collections.defaultdict(float)
    tiers = collections.defaultdict(float)
    workers = collections.defaultdict(float)
    for tier, worker, _when, seconds, nodeid in rows:
        tests[(tier, nodeid)] += seconds
        files[(tier, nodeid.split("::", 1)[0])] += seconds
        tiers[tier] += seconds
        workers[(tier, worker)] += seconds
    out = ["[durations] summed test time per tier: " + ", ".join(f"{t} {s:.0f} s" for t, s in tiers.items())]
    busy = [f"{t}/{w} {s:.0f} s" for (t, w), s in sorted(workers.items()) if w != "-"]
    if busy:
        out.append("[durations] busy time per xdist worker: " + ", ".join(busy))
    out.append(f"[durations] the {top} slowest tests (setup + call + teardown):")
    for (tier, nodeid), s in sorted(tests.items(), key=lambda kv: -kv[1])[:top]:
        out.append(f"  {s:8.1f} s  {tier:<11} {nodeid}")
    out.append(f"[durations] the {top} slowest files:")
    for (tier, name), s in sorted(files.items(), key=lambda kv: -kv[1])[:top]:
        out.append(f"  {s:8.1f} s  {tier:<11} {name}")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python tests/durations.py", description=__doc__.split("\n")[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args(argv)
    if not args.file.is_file():
        print(f"[durations] no record at {args.file}")
        return 0
    print(summary(read(args.file), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
