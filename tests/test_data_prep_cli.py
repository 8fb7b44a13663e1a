"""Every command has --help and one-line user errors; tokenize stays free of torch/megatron imports;
progress is a tqdm bar on a terminal and plain lines otherwise; the demo runs end to end."""

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMMANDS = ["data_prep.make_corpus", "data_prep.train_tokenizer", "data_prep.tokenize", "data_prep.data_demo"]


@pytest.mark.parametrize("module", COMMANDS)
def test_help(module, run_cli):
    p = run_cli(module, "--help", timeout=60)
    assert p.stdout.startswith("usage: python -m " + module) and len(p.stdout.splitlines()) > 8


@pytest.mark.parametrize(
    "module, args, needle",
    [
        ("data_prep.make_corpus", ["{tmp}/c", "--sources", "github,novels"], "unknown source 'novels'"),
        (
            "data_prep.train_tokenizer",
            ["--input", "{tmp}/none.jsonl", "--vocab-size", "1000", "--output", "{tmp}/t"],
            "input file not found",
        ),
        (
            "data_prep.train_tokenizer",
            ["--input", "{tmp}", "--vocab-size", "1000", "--output", "{tmp}/t"],
            "is a directory",
        ),
        (
            "data_prep.tokenize",
            [
                "--input",
                "{tmp}/x.jsonl",
                "--tokenizer",
                "{tmp}/t.model",
                "--output-prefix",
                "{tmp}/o",
                "--workers",
                "0",
            ],
            "--workers must be >= 1",
        ),
        (
            "data_prep.tokenize",
            ["--input", "{tmp}/x.jsonl", "--tokenizer", "{tmp}/t.model", "--output-prefix", "{tmp}/"],
            "tokenizer not found",
        ),
    ],
)
def test_user_errors_are_one_line(module, args, needle, run_cli, tmp_path):
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\n')
    p = run_cli(module, *[a.format(tmp=tmp_path) for a in args], check=False, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("error: ") and needle in p.stderr


def test_tokenize_imports_neither_torch_nor_megatron(minipile_dir, tokenizer_model, tmp_path):
    code = (
        "import sys\n"
        "from data_prep import tokenize_cli\n"
        f"rc = tokenize_cli.main(['--input', {str(minipile_dir / 'test.jsonl.zst')!r}, '--tokenizer', "
        f"{str(tokenizer_model)!r}, '--output-prefix', {str(tmp_path / 'o')!r}])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'deepspeed'))\n"
        "print('RC', rc, 'HEAVY', heavy)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert "RC 0 HEAVY []" in p.stdout, p.stdout + p.stderr


def test_plain_progress_lines_when_not_a_terminal(minipile_dir, tokenizer_model, tokenize, tmp_path):
    p = tokenize(
        minipile_dir / "val.jsonl.zst", tokenizer_model, tmp_path / "o", "--log-interval", 0, "--batch-bytes", 0.1
    )
    lines = [ln for ln in p.stderr.splitlines() if "tok/s" in ln and "MB/s" in ln and " docs" in ln]
    assert len(lines) >= 3 and "\r" not in p.stderr
    assert "total 54 docs" in p.stderr and "manifest:" in p.stderr  # the summary


def test_progress_bar_on_a_terminal(minipile_dir, tokenizer_model, tmp_path):
    """stderr on a pseudo-terminal: tqdm draws a bar with documents, tokens/s and MB/s."""
    master, slave = pty.openpty()
    cmd = [
        sys.executable,
        "-m",
        "data_prep.tokenize",
        "--input",
        str(minipile_dir / "val.jsonl.zst"),
        "--tokenizer",
        str(tokenizer_model),
        "--output-prefix",
        str(tmp_path / "o"),
        "--batch-bytes",
        "0.1",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    out = b""
    try:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text
    bar = [ln for ln in text.split("\r") if "%|" in ln]
    assert bar and "tok/s" in bar[-1] and "MB/s" in bar[-1] and "54 docs" in bar[-1], text


@pytest.mark.timeout(300)
def test_demo_runs_and_reuses_its_steps(tmp_path, run_cli, capsys):
    out = tmp_path / "demo"
    p = run_cli("data_prep.data_demo", "--out", out, "--max-mb", 3, "--vocab-size", 2000, "--sample-mb", 1, timeout=280)
    for step in ("1/3 corpus", "2/3 tokenizer", "3/3 shards: train", "3/3 shards: val", "done in"):
        assert step in p.stdout, p.stdout
    from data_prep.demo_steps import run_demo

    res = run_demo(out, vocab_size=2000, sample_mb=1, max_mb=3)  # all steps reused
    m = json.load(open(res["train_prefix"] + ".manifest.json"))
    assert m["documents"] > 50 and m["tokens"] > 100_000 and list(m["sets"]) == ["Github"]
    assert os.path.exists(res["val_prefix"] + ".idx") and res["tokenizer"].endswith("tokenizer.model")
    # --force redoes every step but deletes nothing the demo did not write (e.g. the training demo's run)
    (out / "notes.txt").write_text("mine")
    (out / "train").mkdir()
    (out / "train" / "checkpoint").write_text("hours of training")
    (out / "data" / "mine.txt").write_text("mine")
    capsys.readouterr()
    run_demo(out, vocab_size=2000, sample_mb=1, max_mb=3, force=True)
    said = capsys.readouterr().out
    assert "reusing" not in said and "1/3 corpus: the standard library" in said and "3/3 shards: val" in said
    assert (out / "notes.txt").read_text() == "mine" and (out / "data" / "mine.txt").read_text() == "mine"
    assert (out / "train" / "checkpoint").read_text() == "hours of training"
    assert json.load(open(res["train_prefix"] + ".manifest.json"))["documents"] == m["documents"]
