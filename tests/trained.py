"""Small trained runs for the evaluation, export and comparison tests: the real trainer, real minipile shards.

``trained(name)`` (the ``trained_run`` fixture in conftest) returns the run directory of one of :data:`RUNS`,
caching it under ``$LEVIATHAN_TEST_CACHE/trained/`` keyed by a hash of the trainer's code and the data, so a second
session reuses it. The first use trains every run not yet cached, in one launch of 2 ranks (gloo) that trains them
one after the other (tests/workers/train_runs.py, the trainer's own ``trainer.loop.run``: each rank process pays
its ~6 s of imports once, not once per run; the evaluation, export and comparison tests use them all). Each run
has checkpoints in the layout its name says (``tp2``: two tensor-parallel shards; ``pp2``: pipeline layer files;
``z3dp2``: ZeRO-3 partitions over two data-parallel ranks), one for every variant, a ``train_log.jsonl`` and
TensorBoard events.

The model: the tiny-cpu body shrunk to 2 layers of width 128 with grouped-query attention (4 heads in 2
groups) at sequence 128, on the 8k minipile tokenizer; 30 steps of 8 x 128 tokens (a validation at 15 and 30).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

from tests.multiproc import REPO, run_ranks

STEPS = 30  # fewer (16) leave the TIED run greedy-generating only newlines: tests/test_lm_eval.py needs more
MARK = ".leviathan-test-run"  # in each run directory this cache trained: the only directories it deletes
BODY = [
    "model.vocab_size=8000",
    "model.hidden_size=128",
    "model.num_layers=2",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.seq_length=128",
    "model.lev.seed_dim=16",
    "model.lev.heads=4",
    "model.lev.knots=8",
    "model.lev.rank=8",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    f"train.steps={STEPS}",
    f"train.eval_interval={STEPS // 2}",
    "train.eval_iters=2",
    f"checkpoint.save_interval={STEPS}",
    "logging.log_interval=5",
    "optim.lr=3e-3",
    "optim.min_lr=3e-4",
    "optim.warmup_steps=3",
    "parallel.device=cpu",
]
# name -> (variant, extra overrides); every run uses 2 ranks
RUNS = {
    "lev-tp2": ("lev", ["parallel.tensor_parallel=2"]),
    "tied-tp2": ("tied", ["parallel.tensor_parallel=2"]),
    "untied-pp2": ("untied", ["parallel.pipeline_parallel=2"]),
    "lev-z3dp2": ("lev", ["parallel.zero_stage=3"]),
    "albert-tp2": ("albert", ["parallel.tensor_parallel=2"]),
    "flat_mlp-tp2": ("flat_mlp", ["parallel.tensor_parallel=2"]),
    "factored_mlp-tp2": ("factored_mlp", ["parallel.tensor_parallel=2"]),
}


# the code that decides what a trained run's files hold (evaluation/export code changing must not retrain)
TRAINER_CODE = ("model", "trainer", "config/schema.py", "config/loader.py", "parallel/groups.py", "train.py")


def _code_key(*extra: str) -> str:
    h = hashlib.sha256("\0".join(extra).encode())
    h.update((REPO / "tests" / "workers" / "train_runs.py").read_bytes())  # what trains them
    for name in TRAINER_CODE:
        path = REPO / "leviathan_pretrain" / name
        for p in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            h.update(p.read_bytes())
    return h.hexdigest()[:12]


def overrides(name: str, shards: dict, tokenizer: Path, out_dir: Path) -> list[str]:
    variant, extra = RUNS[name]
    return [
        f"model.variant={variant}",
        *BODY,
        *extra,
        f"data.prefixes=[{shards['train']}]",
        f"data.valid_prefixes=[{shards['val']}]",
        f"data.tokenizer={tokenizer}",
        f"train.out_dir={out_dir}",
    ]


def train_run(name: str, cache: Path, shards: dict, tokenizer: Path) -> Path:
    """The run directory of ``name`` (trained once, then reused). The first call trains every run of :data:`RUNS`
    not yet cached, in one launch, in place under a lock (the config a run records names its own directory); a
    marked directory without ``checkpoints/latest`` is a killed earlier build of this cache and is replaced
    (:func:`claim`)."""
    # keyed by what trains it: the code, the data, and the run's overrides (a changed BODY or STEPS retrains)
    finals = {n: cache / f"{n}-{_code_key(*overrides(n, shards, tokenizer, Path('.')))}" for n in RUNS}
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".runs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        missing = [n for n, d in finals.items() if not (d / "checkpoints" / "latest").is_file()]
        if missing:
            _train(missing, finals, shards, tokenizer, cache)
    prune(cache, finals)
    return finals[name]


def claim(final: Path) -> None:
    """``final`` made empty and marked as this cache's (:data:`MARK`) before a run is trained into it: a killed
    earlier build (marked) is replaced; a directory there without the mark is not ours and is refused, untouched."""
    if final.exists():
        if not (final / MARK).is_file():
            raise AssertionError(f"{final} exists and is not a run this test cache trained (no {MARK}): move it away")
        shutil.rmtree(final)
    final.mkdir(parents=True)
    (final / MARK).write_text("a small trained run of tests/trained.py; its cache may delete it\n")


def prune(cache: Path, finals: dict) -> None:
    """Older builds of each run (the code changed since): ``NAME-KEY`` directories marked as this cache's; nothing
    else in ``cache`` is touched."""
    for n, final in finals.items():
        for old in cache.glob(f"{n}-*"):
            if old != final and re.fullmatch(rf"{re.escape(n)}-[0-9a-f]{{12}}", old.name) and (old / MARK).is_file():
                shutil.rmtree(old, ignore_errors=True)


def _train(names: list[str], finals: dict, shards: dict, tokenizer: Path, cache: Path) -> None:
    config = str(REPO / "configs" / "tiny-cpu-lev.yaml")
    specs = []
    for n in names:
        claim(finals[n])
        specs.append({"name": n, "config": config, "overrides": overrides(n, shards, tokenizer, finals[n])})
    path = cache / f".runs-{os.getpid()}.json"
    path.write_text(json.dumps(specs))
    try:  # ~15 s of imports per rank, then each run's steps in seconds (420 s: a loaded machine)
        results = run_ranks(["tests/workers/train_runs.py", str(path)], nprocs=2, timeout=420)
    finally:
        path.unlink(missing_ok=True)
    codes = {}
    for r in results:
        for line in r.output.splitlines():
            if line.startswith("RESULT "):
                rec = json.loads(line[len("RESULT ") :])
                codes.setdefault(rec["name"], {})[rec["rank"]] = rec.get("code")
    outputs = "\n".join(f"--- rank {r.rank} ---\n{r.output[-4000:]}" for r in results)
    for n in names:
        assert codes.get(n) == {0: 0, 1: 0}, f"trained run {n}: exit codes {codes.get(n)}\n{outputs}"
        assert (finals[n] / "checkpoints" / "latest").is_file(), f"trained run {n}: no checkpoint\n{outputs}"
