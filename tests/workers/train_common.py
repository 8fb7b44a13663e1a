"""Shared helpers of the trainer tests: a tiny model, synthetic shards, bundled launches with cached results.

Each multi-process launch runs several trainings (``tests/workers/train_runs.py``) and is run once per
pytest session (``functools.cache``): the trajectory, resume, NaN and TensorBoard tests read the same runs.
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.multiproc import REPO, base_env, run_ranks

CONFIG = str(REPO / "configs" / "tiny-cpu-lev.yaml")
# The tiny-cpu config, shrunk further so that a 40-step run takes seconds on 2 cores.
TINY = [
    "model.vocab_size=512",
    "model.hidden_size=64",
    "model.num_layers=2",
    "model.num_attention_heads=4",
    "model.seq_length=64",
    "model.lev.seed_dim=16",
    "model.lev.heads=4",
    "model.lev.rank=8",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "train.eval_interval=10",
    "train.eval_iters=2",
    "data.split=90,8,2",
    "logging.log_interval=5",
    "optim.lr=3e-3",
    "optim.min_lr=3e-4",
    "optim.warmup_steps=2",
    "parallel.device=cpu",
    "parallel.precision=fp32",
    "checkpoint.save_interval=10",
    "checkpoint.keep_last=2",
]


@functools.cache
def workdir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="lev-train-tests-"))
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    return d


@functools.cache
def shard() -> str:
    """One synthetic shard (200 documents, ~32k tokens, vocab 512, with counts.npy)."""
    prefix = str(workdir() / "data" / "synth")
    subprocess.run(
        [sys.executable, str(REPO / "tests/workers/train_data.py"), prefix],
        check=True,
        cwd=REPO,
        env=base_env(),
        capture_output=True,
        timeout=120,
    )
    return prefix


def overrides(name: str, *extra: str) -> list[str]:
    return TINY + [f"data.prefixes=[{shard()}]", f"train.out_dir={workdir() / name}", *extra]


def spec(name: str, *extra: str) -> dict:
    return {"name": name, "config": CONFIG, "overrides": overrides(name, *extra)}


def launch(tag: str, specs: list[dict], nprocs: int, timeout: float = 300) -> dict:
    """Run ``specs`` in one launch; returns {run name: {rank: exit code}} and the per-rank outputs.

    Every rank must exit 0 and report a result for every run (a failure shows all ranks' output)."""
    path = workdir() / f"{tag}.json"
    path.write_text(json.dumps(specs))
    results = run_ranks(["tests/workers/train_runs.py", str(path)], nprocs=nprocs, timeout=timeout)
    codes: dict = {}
    errors: dict = {}
    for r in results:
        for line in r.output.splitlines():
            if line.startswith("RESULT "):
                rec = json.loads(line[len("RESULT ") :])
                codes.setdefault(rec["name"], {})[rec["rank"]] = rec.get("code")
                if rec.get("error"):
                    errors.setdefault(rec["name"], {})[rec["rank"]] = f"{rec['error']}: {rec['message']}"
    outputs = "\n".join(f"--- rank {r.rank} ---\n{r.output[-4000:]}" for r in results)
    for s in specs:
        assert len(codes.get(s["name"], {})) == nprocs, f"run {s['name']} reported no result on every rank\n{outputs}"
    return {"codes": codes, "errors": errors, "outputs": {r.rank: r.output for r in results}}


def records(name: str) -> list[dict]:
    path = workdir() / name / "train_log.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def losses(name: str) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(name) if "loss" in r}


def events(name: str, what: str) -> list[dict]:
    return [r for r in records(name) if r.get("event") == what]


# ---- the bundled launches (each once per session) ----
# Every trajectory run uses the 40-step schedule and stops at step 20 (train.exit_at_step), so its first
# 20 losses are comparable with the first 20 of the uninterrupted 40-step runs.
SCHEDULE = 40
TRAJ = (f"train.steps={SCHEDULE}", "train.exit_at_step=20")
FULL = (f"train.steps={SCHEDULE}",)
PART = 20  # where the interrupted FULL runs stop (a checkpoint), resumed in a fresh launch to the end
PP2 = ("parallel.zero_stage=1", "parallel.pipeline_parallel=2")
TP2_SP = ("parallel.tensor_parallel=2", "parallel.sequence_parallel=true")
SP_TRAJ = (f"train.steps={SCHEDULE}", "train.exit_at_step=10")  # sequence-parallel runs: TRAJ's first 10 steps
BF16 = ("parallel.precision=bf16", "parallel.zero_stage=1")
# configs/7b-lev.yaml at 4 layers of width 64 and the tiny shard's vocabulary, with its TP 2 + sequence parallelism
# (and bf16, ZeRO 1) kept and PP 2 and recompute added: the layout of a 7B run, two optimizer steps on the CPU
SMALL_7B_OWN = ("train.", "model.num_layers", "logging.", "checkpoint.", "parallel.precision")  # set below / kept
SMALL_7B = [
    *(
        o
        for o in TINY
        if not o.startswith(("train.", "model.num_layers", "logging.", "checkpoint.", "parallel.precision"))
    ),
    "model.num_layers=4",
    "model.ffn_hidden_size=172",
    "parallel.pipeline_parallel=2",
    "model.recompute=full",
    "model.recompute_layers=1",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "train.steps=2",
    "train.eval_interval=2",
    "train.eval_iters=1",
    "optim.warmup_steps=1",
    "logging.log_interval=1",
]


@functools.cache
def single_process_runs() -> dict:
    return launch(
        "single",
        [
            spec("ref", *TRAJ, "parallel.zero_stage=0"),
            spec("ref_pipe", *TRAJ, "parallel.zero_stage=1", "parallel.pipeline_engine=true"),
            spec(
                "ref_pipe_tied", *TRAJ, "parallel.zero_stage=1", "parallel.pipeline_engine=true", "model.variant=tied"
            ),
            {
                **spec(
                    "nan_skip",
                    "train.steps=8",
                    "train.eval_interval=1",
                    "train.max_bad_steps=3",
                    "parallel.zero_stage=0",
                    "logging.log_interval=1",
                    "checkpoint.save_interval=1",
                    "checkpoint.keep_last=8",
                ),
                "nan_steps": [3, 4],
            },
        ],
        nprocs=1,
    )


@functools.cache
def dp_tp_runs() -> dict:
    return launch(
        "dp_tp",
        [
            spec("dp2_z1", *TRAJ, "parallel.zero_stage=1"),
            spec("dp2_z2_full", *FULL, "parallel.zero_stage=2"),
            spec("dp2_z2_part", *FULL, "parallel.zero_stage=2", f"train.exit_at_step={PART}"),
            spec("tp2", *TRAJ, "parallel.zero_stage=1", "parallel.tensor_parallel=2", "logging.log_interval=1"),
            {
                **spec("nan_one_rank", "train.steps=6", "train.eval_interval=0", "parallel.zero_stage=1"),
                "nan_steps": [3],
                "nan_rank": 1,
            },
            spec("bad_batch", "train.global_batch_size=6", "train.micro_batch_size=2"),  # 6 % (2 x DP 2) != 0
            {
                "name": "resume_false",
                "config": CONFIG,  # a fresh start into dp2_z1's checkpoints is refused
                "overrides": overrides("dp2_z1", *TRAJ, "parallel.zero_stage=1", "checkpoint.resume=false"),
            },
            spec("dp2_z3", *TRAJ, "parallel.zero_stage=3"),
            spec("dp2_z0", *TRAJ, "parallel.zero_stage=0", "train.eval_interval=0"),
            spec("dp2_z2", *TRAJ, "parallel.zero_stage=2", "train.eval_interval=0"),
            # parallel.sequence_parallel (tests/test_sequence_parallel.py): tp2's run with SP, at ZeRO 1 and 3, and a
            # bf16 pair (BF16_Optimizer's immediate_grad_update takes each gradient in a hook during backward)
            spec("tp2_sp", *SP_TRAJ, *TP2_SP, "parallel.zero_stage=1", "logging.log_interval=1"),
            spec("tp2_sp_z3", *SP_TRAJ, *TP2_SP, "parallel.zero_stage=3", "train.eval_interval=0"),
            spec("tp2_bf16", *SP_TRAJ, *BF16, "parallel.tensor_parallel=2", "train.eval_interval=0"),
            spec("tp2_sp_bf16", *SP_TRAJ, *BF16, *TP2_SP, "train.eval_interval=0"),
        ],
        nprocs=2,
    )


RESHARD_STOP = 26


@functools.cache
def reshard_runs() -> dict:
    """The DP=2 runs stopped at step 20 (ZeRO 0/1/2/3) resumed on ONE process (a requeue on fewer nodes) to step
    26; and the TP=2 run resumed at TP=1, which must be refused."""
    dp_tp_runs()
    stop = f"train.exit_at_step={RESHARD_STOP}"
    return launch(
        "reshard",
        [
            *[
                spec(f"dp2_z{z}", f"train.steps={SCHEDULE}", stop, f"parallel.zero_stage={z}", "train.eval_interval=0")
                for z in (0, 1, 2, 3)
            ],
            spec("tp2", *TRAJ, "parallel.zero_stage=1", "parallel.tensor_parallel=1"),
        ],
        nprocs=1,
    )


@functools.cache
def pipe_runs() -> dict:
    dp_tp_runs()  # resumes the interrupted ZeRO-2 run in a fresh launch
    return launch(
        "pipe",
        [
            spec("dp2_z2_part", *FULL, "parallel.zero_stage=2"),
            spec("pp2_full", *FULL, "parallel.zero_stage=1", "parallel.pipeline_parallel=2"),
            spec("pp2_part", *FULL, *PP2, f"train.exit_at_step={PART}"),
            spec("pp2_tied", *TRAJ, "parallel.zero_stage=1", "parallel.pipeline_parallel=2", "model.variant=tied"),
            # model.recompute (tests/test_recompute_tp.py): the runs of pp2_full and dp2_z3, recomputing
            spec("pp2_recompute", *TRAJ, *PP2, "model.recompute=full", "model.recompute_layers=1"),
            spec(
                "dp2_z3_recompute",
                *TRAJ,
                "parallel.zero_stage=3",
                "model.recompute=selective",
                "model.recompute_modules=[core_attn,mlp]",
            ),  # fmt: skip
        ],
        nprocs=2,
    )


@functools.cache
def pipe_resume_runs() -> dict:
    pipe_runs()
    return launch(
        "pipe_resume", [spec("pp2_part", *FULL, "parallel.zero_stage=1", "parallel.pipeline_parallel=2")], nprocs=2
    )


@functools.cache
def sp_resume_runs() -> dict:
    """tp2_sp's checkpoint (step 10, trained with sequence parallelism) resumed with it off, to step 16."""
    dp_tp_runs()
    over = ("parallel.zero_stage=1", "parallel.tensor_parallel=2", "parallel.sequence_parallel=false")
    return launch("sp_resume", [spec("tp2_sp", f"train.steps={SCHEDULE}", "train.exit_at_step=16", *over)], nprocs=2)


@functools.cache
def four_process_runs() -> dict:
    """PP=2 combined with TP=2 and with DP=2 (4 processes): megatron-core's and DeepSpeed's rank grids agree."""
    return launch(
        "four",
        [
            spec(
                "pp2_tp2",
                f"train.steps={SCHEDULE}",
                "train.exit_at_step=6",
                "parallel.zero_stage=1",
                "parallel.pipeline_parallel=2",
                "parallel.tensor_parallel=2",
                "train.eval_interval=0",
            ),
            spec(
                "pp2_tp2_sp",
                f"train.steps={SCHEDULE}",
                "train.exit_at_step=6",
                "parallel.zero_stage=1",
                "parallel.pipeline_parallel=2",
                *TP2_SP,
                "train.eval_interval=0",
            ),
            {  # configs/7b-lev.yaml shrunk in depth and width, in its own layout plus PP 2 and recompute
                "name": "7b_small",
                "config": str(REPO / "configs" / "7b-lev.yaml"),
                "overrides": [*SMALL_7B, f"data.prefixes=[{shard()}]", f"train.out_dir={workdir() / '7b_small'}"],
            },
            spec(
                "pp2_dp2",
                f"train.steps={SCHEDULE}",
                "train.exit_at_step=6",
                "parallel.zero_stage=1",
                "parallel.pipeline_parallel=2",
                "train.eval_interval=0",
            ),
        ],
        nprocs=4,
        timeout=400,
    )
