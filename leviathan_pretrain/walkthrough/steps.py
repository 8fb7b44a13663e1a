"""The demo's steps (``python -m leviathan_pretrain.demo``, whose docstring lists them): its request, the data
(``data_prep.demo_steps.run_demo`` or the user's shards), the training directory it marks as its own, and the user's
commands it runs as subprocesses (the trainer on local processes, the evaluation on the same processes, the export),
each skipped, and said so, when its output for the latest checkpoint is already there; the time each step took.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from common.fileio import read_json
from data_prep.demo_steps import run_demo
from leviathan_pretrain.data.tokenizer import open_cached
from leviathan_pretrain.rundir.layout import RunLayout

REPO = Path(__file__).resolve().parents[2]
DEMO_MARK = ".leviathan-demo-run"  # the training directory the demo created (the only one --overwrite deletes)


@dataclass
class Clock:
    """Wall-clock seconds per step of the demo, printed at its end (set-up, run by ``make``, is not counted)."""

    t0: float = field(default_factory=time.monotonic)
    steps: dict = field(default_factory=dict)

    def lap(self, step: str, since: float) -> float:
        now = time.monotonic()
        self.steps[step] = self.steps.get(step, 0.0) + now - since
        return now

    def summary(self) -> str:
        parts = ", ".join(f"{k} {_mmss(v)}" for k, v in self.steps.items())
        return f"[demo] done in {_mmss(time.monotonic() - self.t0)} (after set-up; {parts})"


def _mmss(seconds: float) -> str:
    if seconds < 9.95:
        return f"{seconds:.1f} s"
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s:02d} s" if m else f"{s} s"


class DemoError(Exception):
    """Bad input: the command prints ``error: <message>`` and exits EXIT_BAD_INPUT."""


@dataclass(frozen=True)
class Request:
    """The command line, read once."""

    out: Path
    config: str
    nprocs: int
    steps: int
    data_prefix: str | None
    tokenizer: str | None
    overwrite: bool
    wikitext: str | None
    evaluate: bool
    overrides: tuple[str, ...]

    @property
    def run_dir(self) -> Path:
        return self.out / "train"

    @property
    def hf_dir(self) -> Path:
        return self.out / "hf"


@dataclass(frozen=True)
class Data:
    """The training data: shard prefixes and the tokenizer they were written with (None: the config's)."""

    prefix: str
    valid: str | None
    tokenizer: str | None
    vocab: int | None


def prepare_data(req: Request) -> Data:
    """Step 1: ``--data-prefix`` as given, else ``data_prep.demo_steps.run_demo`` (steps already done are reused)."""
    if req.tokenizer and not req.data_prefix:
        raise DemoError("--tokenizer goes with --data-prefix (the demo's own data is encoded with its own tokenizer)")
    if req.data_prefix:
        data = Data(req.data_prefix, None, req.tokenizer, None)
    else:
        print(f"[demo] data: data_prep.demo_steps.run_demo({str(req.out)!r})", flush=True)
        made = run_demo(req.out)
        tokenizer = made["tokenizer"]
        data = Data(made["train_prefix"], made["val_prefix"], tokenizer, open_cached(tokenizer).vocab_size)
    tok = data.tokenizer
    print(
        f"[demo] training data: {data.prefix}"
        + (f", validation {data.valid}" if data.valid else "")
        + (f" (tokenizer {tok}" + (f", {data.vocab} ids)" if data.vocab else ")") if tok else ""),
        flush=True,
    )
    return data


def prepare_run_dir(run_dir: Path, overwrite: bool) -> None:
    """The training directory, marked as the demo's; ``--overwrite`` deletes only one the demo created."""
    if overwrite and run_dir.exists():
        if not (run_dir / DEMO_MARK).is_file():  # never delete a directory the demo did not create
            raise DemoError(
                f"--overwrite: {run_dir} was not created by the demo (no {DEMO_MARK}); remove it yourself "
                "or use another --out"
            )
        shutil.rmtree(run_dir)
    if not run_dir.exists():
        run_dir.mkdir(parents=True)
        (run_dir / DEMO_MARK).write_text(
            "created by python -m leviathan_pretrain.demo; --overwrite deletes this directory\n"
        )


def trainer_command(req: Request, data: Data) -> list[str]:
    """``launchers/local.py -n N -- -m leviathan_pretrain.train --config C <overrides>``."""
    overrides = [
        f"data.prefixes=[{data.prefix}]",
        f"train.out_dir={req.run_dir}",
        f"train.steps={req.steps}",
        f"parallel.tensor_parallel={req.nprocs}",
        "train.eval_interval=50",
        "train.eval_iters=4",
        "checkpoint.save_interval=50",
        "logging.log_interval=10",
    ]
    overrides.append(f"data.valid_prefixes=[{data.valid}]" if data.valid else "data.split=95,5,0")
    if data.tokenizer:
        overrides += [f"data.tokenizer={data.tokenizer}", "model.vocab_size=null"]  # null: the tokenizer's
    overrides += req.overrides
    launcher = [sys.executable, str(REPO / "launchers/local.py"), "-n", str(req.nprocs), "--"]
    return [*launcher, "-m", "leviathan_pretrain.train", "--config", req.config, *overrides]


def training_complete(req: Request) -> str | None:
    """The latest checkpoint's tag when the run already reached ``--steps`` with this request's settings (no
    overrides that could change it): then the trainer need not start (it would say "already complete")."""
    ck = RunLayout(req.run_dir).checkpoints
    try:
        tag = (ck / "latest").read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    record = read_json(ck / tag / "leviathan.json") if tag else {}
    steps = ((record.get("config") or {}).get("train") or {}).get("steps")
    done = not req.overrides and not req.overwrite and record.get("step") == steps == req.steps
    return tag if done else None


def train(req: Request, data: Data) -> int:
    """Step 2: the trainer on ``--nprocs`` local processes; its exit code."""
    tag = training_complete(req)
    if tag is not None:
        print(f"[demo] training is up to date: {tag} is step {req.steps} of {req.steps} (--overwrite trains again)")
        return 0
    cmd = trainer_command(req, data)
    print(
        f"[demo] training the tiny-cpu LEV model on {req.nprocs} local processes (TP={req.nprocs}):\n"
        f"       {' '.join(cmd[1:])}",
        flush=True,
    )
    return subprocess.call(cmd, cwd=REPO)


def report_up_to_date(run_dir: Path, tag: str, wikitext: str | None) -> bool:
    """Whether ``eval/<tag>.json`` already holds what this evaluation would write: the same checkpoint, and a
    WikiText result when one is asked for (one there already is kept when none is)."""
    report = read_json(RunLayout(run_dir).report(tag))
    return report.get("tag") == tag and (not wikitext or bool(report.get("wikitext")))


def export_up_to_date(run_dir: Path, hf_dir: Path, tag: str) -> bool:
    """Whether ``hf_dir`` holds our export of checkpoint ``tag`` of this run."""
    mark = read_json(hf_dir / "leviathan_export.json")
    same_run = mark.get("source_run") and Path(mark["source_run"]).resolve() == Path(run_dir).resolve()
    return bool(same_run) and mark.get("tag") == tag and (hf_dir / "config.json").is_file()


def _run_step(what: str, cmd: list[str], up_to_date: str | None) -> int:
    """One of the user's commands as a subprocess (``what``: evaluation, export), or, when ``up_to_date`` says why
    its output is already there, nothing but that line; the exit code."""
    if up_to_date:
        print(f"[demo] {up_to_date}")
        return 0
    print(f"[demo] {'evaluating' if what == 'evaluation' else 'exporting'}: {' '.join(cmd[1:])}", flush=True)
    rc = subprocess.call(cmd, cwd=REPO)
    if rc != 0:
        print(f"[demo] error: {what} failed (exit {rc})", file=sys.stderr)
    return rc


def evaluation_command(req: Request) -> list[str]:
    """``launchers/local.py -n N -- -m leviathan_pretrain.evaluate --run RUN [--wikitext FILE]``: the training's
    local processes, data-parallel."""
    launcher = [sys.executable, str(REPO / "launchers/local.py"), "-n", str(req.nprocs), "--"]
    cmd = [*launcher, "-m", "leviathan_pretrain.evaluate", "--run", str(req.run_dir)]
    return cmd + (["--wikitext", req.wikitext] if req.wikitext else [])


def evaluate_and_export(req: Request, clock: Clock | None = None) -> int:
    """Steps 3-4: the user's commands, as subprocesses; each skipped, and said so, when its output is already there
    for this checkpoint (a second ``make demo`` does nothing). The evaluation runs data-parallel on the training's
    ``--nprocs`` local processes, one thread each as the trainer's: on a busy machine one process with every core's
    threads is several times slower."""
    clock = clock or Clock()
    run_dir, hf_dir, wikitext = req.run_dir, req.hf_dir, req.wikitext
    layout = RunLayout(run_dir)
    tag = (layout.checkpoints / "latest").read_text().strip()
    cmd = evaluation_command(req)
    fresh = report_up_to_date(run_dir, tag, wikitext)
    done = f"evaluation of {tag} is up to date: {layout.report(tag)} (delete it to evaluate again)" if fresh else None
    t = time.monotonic()
    rc = _run_step("evaluation", cmd, done)
    t = clock.lap("evaluation", t)
    if rc != 0:
        return rc
    if not read_json(layout.report(tag)).get("wikitext"):
        print("[demo] (no WikiText file: give --wikitext PATH/wiki.test.raw for the zero-shot word perplexity)")
    cmd = [sys.executable, "-m", "leviathan_pretrain.export_hf", "--run", str(run_dir), "--out", str(hf_dir)]
    cmd += ["--overwrite"] if (hf_dir / "leviathan_export.json").is_file() else []  # only our own earlier export
    done = f"export of {tag} is up to date: {hf_dir}" if export_up_to_date(run_dir, hf_dir, tag) else None
    rc = _run_step("export", cmd, done)
    clock.lap("export", t)
    if rc != 0:
        return rc
    print(f"[demo] evaluation report: {layout.report(tag)} (eval/ scalars in TensorBoard too)")
    print(f"[demo] Hugging Face model: {hf_dir}  (transformers: LlamaForCausalLM.from_pretrained({str(hf_dir)!r}))")
    return 0
