"""launchers/local.py: rank variables, failure of one rank stops the rest, exit code propagation, and the
GPU check script's CPU dry mode (benchmarks/gpu_check.sh --dry)."""

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.multiproc import REPO, base_env, run_python

# One write(2) per line: the ranks share the launcher's stdout, and unbuffered print() writes a line's text and
# its newline separately, so lines of different ranks could interleave.
CHILD = (
    "import os, sys, time; r = int(os.environ['RANK']); "
    "v = [str(r)] + [os.environ[k] for k in ('WORLD_SIZE', 'LOCAL_RANK', 'MASTER_PORT')]; "
    "os.write(1, ('RANKVARS ' + ' '.join(v) + chr(10)).encode()); "
    "sys.exit(int(sys.argv[1])) if r == 1 else time.sleep(float(sys.argv[2]))"
)


def launch(*args, timeout=60):
    return run_python("launchers/local.py", *args, timeout=timeout)


def test_rank_variables_and_success():
    proc = launch("-n", "3", "--", "-c", CHILD, "0", "0")
    assert proc.returncode == 0, proc.stderr
    lines = sorted(line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("RANKVARS"))
    assert [line[:3] for line in lines] == [["0", "3", "0"], ["1", "3", "1"], ["2", "3", "2"]]
    assert len({line[3] for line in lines}) == 1


def test_failed_rank_stops_the_others_and_its_code_is_returned():
    t0 = time.monotonic()
    proc = launch("-n", "2", "--grace", "1", "--", "-c", CHILD, "5", "120")
    assert proc.returncode == 5
    assert time.monotonic() - t0 < 30
    assert "rank 1 exited with code 5" in proc.stderr


def test_a_rank_that_stops_with_a_checkpoint_is_not_reported_as_a_failure():
    proc = launch("-n", "2", "--grace", "1", "--", "-c", CHILD, "75", "5")
    assert proc.returncode == 75
    assert "rank 1 stopped with a checkpoint (exit 75: run the same command to resume)" in proc.stderr
    assert "exited with code" not in proc.stderr


def test_nothing_to_run_is_a_usage_error():
    proc = launch("-n", "2")
    assert proc.returncode == 2 and "nothing to run" in proc.stderr


def _gpu_check_dry(out: Path, env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--dry"],
        cwd=REPO,
        env=base_env({"OUT": str(out), **env}),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.multiproc
def test_gpu_check_dry_run(tmp_path):
    """The GPU check's own sections on CPU with tiny shapes (gpu_check.sh --dry, Triton's interpreter): the loss and
    LEV kernel checks, the synthetic shard, bf16 training of TIED and LEV, bench_step.py's four contestants (ours at
    the new and at the old defaults, Hugging Face, Hugging Face + Liger) and LEV probe, the summary files in OUT
    (its own earlier output, marked, is replaced) with the step-speed goals' ratios per scale. STEP_EXTRA reaches
    bench_step's "ours" (its loss chunk is recorded beside the ratio). A scale without configs fails its own
    sections, each recorded, and loses none of the other scale's numbers."""
    out = tmp_path / "gc"
    out.mkdir()
    (out / ".gpu_check-output").touch()
    (out / "old.log").write_text("an earlier check's")
    env = {"STEPS": "4", "SCALES": "tiny-cpu nosuch", "PAIRS": "1", "STEP_EXTRA": "model.loss_chunk_tokens=48"}
    proc = _gpu_check_dry(out, env, timeout=500)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # 1: the nosuch scale's sections failed
    assert sorted(p.name for p in out.iterdir()) == [".gpu_check-output", "gpu_check.log", "summary.json", "summary.md"]
    summary = json.loads((out / "summary.json").read_text())
    runs = {Path(r["run"]).name: r for r in summary["runs"]}
    assert set(runs) == {"tiny-cpu-tied", "tiny-cpu-lev", "nosuch-tied", "nosuch-lev"}
    for name in ("tiny-cpu-tied", "tiny-cpu-lev"):
        r = runs[name]
        assert r["tokens_per_s"] > 0 and r["mfu"] is None and r["peak_gib"] > 0 and r["plan_gib"] > 0, r
    assert "error" in runs["nosuch-tied"] and "error" in runs["nosuch-lev"]
    states = {name: state for name, state, _ in summary["sections"]}
    ok = ("install", "check-loss", "check-lev", "shard", "tiny-cpu-tied", "tiny-cpu-lev", "step-tiny-cpu")
    assert [states[k] for k in ok] == ["ok"] * len(ok), states
    assert states["nosuch-tied"].startswith("failed") and states["step-nosuch"].startswith("failed"), states
    assert states["check-compile"] == "skipped (dry)"
    assert set(summary["checks"]) == {"loss", "lev"} and not summary["checks"]["loss"]["failures"]
    (result,) = summary["results"]  # step-nosuch failed at its config: no JSON
    step, probe = result["step"], result["probe"]
    assert step["precision"] == "bf16" and step["tokens_per_s"]["ref"] > 0 and step["ratio_pairs"] > 0
    assert step["contestants"] == ["ours", "old", "ref", "liger"] and set(step["ratio_pairs_vs"]) == {
        "old",
        "ref",
        "liger",
    }
    assert "parallel.immediate_grad_update=false" in step["old_overrides"] and "Liger" in step["describe"]["liger"]
    assert step["ref_attention"] == "sdpa" and "phases_s" in step and step["loss_chunk_tokens"] == 48
    assert "(48 tokens a chunk)" in (out / "summary.md").read_text()
    assert probe["config"] == "configs/tiny-cpu-lev.yaml" and "aten::" in probe["profile"]
    sc = summary["scales"]["tiny-cpu"]
    assert sc["ours_over_ref"] == step["ratio_pairs"] and sc["ours_over_liger"] == step["ratio_pairs_vs"]["liger"]
    assert sc["lev_over_tied"] == runs["tiny-cpu-lev"]["step_s"] / runs["tiny-cpu-tied"]["step_s"]
    assert sc["goals"]["mfu_tied"]["met"] is None  # no MFU on a CPU: not measured, never "met"
    assert "configs/nosuch-tied.yaml" in (out / "gpu_check.log").read_text()  # the failure's own words, not hidden
    assert "LEV/TIED tokens/s (tiny-cpu):" in proc.stdout and "OURS/REF" in proc.stdout and "OURS/LIGER" in proc.stdout
    assert "LEV kernel check:" in proc.stdout


@pytest.mark.multiproc
def test_gpu_check_runs_the_sections_asked_for_and_summarizes_only_runs_that_started(tmp_path):
    """A second GPU run takes what the first left out: SECTIONS picks sections (the rest recorded as skipped, no
    training row for them). A training run skipped because the budget is spent is in the sections table only: the
    first H200 check reported its skipped variant as 'failed: FileNotFoundError ... config.json'. OLD='' leaves out
    the old-defaults contestant (and its check). An unknown section is refused. (bench_step's own run, with
    STEP_EXTRA, is test_gpu_check_dry_run's.)"""
    out = tmp_path / "budget"  # 34 s less the 20 kept for the summary: under the 15 a section needs, from the start
    proc = _gpu_check_dry(out, {"BUDGET": "34", "SECTIONS": "train", "OLD": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    states = {name: state for name, state, _ in summary["sections"]}
    assert states["tiny-cpu-tied"] == states["tiny-cpu-lev"] == "skipped (budget)", states
    assert states["checks"] == states["step-tiny-cpu"] == "skipped (SECTIONS)", states
    assert summary["runs"] == [] and summary["results"] == []
    md = (out / "summary.md").read_text()
    assert "None in this check." in md and "error" not in md and "FileNotFoundError" not in md
    log = (out / "gpu_check.log").read_text()
    assert "OLD (A): \n" in log and "does not load" not in log  # '' is no old contestant, not the defaults

    proc = _gpu_check_dry(tmp_path / "bad", {"SECTIONS": "train warp"})
    assert proc.returncode == 2 and "unknown section 'warp'" in proc.stderr, proc.stderr


def test_demo_fresh_and_gpu_check_never_delete_a_directory_they_did_not_create(tmp_path):
    """`leviathan_pretrain.demo --fresh` and gpu_check.sh replace only a directory carrying their own marker."""
    user = tmp_path / "out" / "train"
    user.mkdir(parents=True)
    (user / "thesis.tex").write_text("mine")
    proc = run_python(
        "-m",
        "leviathan_pretrain.demo",
        "--out",
        str(tmp_path / "out"),
        "--data-prefix",
        str(tmp_path / "none"),
        "--fresh",
        timeout=120,
    )
    assert proc.returncode == 2 and "was not created by the demo" in proc.stderr, proc.stderr
    assert (user / "thesis.tex").read_text() == "mine"
    other = tmp_path / "gpu"
    other.mkdir()
    (other / "results.csv").write_text("mine")
    proc = _gpu_check_dry(other, {}, timeout=120)
    assert proc.returncode == 2 and "not written by gpu_check.sh" in proc.stderr, proc.stderr
    assert (other / "results.csv").read_text() == "mine"
