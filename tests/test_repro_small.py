"""``benchmarks/repro_small.sh --dry``: the small study end to end (corpus -> tokenizer -> per-source shards -> 11 of
its runs (``--runs``: every variant, both second seeds, and one run of each kind that the page and the records treat
apart: LEV's sizes, LEV's centring + matched init, another depth), two steps each, through ``launchers.slurm sweep``/
``submit`` on the test SLURM cluster -> evaluate -> compare -> each run's record), a second invocation that finds
everything done and redoes nothing, and a third into a new directory that rebuilds the same comparison and page from
the records alone. (The study's other runs differ from these by overrides only, each passed the same way: a learning
rate multiplier's effect is tests/test_lr_mult.py's; ``--dry`` gives the long runs the same two steps.)"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import zstandard

from tests.conftest import build_once
from tests.multiproc import REPO, base_env

pytestmark = pytest.mark.multiproc
SWEEP = [f"sweep/tiny-cpu-{v}" for v in ("tied", "untied", "albert", "lev", "flat_mlp", "factored_mlp")]
ONLY = [*SWEEP, "tied-seed2", "lev-seed2", "lev-spec", "lev-center-match", "lev-iso"]
SELECT = ("--runs", " ".join(ONLY))
RUNS = len(ONLY)  # 11 (of the study's 21: the two-step runs check the pipeline, not the model)
TRAIN_DOCS = 300  # the study's corpus: make_corpus's first 300 training documents (4.5 MB, every source)


@pytest.fixture(scope="module")
def study_corpus(minipile_dir, test_cache):
    """make_corpus's corpus with its training split cut to its first :data:`TRAIN_DOCS` documents (the sources come
    interleaved: 32 PythonDocs, 168 Dictionary, 100 Github), validation and test whole: the dry study's tokenizer
    samples 2 MB either way, and its per-source shards take seconds instead of the minutes the 84 MB split took
    (tokenizing --split-by-set is checked on its own in test_data_prep_options.py and test_data_prep_megatron.py)."""

    def build(tmp):
        (tmp / "train").mkdir()
        with open(minipile_dir / "train" / "00.jsonl.zst", "rb") as f:
            lines = zstandard.ZstdDecompressor().stream_reader(f).read().split(b"\n")
        head = b"".join(line + b"\n" for line in [x for x in lines if x][:TRAIN_DOCS])
        (tmp / "train" / "00.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(head))
        for name in ("val.jsonl.zst", "test.jsonl.zst", ".data_prep-corpus.json"):
            shutil.copyfile(minipile_dir / name, tmp / name)

    return build_once(test_cache, f"study-corpus-{TRAIN_DOCS}-{minipile_dir.name}", build)


def repro(out, corpus, records, timeout=1200, select=SELECT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            "bash",
            "benchmarks/repro_small.sh",
            "--dry",
            "--out",
            str(out),
            "--corpus",
            str(corpus),
            "--records",
            str(records),
            *select,
        ],  # fmt: skip
        cwd=REPO,
        env=base_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(1800)  # its commands have their own timeouts (1200 + 300 + 2 x 300 s)
def test_dry_study_through_the_slurm_sweep(slurm_cluster, study_corpus, tmp_path):
    out, records = tmp_path / "study", tmp_path / "records"
    p = repro(out, study_corpus, records)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "launcher: SLURM" in p.stdout and "the variants' sweep" in p.stdout
    rows = list(csv.DictReader(open(out / "compare" / "comparison.csv")))
    assert len(rows) == RUNS
    variants = sorted({r["variant"] for r in rows})
    assert variants == ["albert", "factored_mlp", "flat_mlp", "lev", "tied", "untied"]
    for name in ("sweep/tiny-cpu-lev", "lev-spec", "tied-seed2"):
        run = out / "runs" / name
        report = json.loads((run / "eval" / "global_step2.json").read_text())
        assert report["heldout"][0]["tokens"] > 0 and report["frequency"]["buckets"]
        assert (run / "slurm" / "jobs.jsonl").is_file()  # trained through the launcher
    cfg = json.loads((out / "runs" / "tied-seed2" / "checkpoints" / "global_step2" / "leviathan.json").read_text())
    assert cfg["config"]["train"]["seed"] == 1235
    spec = json.loads((out / "runs" / "lev-spec" / "checkpoints" / "global_step2" / "leviathan.json").read_text())
    assert spec["config"]["model"]["lev"]["seed_dim"] == 128 and spec["config"]["model"]["lev"]["rank"] == 64
    lev = json.loads(
        (out / "runs" / "lev-center-match" / "checkpoints" / "global_step2" / "leviathan.json").read_text()
    )
    assert lev["config"]["model"]["lev"]["center"] is True and lev["config"]["model"]["lev"]["out_init_std"] == "match"
    iso = json.loads((out / "runs" / "lev-iso" / "checkpoints" / "global_step2" / "leviathan.json").read_text())
    assert iso["config"]["model"]["num_layers"] == 9 and iso["config"]["model"]["variant"] == "lev"
    totals = {r["run"]: int(r["total_params"]) for r in rows}  # equal to UNTIED's at the study's vocabulary
    assert abs(totals["lev-iso"] / totals["tiny-cpu-untied"] - 1) < 0.025, totals
    prefixes = cfg["config"]["data"]["prefixes"]
    assert sorted(p.rsplit(".", 1)[1] for p in prefixes) == ["Dictionary", "Github", "PythonDocs"]  # per source
    for png in ("val_loss_vs_tokens.png", "ppl_by_frequency.png"):
        assert (out / "compare" / png).stat().st_size > 1000
    timings = (out / "timings.tsv").read_text().splitlines()
    # the results page from it: every run with its times, the table, the spread, the plots; the reading is kept
    doc, figures = tmp_path / "docs" / "results-small.md", tmp_path / "results" / "small" / "figures"
    rel = os.path.relpath(out, REPO)  # a relative --study: the page names the reports from it
    results = [sys.executable, "benchmarks/results_small.py", "--study", rel, "--out", str(doc),
               "--figures", str(figures)]  # fmt: skip
    subprocess.run(results, cwd=REPO, env=base_env(), check=True, capture_output=True, timeout=300)
    text = doc.read_text()
    run_rows = [x for x in text.splitlines() if x.startswith("| ") and x.split(" | ")[1] in ("tied", "lev", "albert",
                "untied", "flat_mlp", "factored_mlp") and " min | " in x]  # fmt: skip
    assert len(run_rows) == RUNS, text
    assert f"Trained through SLURM: {RUNS}-runs" in text and "| lev-seed2 vs sweep/tiny-cpu-lev |" in text
    assert "WikiText word ppl | unseen |" in text
    machine = re.search(r"^Machine \(every run trained on it\): \d+ cores \(.*, torch .*, no GPU\.$", text, re.M)
    assert machine, text[:2000]  # each run's training log names its machine; all trained on this one
    # the LEV section: every LEV run (6 here) against TIED and LEV, geometry at init from the log's step 0
    lev = text.split("## LEV without its common mode", 1)[1].split("\n## ", 1)[0]
    rows = [x for x in lev.splitlines() if x.startswith("| ") and " -> " in x and not x.startswith("| run |")]
    rows = {x.split(" | ")[0][2:]: x for x in rows}  # run -> its row
    assert sorted(rows) == sorted(n for n in ONLY if n.startswith("lev") or n == "sweep/tiny-cpu-lev"), lev
    assert "centred, W_out init match | 4 |" in rows["lev-center-match"] and "(sweep/tiny-cpu-lev)" in rows["lev-iso"]
    assert "(sweep/tiny-cpu-untied)" in rows["lev-iso"] and "| 9 |" in rows["lev-iso"]
    assert re.search(r"\| \d\.\d{3} -> \d\.\d{3} \|", rows["lev-spec"]), lev
    assert "Seed spread (seed 1235 vs 1234, the same data order): tiny-cpu-tied val ppl " in lev
    assert "; tiny-cpu-lev val ppl " in lev
    # the reports are named from --study as given; the machine's absolute path stands nowhere (a relative --study
    # that climbs to / ends in that path, so it counts only where no '.' of a '../' stands before it)
    assert f"- tiny-cpu-lev: {rel}/runs/sweep/tiny-cpu-lev/eval/global_step2.json" in text, text
    assert not re.search(r"(?<!\.)" + re.escape(str(out.resolve())), text), text
    assert (figures / "ppl_by_frequency.png").stat().st_size > 1000  # the plots are run data, outside docs/
    assert "![ppl_by_frequency](../results/small/figures/ppl_by_frequency.png)" in text  # linked from the page
    doc.write_text(text.replace("(to be written by hand from the numbers above)", "LEV reads as it reads."))
    subprocess.run(results, cwd=REPO, env=base_env(), check=True, capture_output=True, timeout=300)
    assert doc.read_text().rstrip().endswith("LEV reads as it reads.")
    # resumable: the same command again trains and evaluates nothing
    p = repro(out, study_corpus, records, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("steps), skipped") == RUNS and "evaluating" not in p.stdout, p.stdout
    assert (out / "timings.tsv").read_text().splitlines() == timings
    # the study directory gone (a new machine): its runs' records rebuild the same comparison, training nothing
    assert sorted(str(m.parent.relative_to(records)) for m in records.glob("**/record.json")) == sorted(ONLY)
    fresh = tmp_path / "study-again"
    p = repro(fresh, study_corpus, records, timeout=300, select=("--only-recorded",))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("restored from its record") == RUNS and "training (" not in p.stdout
    assert "evaluating" not in p.stdout and not list(fresh.glob("runs/**/checkpoints"))
    first, again = (list(csv.DictReader(open(s / "compare" / "comparison.csv"))) for s in (out, fresh))
    assert len(again) == RUNS and [{k: v for k, v in r.items() if k not in ("path", "report")} for r in again] == [
        {k: v for k, v in r.items() if k not in ("path", "report")} for r in first
    ]
    page = tmp_path / "docs" / "results-small-again.md"
    cmd = [sys.executable, "benchmarks/results_small.py", "--study", str(fresh), "--out", str(page)]
    subprocess.run([*cmd, "--records", str(records)], cwd=REPO, env=base_env(), check=True, capture_output=True,
                   timeout=300)  # fmt: skip
    again_text = page.read_text()
    assert len([x for x in again_text.splitlines() if x in run_rows]) == RUNS  # shapes, params, times
    assert machine.group(0) in again_text.splitlines()  # the machine they trained on, from the records
    # each report is named by its record's copy, the file a reader of the repository opens
    assert f"- tiny-cpu-lev: {records}/sweep/tiny-cpu-lev/eval/global_step2.json" in again_text, again_text


def test_help_is_the_whole_header():
    """``--help`` prints the script's header comment whole (a fixed line range once cut its last lines off)."""
    p = subprocess.run(["bash", "benchmarks/repro_small.sh", "--help"], cwd=REPO, capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    header = []
    for line in (REPO / "benchmarks" / "repro_small.sh").read_text().splitlines()[1:]:
        if not line.startswith("#"):
            break
        header.append(re.sub(r"^# ?", "", line))
    assert p.returncode == 0 and p.stdout.splitlines() == header and "--dry: two steps per run" in p.stdout
