"""Evaluation's tokens/s against the trainer's, for the same model on the same machine, side by side:
``python benchmarks/bench_eval.py``.

The model and data are the demo's (``make demo``: the ``tiny-cpu`` LEV config, the corpus of Python sources and its
8k tokenizer, prepared by ``data_prep.data_demo`` into ``--work``, reused when there). One reference run is trained
for ``--steps`` steps; then each of ``--pairs`` pairs measures, one right after the other (a noisy neighbour slows
both alike):

- **train**: the demo's training command (``--nprocs`` local ranks, tensor parallel), ``--steps`` steps in a fresh
  directory; its tokens/s is the median of the logged ``perf/tokens_per_s`` after the first log interval (the
  global tokens of a step over the step's time: forward, backward and optimizer);
- **evaluate, N ranks**: ``launchers/local.py -n N -- -m leviathan_pretrain.evaluate`` of the reference run
  (data-parallel, one thread per rank as the trainer's ranks; what ``make demo`` runs);
- **evaluate, 1 process**: ``python -m leviathan_pretrain.evaluate`` (one process, torch's default threads).

An evaluation's tokens/s is the report's own ``tokens_per_s`` of the held-out set: target tokens scored per second
of scoring (the model's load, the frequency buckets and the geometry are not in it). With ``--wikitext FILE``
WikiText is scored too, and its rate is given both per scored target and per token through the model (its sliding
window, stride = context / 2 by default, puts every target through the model about twice), in the N-rank
evaluation only (all 499k tokens of wiki.test.raw: about two minutes on 2 cores).

The table ends with evaluate / train per pair and their median; the target is >= 2.5 (a forward pass is
about a third of a training step's work).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TARGET = 2.5


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python benchmarks/bench_eval.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default=None, help="data and runs (default: a temporary directory, removed)")
    ap.add_argument("--pairs", type=int, default=3, help="train/evaluate pairs (3)")
    ap.add_argument("--steps", type=int, default=30, help="training steps per measurement (30)")
    ap.add_argument("--nprocs", type=int, default=2, help="local ranks of the training and the N-rank evaluation")
    ap.add_argument("--max-tokens", type=int, default=100_000, help="held-out tokens scored per evaluation")
    ap.add_argument("--wikitext", default=None, metavar="FILE", help="also score WikiText-103's raw test file")
    return ap.parse_args(argv)


def run(cmd: list[str], what: str) -> None:
    """``cmd`` from the repository; exits naming ``what`` and the command's last output when it fails."""
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"error: {what} failed (exit {done.returncode}): {' '.join(cmd)}\n{done.stdout[-2000:]}"
                 f"{done.stderr[-3000:]}")  # fmt: skip


def fresh_request(out: Path, steps: int, nprocs: int):
    """The demo's request for ``steps`` steps into ``out``, its training directory ``out/train`` fresh: one the demo
    (or this benchmark) made is replaced, as ``demo --overwrite`` does; any other is refused, nothing deleted."""
    from leviathan_pretrain import demo
    from leviathan_pretrain.walkthrough.steps import DemoError, prepare_run_dir

    req = demo.parse(["--out", str(out), "--steps", str(steps), "--nprocs", str(nprocs), "logging.log_interval=5"])
    try:
        prepare_run_dir(req.run_dir, overwrite=True)
    except DemoError as e:
        sys.exit(f"error: {e}")
    return req


def train_tokens_per_s(out: Path, data, steps: int, nprocs: int) -> float:
    """The demo's training command for ``steps`` steps into ``out/train`` (fresh); the median logged tokens/s
    after the first log interval."""
    from leviathan_pretrain.rundir import train_log
    from leviathan_pretrain.rundir.layout import RunLayout
    from leviathan_pretrain.walkthrough.steps import trainer_command

    req = fresh_request(out, steps, nprocs)
    run(trainer_command(req, data), "training")
    rates = [r["perf/tokens_per_s"] for r in train_log.records(RunLayout(req.run_dir).train_log)
             if "perf/tokens_per_s" in r]  # fmt: skip
    if len(rates) < 2:
        sys.exit(f"error: {out}: fewer than 2 logged tokens/s figures; give more --steps")
    return statistics.median(rates[1:])


def eval_rates(run_dir: Path, ranks: int, args, report: Path) -> dict:
    """One evaluation of ``run_dir`` on ``ranks`` local ranks (1: a plain process); its report's scoring rates."""
    cmd = ["-m", "leviathan_pretrain.evaluate", "--run", str(run_dir), "--max-tokens", str(args.max_tokens),
           "--no-frequency", "--no-geometry", "--no-tensorboard", "--quiet", "--out", str(report)]  # fmt: skip
    cmd += ["--wikitext", args.wikitext] if args.wikitext and ranks > 1 else []  # (1 process: held-out only)
    local = [str(REPO / "launchers/local.py"), "-n", str(ranks), "--"]
    launch = [sys.executable, *(local if ranks > 1 else [])]
    run([*launch, *cmd], f"evaluation on {ranks} rank(s)")
    rep = json.loads(report.read_text())
    rates = {"heldout": rep["heldout"][0]["tokens_per_s"]}
    if rep.get("wikitext"):
        rates["wikitext"] = rep["wikitext"]["tokens_per_s"]
        rates["wikitext_model"] = rep["wikitext"]["model_tokens_per_s"]
    return rates


def main(argv=None) -> int:
    args = parse(argv)
    from data_prep.demo_steps import run_demo
    from leviathan_pretrain.data.tokenizer import open_cached
    from leviathan_pretrain.walkthrough.steps import Data

    tmp = None if args.work else tempfile.mkdtemp(prefix="bench_eval-")
    work = Path(args.work or tmp)
    try:
        made = run_demo(work / "demo")
        tok = made["tokenizer"]
        data = Data(made["train_prefix"], made["val_prefix"], tok, open_cached(tok).vocab_size)
        ref = work / "reference"
        print(f"[bench_eval] reference run: {args.steps} steps on {args.nprocs} ranks -> {ref}", flush=True)
        train_tokens_per_s(ref, data, args.steps, args.nprocs)
        rows = []
        for i in range(args.pairs):
            t = train_tokens_per_s(work / "pair", data, args.steps, args.nprocs)
            n = eval_rates(ref / "train", args.nprocs, args, work / "eval-n.json")
            one = eval_rates(ref / "train", 1, args, work / "eval-1.json")
            rows.append((t, n, one))
            print(f"[bench_eval] pair {i + 1}/{args.pairs}: train {t:,.0f} tok/s, evaluate on {args.nprocs} ranks "
                  f"{n['heldout']:,.0f}, on 1 process {one['heldout']:,.0f}", flush=True)  # fmt: skip
        print_table(rows, args)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


def print_table(rows, args) -> None:
    n = args.nprocs
    print(f"\nheld-out scoring vs training, tiny-cpu LEV (the demo's model), {n} local ranks for training and the "
          f"{n}-rank evaluation, {args.max_tokens:,} held-out tokens\n")  # fmt: skip
    head = f"{'pair':>4} {'train tok/s':>12} {f'eval {n} ranks':>13} {'ratio':>6} {'eval 1 proc':>12} {'ratio':>6}"
    if args.wikitext:
        head += f" {'wikitext targets/s':>19} {'model tok/s':>12} {'ratio':>6}"
    print(head)
    ratios_n, ratios_1, ratios_w = [], [], []
    for i, (t, e, one) in enumerate(rows, 1):
        ratios_n.append(e["heldout"] / t)
        ratios_1.append(one["heldout"] / t)
        line = f"{i:>4} {t:>12,.0f} {e['heldout']:>13,.0f} {ratios_n[-1]:>6.2f}"
        line += f" {one['heldout']:>12,.0f} {ratios_1[-1]:>6.2f}"
        if args.wikitext:
            ratios_w.append(e["wikitext_model"] / t)
            line += f" {e['wikitext']:>19,.0f} {e['wikitext_model']:>12,.0f} {ratios_w[-1]:>6.2f}"
        print(line)
    med = statistics.median
    print(f"\nmedian evaluate / train: {med(ratios_n):.2f} ({n} ranks, what make demo runs), {med(ratios_1):.2f} "
          f"(1 process); target >= {TARGET}: {'met' if med(ratios_n) >= TARGET else 'NOT met'}")  # fmt: skip
    if ratios_w:
        print(f"WikiText (sliding window): {med(ratios_w):.2f} x the trainer's tokens/s through the model")


if __name__ == "__main__":
    sys.exit(main())
