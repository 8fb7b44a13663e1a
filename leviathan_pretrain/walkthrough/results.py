"""What the demo prints about its run (``python -m leviathan_pretrain.demo``): the losses, the checkpoint and
TensorBoard after training, and what the evaluation report's figures mean for this small model.
"""

from __future__ import annotations

import sys
from pathlib import Path

from common.exit_codes import EXIT_REQUEUE
from common.fileio import read_json
from leviathan_pretrain.rundir import train_log
from leviathan_pretrain.rundir.layout import RunLayout


def print_results(run_dir: Path, rc: int) -> None:
    """The losses, the checkpoint and TensorBoard of the run, and what the trainer's exit code ``rc`` means."""
    print("[demo] results", flush=True)
    layout = RunLayout(run_dir)
    if layout.train_log.is_file():
        recs = list(train_log.records(layout.train_log))
        train = [r for r in recs if "loss" in r]
        evals = [r for r in recs if "valid_loss" in r]
        if train:
            print(
                f"[demo] train loss: step 1 {train[0]['loss']:.3f} -> step {train[-1]['step']} {train[-1]['loss']:.3f}"
            )
        if evals:
            print(
                f"[demo] validation loss at step {evals[-1]['step']}: {evals[-1]['valid_loss']:.3f} "
                f"(perplexity {evals[-1]['valid_perplexity']:.1f})"
            )
    ck = layout.checkpoints
    if (ck / "latest").is_file():
        note = "training complete; --overwrite trains again" if rc == 0 else "re-run to continue from it"
        print(f"[demo] checkpoint: {ck / (ck / 'latest').read_text().strip()}  ({note})")
    in_venv = sys.prefix != sys.base_prefix  # tensorboard is the venv's: on the PATH once it is activated
    active = f"  (after . {_short(Path(sys.prefix))}/bin/activate)" if in_venv else ""
    print(f"[demo] TensorBoard: tensorboard --logdir {layout.events}{active}")
    if rc == EXIT_REQUEUE:
        print("[demo] training stopped early with a checkpoint; run the demo again to continue")
    elif rc != 0:
        print(f"[demo] error: training failed (exit {rc})", file=sys.stderr)


def _short(path: Path) -> str:
    """``path`` relative to the current directory when it is below it (``.venv``), else as it is."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def explain(run_dir: Path) -> None:
    """What the latest report's figures mean for this small model trained on Python sources (a few lines)."""
    layout = RunLayout(run_dir)
    try:
        tag = (layout.checkpoints / "latest").read_text().strip()
    except OSError:
        return
    report = read_json(layout.report(tag))
    held = (report.get("heldout") or [{}])[0]
    if "ppl" not in held:
        return
    print(
        f"[demo] what the figures mean: on {held.get('tokens', 0):,} held-out tokens of Python sources the model's "
        f"perplexity is {held['ppl']:.1f}: on average it is as unsure as a uniform pick among that many tokens, after "
        f"{report.get('tokens_seen', 0):,} training tokens (the trainer's validation figure is the same loss on a "
        "sample of a few batches, so it differs a little)"
    )
    buckets = [  # the buckets with enough targets to mean something (the unseen and rarest hold a handful)
        b for b in (report.get("frequency") or {}).get("buckets", []) if (b.get("tokens") or 0) >= 1000
    ]
    if len(buckets) >= 2:
        rare, common = buckets[0], buckets[-1]
        print(
            f"[demo] by training frequency: common tokens ({common['name']} of the training tokens) have perplexity "
            f"{common['ppl']:,.1f}, rare ones ({rare['name']}) {rare['ppl']:,.0f}: the paper's claim for LEV is a gain "
            "on rare tokens for 200M-1.2B models; a model this small, trained this briefly, does not test it"
        )
    wiki = report.get("wikitext")
    if wiki:
        print(
            f"[demo] WikiText word perplexity {wiki['word_ppl']:,.0f}: English prose, which a model trained only on "
            "Python code has never seen; a very high figure is expected here (it shows the evaluation runs)"
        )
