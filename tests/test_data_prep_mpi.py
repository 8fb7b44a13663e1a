"""Under mpirun (2 ranks) the output is byte-identical to a one-process run; errors end every rank."""

import filecmp
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MPIRUN = shutil.which("mpirun")
pytestmark = pytest.mark.multiproc


@pytest.fixture(autouse=True)
def _needs_mpirun():
    assert MPIRUN, "Open MPI's mpirun is missing: scripts/setup.sh installs openmpi-bin"


def mpirun(args, timeout=120):
    """``mpirun -n 2 python -m data_prep.tokenize --mpi ARGS``; the whole process group dies on timeout."""
    cmd = [
        MPIRUN,
        "--allow-run-as-root",
        "--oversubscribe",
        "-n",
        "2",
        sys.executable,
        "-m",
        "data_prep.tokenize",
        "--mpi",
        *map(str, args),
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMPI_MCA_rmaps_base_oversubscribe="1")
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, out + err


@pytest.mark.timeout(300)
@pytest.mark.parametrize("split_by_set", [False, True])
def test_two_ranks_give_the_same_bytes_as_one_process(
    split_by_set, minipile_dir, tokenizer_model, run_cli, tmp_path, read_corpus
):
    # four inputs of different sizes, so both ranks get work and the size-based assignment matters
    recs = read_corpus(minipile_dir / "train" / "00.jsonl.zst")[:300]
    extra = []
    for k, part in enumerate((recs[:200], recs[200:])):
        p = tmp_path / f"extra{k}.jsonl"
        p.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in part))
        extra.append(p)
    inputs = [minipile_dir / "val.jsonl.zst", extra[0], minipile_dir / "test.jsonl.zst", extra[1]]
    opts = ["--split-by-set"] if split_by_set else []
    args = ["--input", *inputs, "--tokenizer", tokenizer_model, "--workers", 1, *opts]
    run_cli("data_prep.tokenize", *args, "--output-prefix", tmp_path / "single")
    rc, log = mpirun([*args, "--output-prefix", tmp_path / "multi"])
    assert rc == 0, log
    assert "rank 0/2" in log and "rank 1/2" in log
    single = json.load(open(tmp_path / "single.manifest.json"))
    multi = json.load(open(tmp_path / "multi.manifest.json"))
    assert multi["ranks"] == 2 and single["ranks"] == 1
    assert [o["set"] for o in single["outputs"]] == [o["set"] for o in multi["outputs"]]
    for a, b in zip(single["outputs"], multi["outputs"]):
        for ext in ("bin", "idx", "counts"):
            assert filecmp.cmp(a[ext], b[ext], shallow=False), (a[ext], b[ext])
    assert filecmp.cmp(tmp_path / "single.counts.npy", tmp_path / "multi.counts.npy", shallow=False)
    for key in ("documents", "tokens", "text_bytes", "sets", "skipped"):
        assert single[key] == multi[key]
    assert [i["sha256"] for i in single["inputs"]] == [i["sha256"] for i in multi["inputs"]]
    assert not (tmp_path / "multi.work").exists()


@pytest.mark.timeout(200)
def test_an_error_on_one_rank_stops_all_ranks(minipile_dir, tokenizer_model, tmp_path):
    raw = (minipile_dir / "val.jsonl.zst").read_bytes()
    bad = tmp_path / "truncated.jsonl.zst"
    bad.write_bytes(raw[: len(raw) // 2])
    prefix = tmp_path / "out"
    rc, log = mpirun(
        ["--input", minipile_dir / "test.jsonl.zst", bad, "--tokenizer", tokenizer_model, "--output-prefix", prefix],
        timeout=150,
    )
    assert rc != 0
    assert "error: rank " in log and "truncated zstd stream" in log and str(bad) in log
    assert not any(os.path.exists(str(prefix) + e) for e in (".bin", ".idx", ".manifest.json"))
    # argument errors are reported once, before any work, by every rank agreeing to stop
    rc, log = mpirun(
        ["--input", tmp_path / "missing.jsonl", "--tokenizer", tokenizer_model, "--output-prefix", prefix], timeout=150
    )
    assert rc != 0 and log.count("error: input file not found") == 1


@pytest.mark.timeout(200)
def test_work_dir_rules_hold_under_mpi(minipile_dir, tokenizer_model, tmp_path):
    """Rank 0 creates and marks the work dir before any rank writes; an unmarked one is refused by all
    ranks; after success only the marked work dir is removed, never the --work-dir around it."""
    prefix = tmp_path / "out"
    work = tmp_path / "out.work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    args = [
        "--input",
        minipile_dir / "test.jsonl.zst",
        minipile_dir / "val.jsonl.zst",
        "--tokenizer",
        tokenizer_model,
        "--workers",
        1,
        "--output-prefix",
        prefix,
    ]
    rc, log = mpirun(args, timeout=150)
    assert rc != 0 and log.count("is not a data_prep work directory") == 1, log
    assert sorted(os.listdir(work)) == ["notes.txt"]
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "user.txt").write_text("precious")
    rc, log = mpirun([*args, "--work-dir", scratch, "--keep-work"], timeout=150)
    assert rc == 0, log
    parts = scratch / "out.data_prep-work"
    assert (parts / ".data_prep-work.json").is_file()
    assert (parts / "part-00000" / "part.json").is_file() and (parts / "part-00001" / "part.json").is_file()
    rc, log = mpirun([*args, "--work-dir", scratch, "--overwrite"], timeout=150)
    assert rc == 0 and log.count("reusing") == 2, log
    assert sorted(os.listdir(scratch)) == ["user.txt"] and os.path.exists(str(prefix) + ".idx")
