"""parallel.sequence_parallel (model/sp.py): the same model as SP off, at TP = 2.

- tests/workers/sp_tp.py (2 ranks, gloo, fp32): the three sequence collectives and their backwards against the
  dense computation; every input variant and every loss implementation, with recompute: the mean loss, per-token
  losses, logits, the head's hidden states and every gradient (this rank's shard) equal to SP off within 1e-5
  relative (in practice the losses are bit-identical and the gradients differ by the norm weights' summation order,
  ~1e-7); the hidden states between layers are s / tp long, and every norm sums its weight's gradient over TP;
- config: refused at TP = 1, for a sequence that does not split over TP, and with model.compile;
- the DeepSpeed config turns the pipeline engine's activation partitioning off under SP.
Then training runs under SP against the same runs without it (ZeRO 1 and 3, bf16, PP 2 x TP 2), a resume without
SP, and configs/7b-lev.yaml's layout at reduced size, from tests/workers/train_common.py's bundled launches.
"""

import json
import math

import pytest

from leviathan_pretrain.config import load_config
from leviathan_pretrain.config.loader import ConfigError
from leviathan_pretrain.trainer.engine import deepspeed_config
from tests.multiproc import run_ranks
from tests.workers.train_common import dp_tp_runs, events, four_process_runs, records, sp_resume_runs, workdir

CASES = [
    "lev+fused",
    "lev+megatron+model.recompute=full",
    "tied+fused",
    "tied+megatron+model.recompute=selective+model.recompute_modules=[core_attn,mlp]",
    "untied+fused",
    "untied+megatron",
    "albert+fused",
    "flat_mlp+fused",
    "factored_mlp+megatron",
]


@pytest.mark.multiproc
def test_every_variant_and_loss_equals_sp_off_at_tp2():
    res = run_ranks(["tests/workers/sp_tp.py", ";".join(CASES)], nprocs=2, timeout=400)
    out = [json.loads(line[7:]) for r in res for line in r.output.splitlines() if line.startswith("RESULT ")]
    assert sorted(o["rank"] for o in out) == [0, 1]
    for per_rank in out:
        assert all(max(v) <= 1e-6 for v in per_rank["collectives"].values()), per_rank["collectives"]
        cases = {k: v for k, v in per_rank.items() if k not in ("rank", "collectives")}
        assert len(cases) == len(CASES)
        for name, r in cases.items():
            for key in ("loss", "per_token", "logits", "hidden", "grad"):
                assert r[key] <= 1e-5, (name, key, r)
            assert r["n_grads"] >= 14, (name, r)
            assert r["seq_in_layer"] == [16, 32], (name, r)  # s / tp under SP, s without
            assert r["sp_norms"] == [5, 0], (name, r)  # 2 per layer and the final norm
            assert r["same_state_dict"], (name, r)  # keys and shapes: checkpoints load either way


def test_refused_where_it_cannot_work():
    with pytest.raises(ConfigError, match=r"parallel\.sequence_parallel: .*tensor_parallel=1"):
        load_config(None, ["parallel.sequence_parallel=true"])
    base = ["parallel.sequence_parallel=true", "parallel.tensor_parallel=2", "model.vocab_size=1000"]
    with pytest.raises(ConfigError, match=r"does not divide model\.seq_length=255; set model\.seq_length"):
        load_config(None, [*base, "model.seq_length=255"])
    with pytest.raises(ConfigError, match=r"parallel\.sequence_parallel: with model\.compile=true"):
        load_config(None, [*base, "model.compile=true"])
    assert load_config(None, base).parallel.sequence_parallel


def test_pipeline_engine_keeps_each_ranks_slice_under_sp():
    """DeepSpeed's pipeline engine by default splits a stage's output over the TP ranks and all-gathers it on the
    next stage, right only when every TP rank holds the same tensor; under SP each holds its own slice."""
    over = ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2", "parallel.zero_stage=1"]
    cfg = load_config(None, [*over, "model.vocab_size=1000"])
    assert "pipeline" not in deepspeed_config(cfg, dp=1, own_clipping=True)
    cfg = load_config(None, [*over, "model.vocab_size=1000", "parallel.sequence_parallel=true"])
    assert deepspeed_config(cfg, dp=1, own_clipping=True)["pipeline"] == {
        "pipe_partitioned": False,
        "grad_partitioned": False,
    }


def _steps(name, key="loss", last=10):
    recs = {r["step"]: r[key] for r in records(name) if key in r}
    return [recs[s] for s in range(1, last + 1)]


def _rel(got, want):
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["tp2_sp", "tp2_sp_z3"])
def test_training_with_sp_follows_tp2_without(name):
    """10 steps at TP 2 with SP (ZeRO 1; ZeRO 3, whose hooks take each gradient during backward) follow the same
    run without SP: losses within 1e-5 relative, the clipped gradient norm (which a norm weight's gradient not
    summed over TP would change at once) within 1e-4."""
    runs = dp_tp_runs()
    assert runs["codes"][name] == {0: 75, 1: 75}, runs["errors"].get(name)
    assert json.loads((workdir() / name / "config.json").read_text())["parallel"]["sequence_parallel"] is True
    assert _rel(_steps(name), _steps("tp2")) <= 1e-5
    assert _rel(_steps(name, "grad_norm"), _steps("tp2", "grad_norm")) <= 1e-4
    got = _steps(name)
    assert sum(got[-5:]) / 5 < sum(got[:5]) / 5 - 0.5, got


@pytest.mark.multiproc
def test_bf16_training_with_sp_follows_bf16_without():
    """bf16 at ZeRO 1 (BF16_Optimizer, immediate_grad_update on): the norms' bf16 gradients are summed in another
    order under SP, so the runs drift apart at bf16's precision, not more."""
    dp_tp_runs()
    cfg = json.loads((workdir() / "tp2_sp_bf16" / "config.json").read_text())["parallel"]
    assert (cfg["precision"], cfg["sequence_parallel"], cfg["zero_stage"]) == ("bf16", True, 1)
    got, want = _steps("tp2_sp_bf16"), _steps("tp2_bf16")
    assert max(abs(a - b) for a, b in zip(got, want)) <= 0.03, (got, want)
    assert _rel(_steps("tp2_sp_bf16", "grad_norm"), _steps("tp2_bf16", "grad_norm")) <= 0.05
    assert sum(got[-5:]) / 5 < sum(got[:5]) / 5 - 0.5, got


@pytest.mark.multiproc
def test_pipeline_with_tp_and_sp_follows_the_pipeline_without():
    """PP 2 x TP 2 with SP (4 processes; the engine's activation partitioning off): the first 6 losses and gradient
    norms of the same run without SP."""
    four_process_runs()
    assert _rel(_steps("pp2_tp2_sp", last=6), _steps("pp2_tp2", last=6)) <= 1e-5
    assert _rel(_steps("pp2_tp2_sp", "grad_norm", 6), _steps("pp2_tp2", "grad_norm", 6)) <= 1e-4


@pytest.mark.multiproc
def test_a_checkpoint_trained_with_sp_resumes_without_it():
    """SP changes no parameter, name or shape: tp2_sp's step-10 checkpoint resumes with SP off and trains on."""
    sp_resume_runs()
    resumed = events("tp2_sp", "resumed")[-1]
    assert (resumed["tag"], resumed["consumed_samples"]) == ("global_step10", 80)
    later = {r["step"]: r["loss"] for r in records("tp2_sp") if "loss" in r and r["step"] > 10}
    assert sorted(later) == list(range(11, 17)) and all(math.isfinite(x) for x in later.values())
    assert abs(later[11] - _steps("tp2_sp")[-1]) < 0.5, later


@pytest.mark.multiproc
def test_the_7b_layout_trains_two_steps_on_cpu_at_reduced_size():
    """configs/7b-lev.yaml at 4 layers of width 64 (4 processes): its TP 2 with sequence parallelism, bf16 and
    ZeRO 1, plus PP 2 and full recompute of each stage's first layer: two optimizer steps, finite and logged."""
    runs = four_process_runs()
    assert set(runs["codes"]["7b_small"].values()) == {0}, runs["errors"].get("7b_small")
    cfg = json.loads((workdir() / "7b_small" / "config.json").read_text())
    p, m = cfg["parallel"], cfg["model"]
    assert (p["tensor_parallel"], p["pipeline_parallel"], p["sequence_parallel"], p["precision"]) == (
        2,
        2,
        True,
        "bf16",
    )
    assert (m["recompute"], m["variant"], m["vocab_size"], m["seq_length"]) == ("full", "lev", 512, 64)
    got = {r["step"]: r["loss"] for r in records("7b_small") if "loss" in r}
    assert sorted(got) == [1, 2] and all(math.isfinite(x) for x in got.values()), got
    assert events("7b_small", "finished")
