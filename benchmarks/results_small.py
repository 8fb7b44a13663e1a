"""Write docs/results-small.md from a finished ``benchmarks/repro_small.sh`` study (nothing typed but the reading).

    python benchmarks/results_small.py [--study runs/repro-small] [--out docs/results-small.md]
                                       [--records results/small/runs] [--figures results/small/figures]

Takes the compare table (``STUDY/compare/comparison.md``) as it is, copies its PNGs to ``results/small/figures/``
(run data, beside the records; the page links them by relative path), and adds the machine(s) the runs trained on
(their training logs name it), the exact commands, each run's shape, tokens and times, and the seed-to-seed spread
of TIED and LEV next to each LEV-vs-TIED gap. A run's times: its training steps' own time (``step_time_s`` in its
``train_log.jsonl``, the last record of each step when it was resumed), its median step, and the launcher's wall
time (``STUDY/timings.tsv``, summed over the segments it recorded; a segment killed with the machine is not there,
and runs trained through SLURM have one wall time for all).
The "Reading" section is kept from an existing ``--out`` file (the only hand-written part); a new file gets a
placeholder there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from results_small_lev import PAIRS, pct  # benchmarks/, this script's directory
from results_small_lev import section as lev_section

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "results-small.md"  # prose a reader opens
RECORDS = REPO / "results" / "small" / "runs"  # run data (results/README.md)
FIGURES = REPO / "results" / "small" / "figures"
READING = "## Reading"
PLACEHOLDER = "(to be written by hand from the numbers above)"


def report(study: Path, name: str) -> dict | None:
    reports = sorted((study / "runs" / name / "eval").glob("global_step*.json"), key=lambda p: int(p.stem[11:]))
    return json.loads(reports[-1].read_text()) if reports else None


def run_machines(study: Path, names) -> dict[str, list[str]]:
    """Run -> the machines it trained on: its training log's (each segment's), else its record's ``machine`` (the
    runs recorded before the trainer wrote it in the log: set with the evidence, study_records.py), else none."""
    from leviathan_pretrain.rundir.train_log import LOG_NAME, machines

    out = {}
    for name in names:
        run = study / "runs" / name
        found = machines(run / LOG_NAME) if (run / LOG_NAME).is_file() else []
        if not found and (run / "record.json").is_file():
            recorded = json.loads((run / "record.json").read_text()).get("machine")
            found = [recorded] if isinstance(recorded, str) else []
        out[name] = found
    return out


def machine_lines(by_run: dict[str, list[str]]) -> list[str]:
    """The page's machine line(s): one when every run trained on one machine, else each machine with its runs (the
    times of runs on different machines do not compare)."""
    known = list(dict.fromkeys(m for ms in by_run.values() for m in ms))
    unknown = [n for n, ms in by_run.items() if not ms]
    if len(known) == 1 and not unknown:
        return [f"Machine (every run trained on it): {known[0]}."]
    lines = ["Machines the runs trained on (their times compare only on one machine):", ""]
    lines += [f"- {m}: {', '.join(n for n, ms in by_run.items() if m in ms)}" for m in known]
    return lines + ([f"- not recorded: {', '.join(unknown)}"] if unknown else [])


def wall_times(study: Path) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    tsv = study / "timings.tsv"
    for line in tsv.read_text().splitlines() if tsv.is_file() else []:
        _, phase, name, seconds = line.split("\t")
        out[name][phase] += int(seconds)
    return out


def run_names(study: Path) -> list[str]:
    """The study's runs (directories with a training log): the variants' sweep first, then the rest by name."""
    names = [str(p.parent.relative_to(study / "runs")) for p in (study / "runs").glob("**/train_log.jsonl")]
    return sorted(names, key=lambda n: (not n.startswith("sweep/"), n))


def step_times(run: Path) -> tuple[float, float]:
    """(sum, median) of the training steps' ``step_time_s``; a step trained twice (resumed) counts its last time."""
    from leviathan_pretrain.rundir.train_log import LOG_NAME, read_log_values

    (points,) = read_log_values(run / LOG_NAME, "step_time_s")
    times = sorted(t for _, t in points)
    return (sum(times), times[len(times) // 2]) if times else (0.0, 0.0)


def run_config(run: Path):
    """The run's config as its latest checkpoint recorded it, else as its ``config.json`` has it (a run restored from
    its record, benchmarks/study_records.py, has no checkpoints); ``None`` when neither is there."""
    from leviathan_pretrain.evaluation.load import EvalError, checkpoint_location, saved_config, select_tag
    from leviathan_pretrain.trainer.checkpoint.record import CheckpointRecord

    try:
        ckpt_dir = checkpoint_location(run)
        tag_dir = ckpt_dir / select_tag(ckpt_dir)
    except EvalError:
        if not (run / "config.json").is_file():
            return None
        record = CheckpointRecord(config=json.loads((run / "config.json").read_text()), step=0, consumed_samples=0)
        return saved_config(record, run / "config.json")
    return saved_config(CheckpointRecord.read(tag_dir), tag_dir)


def input_shape(m) -> str:
    """The input layer's sizes, as the model builds them."""
    from leviathan_pretrain.model import variants

    return variants.get(m.variant).describe(m)


def body(cfg) -> str:
    m, t, o = cfg.model, cfg.train, cfg.optim
    ffn = m.ffn_hidden_size or "default"
    return (
        f"Body (every run): {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, FFN {ffn}, "
        f"sequence {m.seq_length}, vocabulary {m.vocab_size}; batch {t.global_batch_size} x {m.seq_length} tokens "
        f"(micro-batch {t.micro_batch_size} per rank), {cfg.parallel.precision}; AdamW lr {o.lr:g} -> {o.min_lr:g} "
        f"({o.decay_style}, {o.warmup_steps} warm-up steps), weight decay {o.weight_decay:g}, clip {o.clip_grad:g}."
    )


def spread(reports: dict) -> list[str]:
    """Seed-to-seed differences of val ppl and each bucket's ppl (relative) of each pair of :data:`PAIRS` in
    ``reports`` (run name -> its evaluation report)."""
    rows = []
    for a, b in PAIRS:
        ra, rb = reports.get(a), reports.get(b)
        if not (ra and rb):
            continue
        wa, wb = ra.get("wikitext") or {}, rb.get("wikitext") or {}
        cells = [pct(rb["heldout"][0]["ppl"], ra["heldout"][0]["ppl"]), pct(wb.get("word_ppl"), wa.get("word_ppl"))]
        cells += [pct(y["ppl"], x["ppl"]) for x, y in zip(ra["frequency"]["buckets"], rb["frequency"]["buckets"])]
        rows.append(f"| {b} vs {a} | " + " | ".join(cells) + " |")
    if rows:
        names = [b["name"] for b in reports[PAIRS[0][0]]["frequency"]["buckets"]]
        head = "| seed 1235 vs seed 1234 | val ppl | WikiText word ppl | " + " | ".join(names) + " |"
        rows = [head, "|" + " --- |" * (len(names) + 3), *rows]
    return rows


def name_records(text: str, study: Path, shown: str, names, records: Path) -> str:
    """``text`` with each report path under the study (as ``shown``) replaced by its record's copy in ``records``
    (benchmarks/study_records.py), where that copy is the same file: the path a reader of the repository can open."""
    for name in names:
        for rep in sorted((study / "runs" / name / "eval").glob("*.json")):
            rec = records / name / "eval" / rep.name
            if rec.is_file() and rec.read_bytes() == rep.read_bytes():
                where = os.path.relpath(rec.resolve(), REPO) if rec.resolve().is_relative_to(REPO) else str(rec)
                text = text.replace(f"{shown}/runs/{name}/eval/{rep.name}", where)
    return text


def head_commit() -> str:
    """The repository's checked-out commit, short (the page says which code wrote it)."""
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--study", default="runs/repro-small", help="the study directory (repro_small.sh --out)")
    ap.add_argument("--out", default=str(PAGE))
    ap.add_argument(
        "--records",
        default=str(RECORDS),
        help="the runs' records (repro_small.sh --records): a report is named by its record's copy",
    )
    ap.add_argument(
        "--figures",
        help="where the plots are copied, linked from the page by relative path (default: results/small/figures for "
        "the repository's page, else figures/ beside --out)",
    )
    ns = ap.parse_args(argv)
    study, out = Path(ns.study), Path(ns.out)
    table = study / "compare" / "comparison.md"
    if not table.is_file():
        print(f"error: {table} not found: run benchmarks/repro_small.sh first", file=sys.stderr)
        return 2
    if ns.figures:
        figs = Path(ns.figures)
    else:
        figs = FIGURES if out.resolve() == PAGE.resolve() else out.parent / "figures"
    out.parent.mkdir(parents=True, exist_ok=True)
    figs.mkdir(parents=True, exist_ok=True)
    pngs = []
    for png in sorted((study / "compare").glob("*.png")):
        shutil.copyfile(png, figs / png.name)
        link = Path(os.path.relpath((figs / png.name).resolve(), out.parent.resolve())).as_posix()
        pngs.append(f"![{png.stem}]({link})")
    reading = PLACEHOLDER
    if out.is_file() and READING in out.read_text():
        reading = out.read_text().split(READING, 1)[1].strip()
    times = wall_times(study)
    lines = ["| run | variant | input layer | params | input params | tokens | steps' time | median step "
             "| launcher wall time | eval wall time |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    configs = {name: run_config(study / "runs" / name) for name in run_names(study)}
    reports = {name: r for name in configs if (r := report(study, name))}  # read once, for every table below
    for name, cfg in configs.items():
        r = reports.get(name, {})
        shape = input_shape(cfg.model) if cfg else "?"
        p, t = r.get("params", {}), times.get(name, {})
        total, inp = p.get("total", 0) / 1e6, p.get("input_layer", 0) / 1e6
        steps, median = step_times(study / "runs" / name)
        wall = f"{t['train'] / 60:.1f} min" if t.get("train") else "-"
        lines.append(
            f"| {name} | {r.get('variant', '?')} | {shape} | {total:.3f}M | {inp:.3f}M | {r.get('tokens_seen', 0):,} | "
            f"{steps / 60:.1f} min | {median:.2f} s | {wall} | {t.get('eval', 0) / 60:.1f} min |"
        )
    slurm = {n: t["train"] for n, t in times.items() if n.startswith("slurm:")}
    lines += [f"\nTrained through SLURM: {n[6:]} in {s / 60:.1f} min of wall time." for n, s in slurm.items()]
    commit = head_commit()
    doc = [
        "# A small-scale reproduction of the paper's comparison",
        "",
        f"Produced by `bash benchmarks/repro_small.sh` (commit {commit.strip()}) and written by "
        "`python benchmarks/results_small.py`; nothing below is typed by hand except the Reading.",
        "",
        *machine_lines(run_machines(study, configs)),
        "",
        "## Commands",
        "",
        "```bash",
        "bash benchmarks/repro_small.sh                    # data, the runs, evaluate, compare, records (resumable)",
        "bash benchmarks/repro_small.sh --only-recorded    # the recorded runs restored, compared; nothing trained",
        "python benchmarks/results_small.py                # this page",
        "```",
        "",
        "The settings (body, steps, data) are at the top of `benchmarks/repro_small.sh`. Each run's record (its "
        "resolved config, training log, evaluation report and times; `benchmarks/study_records.py`) is in "
        "`results/small/runs/<run>/`: the tables below can be rebuilt from them without training.",
        "",
        "## Runs",
        "",
        next((body(c) for c in configs.values() if c), ""),
        "",
        *lines,
        "",
        "## The comparison (`python -m leviathan_pretrain.compare`)",
        "",
        name_records(
            table.read_text().split("\n", 1)[1].strip().replace(f"{study.resolve()}/", f"{ns.study}/"),
            study,
            ns.study,
            configs,
            Path(ns.records),
        ),
        "",
        "## Seed-to-seed spread",
        "",
        *(spread(reports) or ["(the second-seed runs are not finished)"]),
        "",
        *lev_section(study, reports, configs),
        "",
        "## Plots",
        "",
        *pngs,
        "",
        READING,
        "",
        reading,
        "",
    ]
    out.write_text("\n".join(doc))
    print(f"wrote {out} and {len(pngs)} plot(s) in {figs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
