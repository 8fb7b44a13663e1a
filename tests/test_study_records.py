"""benchmarks/study_records.py: a study run's record survives its study directory (save, restore, what it refuses)."""

from __future__ import annotations

import json
import re

import pytest

from tests import benchmark_scripts

SPEC = "lev-center|lev|720|model.lev.center=true"
NAME = "lev-center"


@pytest.fixture(scope="module")
def records():
    return benchmark_scripts.load("study_records")


def make_run(run, loss=3.5):
    (run / "eval").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"model": {"variant": "lev"}}))
    (run / "train_log.jsonl").write_text(json.dumps({"step": 0, "loss": loss}) + "\n")
    (run / "eval" / "global_step360.json").write_text('{"step": 360}')
    (run / "eval" / "global_step720.json").write_text('{"step": 720}')
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "big.pt").write_bytes(b"x" * 1000)


def tsv(path, *names):
    path.write_text("".join(f"2026-12-05T00:00:0{i}Z\ttrain\t{n}\t{100 + i}\n" for i, n in enumerate(names)))
    return path


def test_save_then_restore_gives_the_files_compare_reads(records, tmp_path):
    run, rec = tmp_path / "study" / "runs" / NAME, tmp_path / "records"
    make_run(run)
    timings = tsv(tmp_path / "timings.tsv", NAME, "lev-center-seed2", NAME)
    dest = records.save(run, rec, NAME, SPEC, timings, "abc1234")
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == [
        "config.json", "eval/global_step720.json", "record.json", "train_log.jsonl"]  # fmt: skip
    meta = json.loads((dest / "record.json").read_text())
    assert meta["spec"] == SPEC and meta["commit"] == "abc1234" and meta["report"] == "eval/global_step720.json"
    assert [x.split("\t")[3] for x in meta["timings"]] == ["100", "102"]  # this run's lines only
    assert not [p for p in rec.iterdir() if p.name.startswith(".")]  # no temporary left

    new = tmp_path / "study2" / "runs" / NAME
    out_tsv = tmp_path / "timings2.tsv"
    assert records.restore(new, rec, NAME, SPEC, out_tsv) == 0
    for f in ("config.json", "train_log.jsonl", "eval/global_step720.json"):
        assert (new / f).read_bytes() == (run / f).read_bytes()
    assert (new / "record.json").is_file() and not (new / "checkpoints").exists()
    assert out_tsv.read_text().splitlines() == meta["timings"]


def test_restore_refuses_other_settings_a_started_run_and_no_record(records, tmp_path, capsys):
    run, rec = tmp_path / "runs" / NAME, tmp_path / "records"
    make_run(run)
    records.save(run, rec, NAME, SPEC, None)
    other = tmp_path / "other" / NAME
    assert records.restore(other, rec, NAME, SPEC + " train.seed=1235", None) == records.NOT_USED
    assert "other settings" in capsys.readouterr().err and not other.exists()
    assert records.restore(run, rec, NAME, SPEC, None) == records.NOT_USED  # started: its log is not replaced
    assert "already started" in capsys.readouterr().err
    assert records.restore(other, rec, "lev-iso", SPEC, None) == records.NO_RECORD


def test_save_keeps_an_unchanged_record_replaces_a_changed_one_and_refuses_what_is_not_ours(records, tmp_path):
    run, rec = tmp_path / "runs" / NAME, tmp_path / "records"
    make_run(run)
    dest = records.save(run, rec, NAME, SPEC, None)
    before = (dest / "record.json").read_text()
    assert records.save(run, rec, NAME, SPEC, None) == dest and (dest / "record.json").read_text() == before
    (run / "train_log.jsonl").write_text('{"step": 0, "loss": 9.9}\n')  # trained again: a new record
    records.save(run, rec, NAME, SPEC, None)
    assert "9.9" in (dest / "train_log.jsonl").read_text()
    assert sorted(p.name for p in rec.iterdir()) == [NAME]  # the old one is gone, no temporary left
    foreign = rec / "tied"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="not a record"):
        records.save(run, rec, "tied", SPEC, None)
    assert (foreign / "notes.txt").read_text() == "mine"
    (dest / "notes.txt").write_text("mine too")  # a user's file inside a record: the record is not replaced over it
    (run / "train_log.jsonl").write_text('{"step": 0, "loss": 8.8}\n')
    with pytest.raises(SystemExit, match="files not its record"):
        records.save(run, rec, NAME, SPEC, None)
    assert (dest / "notes.txt").read_text() == "mine too" and "9.9" in (dest / "train_log.jsonl").read_text()
    (run / "eval" / "global_step720.json").unlink()
    (run / "eval" / "global_step360.json").unlink()
    with pytest.raises(SystemExit, match="trained and evaluated"):
        records.save(run, rec, NAME, SPEC, None)


def test_the_results_page_names_the_machine_each_run_trained_on(tmp_path, monkeypatch):
    """results_small.py names the machine from each run's training log (each segment's), else from its record's
    ``machine`` (runs trained before the log named it), else says it is not recorded: a time on the page is one
    measured on the machine it names, wherever the page is written."""
    monkeypatch.syspath_prepend(str(benchmark_scripts.BENCHMARKS))
    page = benchmark_scripts.load("results_small")
    study = tmp_path / "study"

    def log(name, *machines, record=None):
        run = study / "runs" / name
        run.mkdir(parents=True)
        lines = [{"step": 0, "event": "layout", "dp": 2, **({"machine": m} if m else {})} for m in machines]
        lines.insert(1, {"step": 1, "loss": 9.0, "machine": "not a layout record"})
        (run / "train_log.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        if record:
            (run / "record.json").write_text(json.dumps({"name": name, "machine": record}))

    log("tied", "A", "A")  # resumed on the same machine
    log("lev", None, record="A")  # trained before the log named it: the record's, set with evidence
    assert page.machine_lines(page.run_machines(study, ["tied", "lev"])) == ["Machine (every run trained on it): A."]
    log("lev-long", "A", "B")  # resumed elsewhere
    log("untied", None)
    by_run = page.run_machines(study, ["tied", "lev", "lev-long", "untied"])
    assert by_run == {"tied": ["A"], "lev": ["A"], "lev-long": ["A", "B"], "untied": []}
    assert page.machine_lines(by_run) == [
        "Machines the runs trained on (their times compare only on one machine):",
        "",
        "- A: tied, lev, lev-long",
        "- B: lev-long",
        "- not recorded: untied",
    ]


def test_the_results_page_links_its_plots_from_where_they_are_copied(tmp_path, monkeypatch):
    """results_small.py copies the study's plots to --figures (for the repository's page results/small/figures/: run
    data, not docs/) and links them from the page by relative path; a page written elsewhere without --figures gets
    figures/ beside it, and the repository's plots are left as they are."""
    monkeypatch.syspath_prepend(str(benchmark_scripts.BENCHMARKS))
    page = benchmark_scripts.load("results_small")
    monkeypatch.setattr(page, "head_commit", lambda: "abc1234\n")
    assert page.FIGURES.relative_to(page.REPO).as_posix() == "results/small/figures"
    assert page.RECORDS.relative_to(page.REPO).as_posix() == "results/small/runs"
    study = tmp_path / "study"
    (study / "runs").mkdir(parents=True)
    (study / "compare").mkdir()
    (study / "compare" / "comparison.md").write_text("# Comparison\n\n| run |\n| --- |\n")
    (study / "compare" / "wikitext_ppl.png").write_bytes(b"not a plot")
    doc, figures = tmp_path / "docs" / "results-small.md", tmp_path / "results" / "small" / "figures"
    assert page.main(["--study", str(study), "--out", str(doc), "--figures", str(figures)]) == 0
    assert (figures / "wikitext_ppl.png").read_bytes() == b"not a plot"
    assert "![wikitext_ppl](../results/small/figures/wikitext_ppl.png)" in doc.read_text()
    scratch = tmp_path / "scratch" / "page.md"
    assert page.main(["--study", str(study), "--out", str(scratch)]) == 0
    assert (scratch.parent / "figures" / "wikitext_ppl.png").read_bytes() == b"not a plot"
    assert "![wikitext_ppl](figures/wikitext_ppl.png)" in scratch.read_text()
    assert (page.FIGURES / "wikitext_ppl.png").read_bytes() != b"not a plot"


def test_the_committed_results_page_names_files_that_exist():
    """docs/results-small.md's plots and the reports it names are files of the repository (results/small/)."""
    repo = benchmark_scripts.BENCHMARKS.parent
    text = (repo / "docs" / "results-small.md").read_text()
    plots = re.findall(r"^!\[[^]]*\]\(([^)]+)\)$", text, re.M)
    reports = re.findall(r"^- [^:]+: (results/small/runs/\S+\.json)$", text, re.M)
    assert len(plots) == 4 and len(reports) == 21, (plots, reports)
    missing = [p for p in plots if not (repo / "docs" / p).is_file()] + [r for r in reports if not (repo / r).is_file()]
    assert not missing, missing


def test_the_lev_section_compares_each_run_with_the_papers_form_at_its_tokens(monkeypatch):
    """results_small_lev.py's "vs LEV": the paper's form trained on as many tokens, so the centred 3x-token run is
    against lev-long (not the other way round, which sorting by name alone gave), and the paper's form has none."""
    from leviathan_pretrain.config import load_config

    monkeypatch.syspath_prepend(str(benchmark_scripts.BENCHMARKS))
    lev = benchmark_scripts.load("results_small_lev")
    runs = {
        "sweep/tiny-cpu-lev": ([], 720),
        "lev-center": (["model.lev.center=true"], 720),
        "lev-long": ([], 2160),
        "lev-center-long": (["model.lev.center=true"], 2160),
        "lev-match": (["model.lev.out_init_std=match"], 720),
    }
    path = benchmark_scripts.BENCHMARKS.parent / "configs" / "tiny-cpu-lev.yaml"
    configs = {n: load_config(path, o) for n, (o, _) in runs.items()}
    reports = {n: {"variant": "lev", "tokens_seen": s * 4096} for n, (_, s) in runs.items()}
    seeds = {n: c.train.seed for n, c in configs.items()}
    plain = frozenset(n for n, c in configs.items() if lev.paper_form(c))
    assert plain == {"sweep/tiny-cpu-lev", "lev-long"}
    ref = {n: lev.reference(reports, seeds, n, "lev", plain) for n in runs}
    assert ref == {
        "sweep/tiny-cpu-lev": "sweep/tiny-cpu-lev",
        "lev-center": "sweep/tiny-cpu-lev",
        "lev-long": "lev-long",
        "lev-center-long": "lev-long",
        "lev-match": "sweep/tiny-cpu-lev",
    }
    assert lev.reference(reports, seeds, "lev-center-long", "lev") == "lev-center-long"  # no preference: by name
