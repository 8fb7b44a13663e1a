"""One command-line vocabulary (common/cli.py), checked in-process on every command's parser: ``--help``
shows ``--run`` / ``--out`` / ``--overwrite`` / ``--quiet`` / ``--dtype`` where a command has that meaning and never
a hidden alias; each old spelling parses to the same value as the new one; ``--dtype bfloat16`` is ``bf16``."""

import os
import re
import sys

import pytest

from common import cli
from common.cli import UserError
from common.cli import run_main as data_prep_run_main
from data_prep import data_demo, make_corpus, tokenize_cli, train_tokenizer
from launchers import local, slurm_args, status
from leviathan_pretrain import build_data_cache, compare, evaluate, export_hf, params, train
from leviathan_pretrain import demo as train_demo

# command -> (parser builder, the subcommand, the options it must show for the shared meanings)
COMMANDS = {
    "leviathan_pretrain.evaluate": (evaluate.build_parser, [], {"--run", "--out", "--dtype", "--quiet"}),
    "leviathan_pretrain.export_hf": (export_hf.build_parser, [], {"--run", "--out", "--dtype", "--overwrite"}),
    "leviathan_pretrain.compare": (compare.build_parser, [], {"--out"}),
    "leviathan_pretrain.build_data_cache": (build_data_cache.build_parser, [], {"--verbose"}),
    "leviathan_pretrain.params": (params.build_parser, [], set()),
    "leviathan_pretrain.demo": (train_demo.build_parser, [], {"--out", "--overwrite"}),
    "leviathan_pretrain.train": (train.build_parser, [], set()),
    "data_prep.tokenize": (tokenize_cli.build_parser, [], {"--out", "--overwrite", "--quiet"}),
    "data_prep.train_tokenizer": (train_tokenizer.build_parser, [], {"--out", "--overwrite", "--verbose"}),
    "data_prep.make_corpus": (make_corpus.build_parser, [], {"--out", "--overwrite"}),
    "data_prep.data_demo": (data_demo.build_parser, [], {"--out", "--overwrite"}),
    "launchers.slurm submit": (slurm_args.build_parser, ["submit"], {"--run"}),
    "launchers.slurm sweep": (slurm_args.build_parser, ["sweep"], {"--run"}),
    "launchers.slurm pipeline": (slurm_args.build_parser, ["pipeline"], {"--run"}),
    "launchers.slurm status": (slurm_args.build_parser, ["status"], {"--run"}),
    "launchers.status": (status.build_parser, [], {"--run"}),
    "launchers.local": (local.build_parser, [], set()),
}
HIDDEN = ("--run-dir", "--force", "--fresh", "--output", "--output-prefix", "--no-progress")
SHARED = ("--run", "--out", "--overwrite", "--quiet", "--verbose", "--dtype")

# (command, arguments both spellings share, new spelling, old spelling, the namespace attribute)
ALIASES = [
    ("leviathan_pretrain.evaluate", [], ["--run", "r"], ["--run-dir", "r"], "run"),
    ("leviathan_pretrain.export_hf", ["--out", "o"], ["--run", "r"], ["--run-dir", "r"], "run"),
    ("leviathan_pretrain.demo", [], ["--overwrite"], ["--fresh"], "overwrite"),
    ("data_prep.tokenize", ["--input", "x", "--tokenizer", "t"], ["--out", "p"], ["--output-prefix", "p"], "out"),
    ("data_prep.tokenize", ["--input", "x", "--tokenizer", "t", "--out", "p"], ["--quiet"], ["--no-progress"], "quiet"),
    ("data_prep.train_tokenizer", ["--input", "x", "--vocab-size", "900"], ["--out", "d"], ["--output", "d"], "output"),
    ("data_prep.make_corpus", [], ["--out", "d"], ["d"], "out"),
    ("data_prep.make_corpus", ["--out", "d"], ["--overwrite"], ["--force"], "overwrite"),
    ("data_prep.data_demo", [], ["--overwrite"], ["--force"], "overwrite"),
    ("launchers.slurm submit", ["--config", "c.yaml"], ["--run", "r"], ["--run-dir", "r"], "run_dir"),
    ("launchers.slurm sweep", ["--configs", "c.yaml"], ["--run", "r"], ["--run-dir", "r"], "run_dir"),
    ("launchers.slurm pipeline", ["--config", "c.yaml"], ["--run", "r"], ["--run-dir", "r"], "run_dir"),
    ("launchers.slurm status", [], ["--run", "r"], ["r"], "run_dir"),
    ("launchers.status", [], ["--run", "r"], ["r"], "run_dir"),
]
DTYPE_BASE = {
    "leviathan_pretrain.evaluate": ["--run", "r"],
    "leviathan_pretrain.export_hf": ["--run", "r", "--out", "o"],
}


def _parse(command: str, argv: list) -> object:
    build, sub, _ = COMMANDS[command]
    return build().parse_args([*sub, *argv])


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        _parse(command, ["--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def _options(text: str) -> set:
    return set(re.findall(r"(?<![\w-])--[a-z][\w-]*", text))


@pytest.mark.parametrize("command", COMMANDS)
def test_help_shows_the_shared_spellings_and_no_hidden_alias(command, capsys):
    shown = _options(_help(command, capsys))
    assert not shown & set(HIDDEN), f"{command} --help shows hidden aliases {sorted(shown & set(HIDDEN))}"
    want = COMMANDS[command][2]
    assert shown & set(SHARED) >= want, f"{command} --help lacks {sorted(want - shown)}"


@pytest.mark.parametrize("command, base, new, old, dest", ALIASES, ids=[f"{a[0]} {a[3][0]}" for a in ALIASES])
def test_old_spelling_parses_as_the_new_one(command, base, new, old, dest):
    assert getattr(_parse(command, [*base, *new]), dest) == getattr(_parse(command, [*base, *old]), dest)
    assert getattr(_parse(command, [*base, *new]), dest) not in (None, False)


@pytest.mark.parametrize("command", DTYPE_BASE)
def test_dtype_takes_short_and_long_names(command, capsys):
    base = DTYPE_BASE[command]
    assert _parse(command, base).dtype == ("fp32" if command.endswith("evaluate") else "bf16")  # defaults kept
    for short, long in (("bf16", "bfloat16"), ("fp32", "float32")):
        assert (
            _parse(command, [*base, "--dtype", long]).dtype == short == _parse(command, [*base, "--dtype", short]).dtype
        )
    with pytest.raises(SystemExit):
        _parse(command, [*base, "--dtype", "float64"])
    assert "unknown dtype 'float64'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "command, argv", [("data_prep.make_corpus", []), ("data_prep.make_corpus", ["a", "--out", "b"])]
)
def test_make_corpus_takes_exactly_one_output(command, argv, capsys):
    with pytest.raises(SystemExit) as done:
        _parse(command, argv)
    assert done.value.code == 2 and "--out" in capsys.readouterr().err


def test_run_main_one_line_errors(capsys):
    def fails(exc):
        def main(argv):
            raise exc

        return main

    assert cli.run_main(fails(ValueError("bad x")), errors=(ValueError,)) == 2
    assert capsys.readouterr().err == "error: bad x\n"
    assert cli.run_main(fails(KeyboardInterrupt()), errors=(ValueError,)) == 130
    assert capsys.readouterr().err == "error: interrupted\n"
    assert data_prep_run_main(fails(UserError("no such file"))) == 2
    assert capsys.readouterr().err == "error: no such file\n"
    assert cli.run_main(lambda ns: ns, 3) == 3 and cli.run_main(lambda argv: None) == 0
    with pytest.raises(RuntimeError):
        cli.run_main(fails(RuntimeError("a bug")), errors=(ValueError,))


def test_a_reader_that_leaves_ends_lev_quietly(monkeypatch):
    """``lev | head``: stdout's reader is gone (a pipe whose read end is closed): exit 1, no BrokenPipeError."""
    from launchers import commands as lev

    read, write = os.pipe()
    os.close(read)
    out = os.fdopen(write, "w")
    monkeypatch.setattr(sys, "stdout", out)
    try:
        assert lev.main([]) == 1  # the usage table, printed into the closed pipe
        print("more", flush=True)  # stdout now goes to /dev/null
    finally:
        out.close()
