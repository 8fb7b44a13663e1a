"""Small trained runs for the evaluation, export and comparison tests: the real trainer, real minipile shards.

``trained(name)`` (the ``trained_run`` fixture in conftest) returns the run directory of one of :data:`RUNS`,
training it on first use (2 ranks, gloo) and caching it under ``$LEVIATHAN_TEST_CACHE/trained/`` keyed by
a hash of the trainer's code and the data, so a second session reuses it. Each run has checkpoints in the
layout its name says (``tp2``: two tensor-parallel shards; ``pp2``: pipeline layer files; ``z3dp2``: ZeRO-3
partitions over two data-parallel ranks), one for every variant, a ``train_log.jsonl`` and TensorBoard events.

The model: the tiny-cpu body shrunk to 2 layers of width 128 with grouped-query attention (4 heads in 2
groups) at sequence 128, on the 8k minipile tokenizer; 30 steps of 8 x 128 tokens.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
from pathlib import Path

from tests.multiproc import REPO, run_ranks

STEPS = 30
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
    "train.eval_interval=15",
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
    """The run directory of ``name`` (trained once, then reused). Trained in place under a lock (the config it
    records names its own directory); a directory without ``checkpoints/latest`` is a killed earlier build of
    this cache and is replaced."""
    key = _code_key(name, str(shards), str(tokenizer))
    final = cache / f"{name}-{key}"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "checkpoints" / "latest").is_file():
            return final
        shutil.rmtree(final, ignore_errors=True)
        args = ["-m", "leviathan_pretrain.train", "--config", str(REPO / "configs" / "tiny-cpu-lev.yaml")]
        run_ranks([*args, *overrides(name, shards, tokenizer, final)], nprocs=2, timeout=420)
    for old in cache.glob(f"{name}-*"):  # older builds of this run: the code changed since
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final
