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
import sys
from pathlib import Path


def record(path: str, tier: str, worker: str, report) -> None:
    """Append ``report``'s phase (a pytest TestReport; conftest puts its CPU seconds in ``user_properties``)."""
    cpu = dict(tuple(p) for p in report.user_properties).get("cpu_s", "")
    with open(path, "a") as f:
        f.write(f"{tier}\t{worker}\t{report.when}\t{report.duration:.2f}\t{cpu}\t{report.nodeid}\n")


def read(path: Path) -> list[tuple[str, str, str, float, float, str]]:
    """(tier, worker, phase, seconds, CPU seconds or 0.0, test id) per line."""
    rows = []
    for line in path.read_text().splitlines():
        parts = line.split("\t")
        if len(parts) == 6:
            tier, worker, when, seconds, cpu, nodeid = parts
            rows.append((tier, worker, when, float(seconds), float(cpu or 0), nodeid))
    return rows


def summary(rows, top: int = 30) -> str:
    tests, files, tiers, workers = ({} for _ in range(4))  # key -> [seconds, CPU seconds]
    for tier, worker, _when, seconds, cpu, nodeid in rows:
        name = nodeid.split("::", 1)[0]
        for table, key in ((tests, (tier, nodeid)), (files, (tier, name)), (tiers, tier), (workers, (tier, worker))):
            total = table.setdefault(key, [0.0, 0.0])
            total[0] += seconds
            total[1] += cpu
    out = [
        "[durations] summed test time per tier: "
        + ", ".join(f"{t} {s:.0f} s (CPU {c:.0f} s)" for t, (s, c) in tiers.items()),
        "[durations] CPU: the test process and the processes it waited for (a SLURM job's are not counted)",
    ]
    busy = [f"{t}/{w} {s:.0f} s" for (t, w), (s, _) in sorted(workers.items()) if w != "-"]
    if busy:
        out.append("[durations] busy time per xdist worker: " + ", ".join(busy))
    for what, table in (("tests (setup + call + teardown)", tests), ("files", files)):
        out.append(f"[durations] the {top} slowest {what}: seconds, CPU seconds")
        for (tier, name), (s, c) in sorted(table.items(), key=lambda kv: -kv[1][0])[:top]:
            out.append(f"  {s:8.1f} s {c:8.1f} s  {tier:<11} {name}")
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
