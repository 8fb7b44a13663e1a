"""A study run's record: the few files its results page is made of, kept in the repository so that a study spread
over several work periods (each on a fresh machine, where the study directory does not survive) loses no run.
The small study's records are ``results/small/runs/`` (``benchmarks/repro_small.sh``'s default ``--records``).

    python benchmarks/study_records.py save    --run RUN --records DIR --name NAME --spec SPEC [--timings TSV]
    python benchmarks/study_records.py restore --run RUN --records DIR --name NAME --spec SPEC [--timings TSV]
    python benchmarks/study_records.py list    --records DIR

A record (``DIR/NAME/``) holds the run's ``config.json`` (the resolved config), ``train_log.jsonl`` (its curves and
input-row geometry), its latest evaluation report (``eval/global_stepN.json``), and ``record.json``: the run's line
of the study's settings (SPEC: ``name|config|steps|overrides``), the commit of the code that saved it (the one that
trained it unless the code moved on between), and its lines of the study's ``timings.tsv``. That is what
``python -m leviathan_pretrain.compare`` and ``benchmarks/results_small.py`` read; checkpoints are not kept
(``evaluate`` needs them; the report it wrote is the record).

A record of a run trained before the trainer named its machine in the training log (2026-12-05) may carry
``machine`` in ``record.json``, set by hand with the evidence in its commit; results_small.py reads it for that run.

``save`` leaves a record of the same run (same SPEC and files) as it is; else it writes the record under a
temporary name and renames it into place (a record it replaces is one this script wrote: it carries
``record.json`` and no other file).
``restore`` copies a record into a run directory that has no training log yet, appends its timings to TSV, and exits
0; it exits 3 when there is no record and 4, saying why, when the record was made with other settings (SPEC
differs) or the run directory is already started: both mean "train it".
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

META = "record.json"
FILES = ("config.json", "train_log.jsonl")
NO_RECORD, NOT_USED = 3, 4


def latest_report(run: Path) -> Path | None:
    reports = [p for p in (run / "eval").glob("global_step*.json") if p.stem[11:].isdigit()]
    return max(reports, key=lambda p: int(p.stem[11:]), default=None)


def commit() -> str:
    p = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parents[1],
                       capture_output=True, text=True)  # fmt: skip
    return p.stdout.strip() or "unknown"


def timing_lines(tsv: Path | None, name: str) -> list[str]:
    """The lines of ``timings.tsv`` (time, phase, name, seconds) that are this run's."""
    if tsv is None or not tsv.is_file():
        return []
    return [x for x in tsv.read_text().splitlines() if x.split("\t")[2:3] == [name]]


def same(a: Path, b: Path) -> bool:
    return b.is_file() and a.read_bytes() == b.read_bytes()


def save(run: Path, records: Path, name: str, spec: str, tsv: Path | None, code: str = "unknown") -> Path:
    """The record of ``run`` in ``records/name`` (``code``: the commit it names)."""
    report = latest_report(run)
    missing = [f for f in FILES if not (run / f).is_file()] + ([] if report else ["eval/global_step*.json"])
    if missing:
        raise SystemExit(f"error: {run}: no {', '.join(missing)}: a record is made of a trained and evaluated run")
    dest = records / name
    if dest.exists() and not (dest / META).is_file():
        raise SystemExit(f"error: {dest} exists and is not a record ({META} missing): move it away first")
    if dest.exists():  # replaced whole below: only what this script wrote may be in it
        ours = {*FILES, META, "eval", json.loads((dest / META).read_text()).get("report")}
        other = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if str(p.relative_to(dest)) not in ours)
        if other:
            raise SystemExit(f"error: {dest} holds files not its record's ({', '.join(other)}): move them away")
    if (
        (dest / META).is_file()
        and json.loads((dest / META).read_text()).get("spec") == spec
        and all(same(a, b) for a, b in [(run / f, dest / f) for f in FILES] + [(report, dest / "eval" / report.name)])
    ):
        return dest  # this very run is recorded already (the next study call saves it again)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        for f in FILES:
            shutil.copyfile(run / f, tmp / f)
        (tmp / "eval").mkdir()
        shutil.copyfile(report, tmp / "eval" / report.name)
        meta = {
            "name": name,
            "spec": spec,
            "commit": code,
            "report": f"eval/{report.name}",
            "saved": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "timings": timing_lines(tsv, name),
        }
        (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
        if dest.exists():  # ours (checked above): replaced by the new record
            old = dest.with_name(f".{dest.name}.old-{meta['saved']}")
            dest.rename(old)
            tmp.rename(dest)
            shutil.rmtree(old)
        else:
            tmp.rename(dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return dest


def restore(run: Path, records: Path, name: str, spec: str, tsv: Path | None) -> int:
    src = records / name
    if not (src / META).is_file():
        return NO_RECORD
    meta = json.loads((src / META).read_text())
    if meta.get("spec") != spec:
        print(f"{name}: the record in {src} was made with other settings ({meta.get('spec')!r}, now {spec!r}): "
              "trained again", file=sys.stderr)  # fmt: skip
        return NOT_USED
    if (run / "train_log.jsonl").exists():
        print(f"{name}: {run} is already started: trained on, its record in {src} not used", file=sys.stderr)
        return NOT_USED
    (run / "eval").mkdir(parents=True, exist_ok=True)
    for f in (*FILES, meta["report"]):
        shutil.copyfile(src / f, run / f)
    shutil.copyfile(src / META, run / META)
    if tsv is not None and meta.get("timings"):
        with open(tsv, "a") as fh:
            fh.write("".join(f"{x}\n" for x in meta["timings"]))
    print(f"{name}: restored from its record {src} (recorded at commit {meta.get('commit')}, {meta.get('saved')})")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=("save", "restore", "list"))
    ap.add_argument("--records", required=True, type=Path, help="the records' directory")
    ap.add_argument("--run", type=Path, help="the run directory (save, restore)")
    ap.add_argument("--name", help="the run's name in the study (e.g. sweep/tiny-cpu-tied)")
    ap.add_argument("--spec", help="the run's line of the study's settings: name|config|steps|overrides")
    ap.add_argument("--timings", type=Path, help="the study's timings.tsv (save: read; restore: appended to)")
    ns = ap.parse_args(argv)
    if ns.action == "list":
        for meta in sorted(ns.records.glob(f"**/{META}")):
            m = json.loads(meta.read_text())
            print(f"{m['name']}\t{m['commit']}\t{m['saved']}\t{m['spec']}")
        return 0
    if not (ns.run and ns.name and ns.spec is not None):
        ap.error(f"{ns.action} needs --run, --name and --spec")
    if ns.action == "save":
        print(f"{ns.name}: recorded in {save(ns.run, ns.records, ns.name, ns.spec, ns.timings, commit())}")
        return 0
    return restore(ns.run, ns.records, ns.name, ns.spec, ns.timings)


if __name__ == "__main__":
    sys.exit(main())
