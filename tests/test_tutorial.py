"""docs/tutorial.md runs as written: every command of its ```bash blocks, in order, in a temporary directory.

The page's conventions (stated at its end too):

- every line of a ```bash block is a command; a line ending in `` \\`` goes on on the next line (the command's text,
  continuation lines included, is what ``bash -c`` gets, as a reader's shell would);
- the ```text block that follows a ```bash block (prose may come between) is the output of that block's commands,
  stdout and stderr together, abridged: each of its lines other than ``...`` must appear in that output, in order;
  ``...`` inside a line stands for any text, runs of spaces for any spaces, and every number matches any number
  (timings and losses vary, and the test runs a smaller scale), or a ``-`` (a table's empty cell);
- a command whose comment says ``# interactive`` is not run (TensorBoard's server);
- a command whose comment says ``Ctrl-C`` is interrupted the way a terminal's Ctrl-C does (SIGINT to its process
  group) as soon as its first training-step line appears, and must then exit 75 (stopped with a checkpoint).

What runs is the page's text with the substitutions of :data:`SCALE` (each must occur in the page): the corpus is a
small sample of the running interpreter's standard library, training is 8 steps of 2 sequences instead of 60 of 8,
evaluation reads fewer tokens. The temporary directory stands for the repository's root: it holds links to the paths
the page uses from there (:data:`LINKED`) and nothing else, so the runs, the data and the exports stay out of the
checkout. Each command runs in a fresh ``bash -c`` with the virtual environment active (``. .venv/bin/activate``
itself is run too, to no effect), so a command may not rely on ``cd`` or shell variables of an earlier one.

No process outlives its command: every descendant seen while it runs (the launcher's ranks live in their own
sessions) is killed if still alive afterwards, and its being alive fails the test.

``python tests/test_tutorial.py DIR`` runs the page at full scale (no substitutions) in DIR and prints each block's
output: what to paste into the page's ```text blocks after changing it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "tutorial.md"
LINKED = ("configs", "launchers", ".venv")  # repository paths the page's commands use, linked into the work dir
CORPUS_DIR = "/usr/lib/python3.11/"  # where the page takes its corpus from
SCALE = {  # page text -> what the test runs instead
    CORPUS_DIR: "{corpus}/",
    "train.steps=60": "train.steps=8 logging.log_interval=2 train.eval_iters=1 train.micro_batch_size=2 "
    "train.global_batch_size=2",
    "--max-tokens 50000": "--max-tokens 2000",
}
INTERACTIVE = "# interactive"
CTRL_C = "Ctrl-C"
STEP_LINE = re.compile(r"^\[train\] step\s+\d+/\d+ \|")  # the trainer's progress line: when the test "presses" Ctrl-C
STOPPED = 75  # the trainer's (and launcher's) exit code after a checkpointed stop
NUMBER = r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?"
ANY_NUMBER = rf"(?:{NUMBER}|-)"  # what an expected number matches: a number, or a table's "-" (an empty bucket)
COMMAND_TIMEOUT = 240.0


@dataclass
class Block:
    line: int  # 1-based line of the opening fence in the page
    commands: list[str]
    expected: list[str] = field(default_factory=list)


def fenced_blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """(line, info string, lines) of every fenced block of a Markdown text."""
    blocks, current = [], None
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            if current is None:
                current = (n, line[3:].strip(), [])
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current[2].append(line)
    assert current is None, f"docs/tutorial.md: the block opened at line {current[0]} is never closed"
    return blocks


def commands(lines: list[str]) -> list[str]:
    """A bash block's commands: one per line, a trailing backslash joining the next line (kept in the text)."""
    out, pending = [], ""
    for line in lines:
        pending += line
        if line.endswith("\\"):
            pending += "\n"
            continue
        if pending.strip():
            out.append(pending)
        pending = ""
    assert not pending, f"a command ends in a continuation backslash: {pending!r}"
    return out


def parse(text: str) -> list[Block]:
    """The page's bash blocks, each with the text block after it (if the next fenced block is one)."""
    blocks: list[Block] = []
    for line, info, lines in fenced_blocks(text):
        if info == "bash":
            blocks.append(Block(line, commands(lines)))
        elif info == "text" and blocks and not blocks[-1].expected:
            blocks[-1].expected = [x for x in lines if x.strip()]
    return blocks


def scaled(text: str, corpus: Path) -> str:
    for key in SCALE:
        assert key in text, f"docs/tutorial.md no longer contains {key!r}: update SCALE in tests/test_tutorial.py"
    for key, value in SCALE.items():
        text = text.replace(key, value.format(corpus=corpus))
    return text


def line_pattern(expected: str) -> re.Pattern:
    """An expected line as a regex: ``...`` any text, whitespace any whitespace, a number any number (or ``-``)."""
    parts = []
    for piece in expected.strip().split("..."):
        regex = ""
        for token in re.split(rf"(\s+|{NUMBER})", piece):
            if not token:
                continue
            if token.isspace():
                regex += r"\s+"
            elif re.fullmatch(NUMBER, token):
                regex += ANY_NUMBER
            else:
                regex += re.escape(token)
        parts.append(regex)
    return re.compile(".*".join(parts))


def missing_lines(expected: list[str], output: str) -> list[str]:
    """The expected lines (past the first one not found in order) that the output lacks; [] when all are there."""
    lines = [x.strip() for x in output.splitlines()]
    at = 0
    for i, want in enumerate(expected):
        if want.strip() == "...":
            continue
        pattern = line_pattern(want)
        while at < len(lines) and not pattern.fullmatch(lines[at]):
            at += 1
        if at == len(lines):
            return expected[i:]
        at += 1
    return []


def venv() -> Path:
    return Path(sys.prefix) if sys.prefix != sys.base_prefix else REPO / ".venv"


def environment() -> dict:
    """The environment of ``. .venv/bin/activate``, plus unbuffered Python output (the Ctrl-C waits for a line)."""
    env = dict(os.environ)
    env.pop("PYTHONHOME", None)
    env["VIRTUAL_ENV"] = str(venv())
    env["PATH"] = f"{venv() / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def work_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        (path / name).symlink_to(venv() if name == ".venv" else REPO / name)
    return path


def sample_corpus(path: Path) -> Path:
    """A small, fixed sample of this interpreter's standard library: modules a-c (~0.6 MB, enough for the page's
    8k tokenizer) for the page's training glob, w-z for its validation glob."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    path.mkdir(parents=True)
    for pattern in ("[a-c]*.py", "[w-z]*.py"):
        for f in sorted(stdlib.glob(pattern)):
            shutil.copyfile(f, path / f.name)
    return path


@dataclass
class Result:
    command: str
    returncode: int | None
    output: str
    interrupted: bool
    seconds: float
    left_behind: list[str]


def _descendants(pid: int, seen: dict) -> None:
    import psutil

    try:
        for child in psutil.Process(pid).children(recursive=True):
            seen.setdefault((child.pid, child.create_time()), child)
    except psutil.Error:
        pass


def _kill_left(seen: dict) -> list[str]:
    import psutil

    left = []
    for child in seen.values():
        try:
            if child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
                left.append(" ".join(child.cmdline())[:200])
                child.kill()
        except psutil.Error:
            pass
    return left


def run_command(command: str, cwd: Path, env: dict, timeout: float = COMMAND_TIMEOUT) -> Result:
    """``bash -c COMMAND`` in its own session; SIGINT at its first training-step line if it says Ctrl-C; killed
    (with every descendant) at ``timeout``."""
    start = time.monotonic()
    proc = subprocess.Popen(
        ["bash", "-c", command],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    seen: dict = {}
    press = CTRL_C in command and INTERACTIVE not in command
    interrupted = False
    try:
        while proc.poll() is None:
            _descendants(proc.pid, seen)
            if press and not interrupted and any(STEP_LINE.match(x) for x in list(lines)):
                os.killpg(proc.pid, signal.SIGINT)
                interrupted = True
            if time.monotonic() - start > timeout:
                lines.append(f"[test_tutorial] timed out after {timeout:.0f} s\n")
                break
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            _descendants(proc.pid, seen)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        left = _kill_left(seen)
        proc.wait(timeout=30)
        reader.join(timeout=30)
    return Result(command, proc.returncode, "".join(lines), interrupted, time.monotonic() - start, left)


def expected_code(command: str) -> int:
    return STOPPED if CTRL_C in command else 0


def run_page(text: str, cwd: Path, check: bool = True, report=print) -> list[tuple[Block, list[Result]]]:
    """Run every block of the page in ``cwd``; with ``check``, fail at the first command or output that differs."""
    env = environment()
    done = []
    for block in parse(text):
        results = []
        for command in block.commands:
            if INTERACTIVE in command:
                report(f"skipped (interactive): {command}")
                continue
            result = run_command(command, cwd, env)
            results.append(result)
            report(f"{result.seconds:6.1f} s  rc={result.returncode}  {command.splitlines()[0][:100]}")
            if check:
                where = f"docs/tutorial.md, block at line {block.line}: {command}"
                tail = result.output[-6000:]
                assert not result.left_behind, f"{where}\nleft processes behind: {result.left_behind}"
                if expected_code(command) == STOPPED:
                    assert result.interrupted, f"{where}\nfinished before the test could press Ctrl-C:\n{tail}"
                assert result.returncode == expected_code(command), (
                    f"{where}\nexit code {result.returncode}, expected {expected_code(command)}:\n{tail}"
                )
        done.append((block, results))
        if check and block.expected:
            output = "".join(r.output for r in results)
            missing = missing_lines(block.expected, output)
            assert not missing, (
                f"docs/tutorial.md, block at line {block.line}: its output lacks\n  {missing[0]}\n"
                f"(after the lines before it, in order). The output:\n{output[-8000:]}"
            )
    return done


# --- the conventions themselves, in process ---


def test_the_page_parses_into_commands_and_outputs():
    blocks = parse(DOC.read_text())
    assert len(blocks) >= 10
    runnable = [c for b in blocks for c in b.commands if INTERACTIVE not in c]
    assert sum(CTRL_C in c for c in runnable) == 1  # the stop-and-resume step
    assert any(INTERACTIVE in c for b in blocks for c in b.commands)  # TensorBoard
    assert all(not c.rstrip().endswith("\\") for b in blocks for c in b.commands)


def test_expected_lines_match_with_elisions_and_numbers():
    output = "[train] step     2/8 | loss 7.12 | ppl 1,234.5\nother\nrun /tmp/x/runs/tutorial/lev  global_step8\n"
    step = "[train] step     10/60 | loss 8.2262 | ppl 3737.60"
    assert missing_lines([step, "...", "run .../lev  global_step60"], output) == []
    assert missing_lines(["run ...", step], output) == [step]  # in order
    assert missing_lines(["[train] step 10/60 | gnorm ..."], output) == ["[train] step 10/60 | gnorm ..."]
    assert missing_lines(["unseen  35  10  11.35  85001.99"], "unseen   0   0   -   -") == []  # an empty cell


def test_commands_keep_their_continuation_lines():
    assert commands(["a \\", "  b", "", "c"]) == ["a \\\n  b", "c"]


# --- the page, run ---


@pytest.mark.timeout(600)
def test_the_tutorial_runs_as_written(tmp_path):
    text = scaled(DOC.read_text(), sample_corpus(tmp_path / "stdlib-sample"))
    cwd = work_dir(tmp_path / "repo")
    run_page(text, cwd)
    assert (cwd / "runs/tutorial/hf/model.safetensors").is_file()


if __name__ == "__main__":  # python tests/test_tutorial.py DIR: the page at full scale, each block's output printed
    root = work_dir(Path(sys.argv[1]))
    for block, results in run_page(DOC.read_text(), root, check=False, report=lambda s: print(s, file=sys.stderr)):
        print(f"===== block at line {block.line}")
        for r in results:
            print(f"----- rc={r.returncode} {r.seconds:.1f} s: {r.command}\n{r.output}")
        missing = missing_lines(block.expected, "".join(r.output for r in results))
        if missing:
            print(f"!!!!! the block's text lacks, from: {missing[0]}", file=sys.stderr)
