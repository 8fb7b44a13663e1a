"""Peak memory of tokenize does not grow with the corpus: it streams bounded batches."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard

REPO = Path(__file__).resolve().parents[1]


def _peak_rss_mb(args) -> float:
    """Run tokenize; its peak resident memory from the kernel's accounting of the reaped child."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "data_prep.tokenize", *map(str, args)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _, status, usage = os.wait4(proc.pid, 0)  # reaps it
    except BaseException:  # e.g. the test's timeout: leave nothing behind
        proc.kill()
        proc.wait()
        raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0
    return usage.ru_maxrss / 1024


@pytest.mark.timeout(240)
def test_peak_rss_is_independent_of_corpus_size(minipile_dir, tokenizer_model, tmp_path):
    text = zstandard.ZstdDecompressor().stream_reader(open(minipile_dir / "val.jsonl.zst", "rb")).read()
    small, big = tmp_path / "small.jsonl", tmp_path / "big.jsonl"
    small.write_bytes(text)
    big.write_bytes(text * 24)  # ~20 MB of text: holding it would add > 50 MB
    common = ["--tokenizer", tokenizer_model, "--batch-bytes", 0.5, "--workers", 2, "--no-progress"]
    rss_small = _peak_rss_mb(["--input", small, "--output-prefix", tmp_path / "s", *common])
    rss_big = _peak_rss_mb(["--input", big, "--output-prefix", tmp_path / "b", *common])
    assert os.path.getsize(tmp_path / "b.bin") > 20 * os.path.getsize(tmp_path / "s.bin")
    assert rss_big - rss_small < 15, (rss_small, rss_big)
