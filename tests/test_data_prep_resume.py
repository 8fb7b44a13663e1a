"""Killed runs leave no final files and resume to the same bytes; parts are reused only when their
input is unchanged; the output does not depend on threads, batch size or chunked encoding."""

import filecmp
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zstandard

REPO = Path(__file__).resolve().parents[1]

FINAL_EXTS = (".bin", ".idx", ".counts.npy", ".manifest.json")


@pytest.fixture(scope="module")
def three_inputs(minipile_dir, tmp_path_factory, read_corpus):
    """test, val, and a ~12 MB slice of train (so a run lasts long enough to be killed mid-way)."""
    d = tmp_path_factory.mktemp("inputs")
    recs = read_corpus(minipile_dir / "train" / "00.jsonl.zst")
    lines, size = [], 0
    for r in recs:
        line = json.dumps(r, ensure_ascii=False).encode() + b"\n"
        lines.append(line)
        size += len(line)
        if size > 12_000_000:
            break
    big = d / "slice.jsonl.zst"
    big.write_bytes(zstandard.ZstdCompressor(level=3).compress(b"".join(lines)))
    return [minipile_dir / "test.jsonl.zst", minipile_dir / "val.jsonl.zst", big]


def _same(a: str, b: str, exts=(".bin", ".idx", ".counts.npy")) -> bool:
    return all(filecmp.cmp(a + e, b + e, shallow=False) for e in exts)


def _tokenize_args(inputs, tokenizer, prefix, *extra):
    return [
        sys.executable,
        "-m",
        "data_prep.tokenize",
        "--input",
        *map(str, inputs),
        "--tokenizer",
        str(tokenizer),
        "--output-prefix",
        str(prefix),
        *map(str, extra),
    ]


@pytest.fixture(scope="module")
def reference(three_inputs, tokenizer_model, tmp_path_factory, run_cli):
    prefix = tmp_path_factory.mktemp("ref") / "ref"
    run_cli(*_tokenize_args(three_inputs, tokenizer_model, prefix)[2:], timeout=300)
    return str(prefix)


@pytest.mark.timeout(300)
def test_sigkill_leaves_no_outputs_and_a_rerun_gives_the_same_bytes(
    three_inputs, tokenizer_model, reference, tmp_path, run_cli
):
    prefix = tmp_path / "out"
    work = tmp_path / "out.work"
    proc = subprocess.Popen(
        _tokenize_args(three_inputs, tokenizer_model, prefix, "--workers", 1, "--batch-bytes", 0.05),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        # kill once the second input is done and the third is being written (its 12 MB take seconds; the
        # moment between the second's part.json and the third's .tmp folder is not one to kill in)
        while not ((work / "part-00001" / "part.json").exists() and (work / "part-00002.tmp").is_dir()):
            assert proc.poll() is None, "finished before it could be killed: " + proc.stderr.read().decode()
            assert time.monotonic() < deadline
            time.sleep(0.005)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert not [e for e in FINAL_EXTS if os.path.exists(str(prefix) + e)]
    assert (work / "part-00000" / "part.json").exists() and (work / "part-00002.tmp").is_dir()
    assert not (work / "part-00002").exists()

    p = run_cli(*_tokenize_args(three_inputs, tokenizer_model, prefix)[2:], timeout=300)
    assert "reusing" in p.stderr and str(work / "part-00000") in p.stderr and str(work / "part-00001") in p.stderr
    assert _same(str(prefix), reference)
    m = json.load(open(str(prefix) + ".manifest.json"))
    assert [i["reused"] for i in m["inputs"]] == [True, True, False]
    assert not work.exists()  # removed after success


def test_parts_are_reused_only_for_unchanged_inputs(minipile_dir, tokenizer_model, tmp_path, run_cli, read_corpus):
    a = tmp_path / "a.jsonl.zst"
    b = tmp_path / "b.jsonl.zst"
    a.write_bytes((minipile_dir / "test.jsonl.zst").read_bytes())
    b.write_bytes((minipile_dir / "val.jsonl.zst").read_bytes())
    prefix = tmp_path / "out"
    run_cli(*_tokenize_args([a, b], tokenizer_model, prefix, "--keep-work")[2:])
    assert (tmp_path / "out.work" / "part-00001" / "part.json").exists()
    # b changes (same size, other content): only a's part may be reused
    recs = read_corpus(minipile_dir / "val.jsonl.zst")
    recs[0]["text"] = recs[0]["text"][::-1]
    b.write_bytes(
        zstandard.ZstdCompressor(level=3).compress(
            b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in recs)
        )
    )
    p = run_cli(*_tokenize_args([a, b], tokenizer_model, prefix, "--overwrite", "--keep-work")[2:])
    assert "part-00000 for" in p.stderr and "part-00001 for" not in p.stderr
    run_cli(*_tokenize_args([a, b], tokenizer_model, tmp_path / "fresh")[2:])
    assert _same(str(prefix), str(tmp_path / "fresh"))
    # a different tokenizer setting (dtype) invalidates every part
    p = run_cli(*_tokenize_args([a, b], tokenizer_model, prefix, "--overwrite", "--dtype", "int32")[2:])
    assert "reusing" not in p.stderr


def test_output_does_not_depend_on_threads_batches_or_chunking(
    minipile_dir, tokenizer_model, read_corpus, tmp_path, run_cli
):
    texts = [r["text"] for r in read_corpus(minipile_dir / "train" / "00.jsonl.zst")[:200]]
    long_doc = "\n".join(texts)[:1_500_000]  # longer than a batch: piece batches
    src = tmp_path / "mixed.jsonl"
    with open(src, "w") as f:
        for t in texts[:50] + [long_doc] + texts[50:80]:
            f.write(json.dumps({"text": t, "meta": {"pile_set_name": "X"}}) + "\n")
    inputs = [minipile_dir / "val.jsonl.zst", src]
    settings = [
        ("--workers", 1, "--chunk-bytes", 0),  # whole documents
        ("--workers", 2, "--batch-bytes", 1, "--chunk-bytes", 8192),
        ("--workers", 3, "--batch-bytes", 0.02, "--chunk-bytes", 1000),
    ]
    for k, extra in enumerate(settings):
        run_cli(*_tokenize_args(inputs, tokenizer_model, tmp_path / f"o{k}", *extra)[2:], timeout=200)
    assert _same(str(tmp_path / "o0"), str(tmp_path / "o1")) and _same(str(tmp_path / "o0"), str(tmp_path / "o2"))
    manifests = [json.load(open(tmp_path / f"o{k}.manifest.json")) for k in range(3)]
    assert manifests[0]["encode_chunk_bytes"] == 0 and manifests[1]["encode_chunk_bytes"] == 8192
    assert len({json.dumps(m["sets"], sort_keys=True) for m in manifests}) == 1
