"""Gradient accumulation dtype, ZeRO buckets/overlap and the AdamW kernel: the DeepSpeed config and
optimizer a run gets, config-load refusals, fp32 accumulation of bf16 gradients measured against bf16
accumulation, and a bitwise bf16 resume through BF16_Optimizer; BF16_Optimizer's ``immediate_grad_update``
gives the same losses and gradient norms bit for bit, and its checkpoints load either way."""

import json

import pytest
import torch

from leviathan_pretrain.config import ConfigError, load_config
from leviathan_pretrain.trainer.engine import adamw_kernel, build_optimizer, deepspeed_config
from tests.multiproc import run_ranks
from tests.workers.train_common import CONFIG, TINY, events, launch, losses, records, spec, workdir


def cfg_of(*over):
    return load_config(CONFIG, [*TINY, *over])


# ---------------------------------------------------------------- the DeepSpeed config dict


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_bf16_accumulates_in_fp32_where_deepspeed_can(zero):
    ds = deepspeed_config(cfg_of("parallel.precision=bf16", f"parallel.zero_stage={zero}"), 1, False)
    assert ds["data_types"] == {"grad_accum_dtype": "fp32" if zero else "bf16"}
    ds = deepspeed_config(cfg_of("parallel.precision=bf16", "parallel.grad_accum_dtype=bf16"), 1, False)
    assert ds["data_types"] == {"grad_accum_dtype": "bf16"}  # the old path, on request
    for prec in ("fp32", "fp16"):  # no data_types: DeepSpeed accumulates in the model dtype as before
        assert "data_types" not in deepspeed_config(cfg_of(f"parallel.precision={prec}"), 1, False)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero12_overlaps_communication_on_cuda_only_by_default(zero):
    cfg = cfg_of(f"parallel.zero_stage={zero}")
    gpu, cpu = (deepspeed_config(cfg, 2, False, cuda)["zero_optimization"] for cuda in (True, False))
    assert gpu == {
        "stage": zero,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 500_000_000,
        "allgather_bucket_size": 500_000_000,
    }
    assert cpu == {**gpu, "overlap_comm": False}  # DeepSpeed's own default for ZeRO 1/2: what CPU runs had
    over = ["parallel.overlap_comm=false", "parallel.reduce_bucket_elements=2e8"]
    over.append("parallel.allgather_bucket_elements=1e8")
    z = deepspeed_config(cfg_of(f"parallel.zero_stage={zero}", *over), 2, False, True)["zero_optimization"]
    assert (z["overlap_comm"], z["reduce_bucket_size"], z["allgather_bucket_size"]) == (False, 200_000_000, 100_000_000)
    assert deepspeed_config(cfg_of(f"parallel.zero_stage={zero}", "parallel.overlap_comm=true"), 2, False)[
        "zero_optimization"
    ]["overlap_comm"]


def test_zero0_and_zero3_keep_deepspeeds_overlap_default():
    for zero in (0, 3):
        z = deepspeed_config(cfg_of(f"parallel.zero_stage={zero}"), 2, False, True)["zero_optimization"]
        assert "overlap_comm" not in z and "contiguous_gradients" not in z  # ZeRO 3: DeepSpeed's default (true)
    z = deepspeed_config(cfg_of("parallel.zero_stage=3", "parallel.overlap_comm=false"), 2, False, True)
    assert z["zero_optimization"]["overlap_comm"] is False


def test_refused_combinations_name_the_key_and_reason():
    with pytest.raises(ConfigError, match=r"parallel.grad_accum_dtype: fp32 .*zero_stage >= 1.*NotImplementedError"):
        cfg_of("parallel.precision=bf16", "parallel.zero_stage=0", "parallel.grad_accum_dtype=fp32")
    with pytest.raises(ConfigError, match="parallel.grad_accum_dtype: bf16 accumulation needs parallel.precision=bf16"):
        cfg_of("parallel.precision=fp32", "parallel.grad_accum_dtype=bf16")
    with pytest.raises(ConfigError, match="parallel.grad_accum_dtype: fp16 runs accumulate in fp16"):
        cfg_of("parallel.precision=fp16", "parallel.zero_stage=1", "parallel.grad_accum_dtype=fp32")
    with pytest.raises(ConfigError, match="parallel.grad_accum_dtype: must be auto, fp32 or bf16"):
        cfg_of("parallel.grad_accum_dtype=fp64")
    with pytest.raises(ConfigError, match="parallel.allgather_bucket_elements: must be an even number"):
        cfg_of("parallel.allgather_bucket_elements=3")
    with pytest.raises(ConfigError, match="parallel.overlap_comm: expected true/false"):
        cfg_of("parallel.overlap_comm=maybe")
    fp32 = cfg_of("parallel.precision=fp32", "parallel.grad_accum_dtype=fp32")
    assert fp32.parallel.resolved_grad_accum_dtype == "fp32"


def test_bf16_with_the_pipeline_engine_never_gets_bf16_optimizer():
    """DeepSpeed 0.19.8's pipeline engine with BF16_Optimizer sums wrong gradients when accumulating: the worker
    of the test below, run at PP = 1 with parallel.pipeline_engine=true (validation bypassed), measured a
    global norm of 50.6 (fp32 accumulation, ZeRO 1) and 50.8 (ZeRO 0, bf16 accumulation, the old default
    there) against 1.07e-3 as one micro-batch and 1.107e-2 for DeepSpeedZeroOptimizer's bf16 sum (pipeline
    or not). So: ZeRO 1 with bf16 accumulation, the others refused."""
    pipe = cfg_of("parallel.precision=bf16", "parallel.zero_stage=1", "parallel.pipeline_engine=true")
    assert deepspeed_config(pipe, 1, False)["data_types"] == {"grad_accum_dtype": "bf16"}
    with pytest.raises(ConfigError, match="parallel.grad_accum_dtype: fp32 accumulation with DeepSpeed's pipeline"):
        cfg_of(
            "parallel.precision=bf16",
            "parallel.zero_stage=1",
            "parallel.pipeline_engine=true",
            "parallel.grad_accum_dtype=fp32",
        )
    with pytest.raises(ConfigError, match="parallel.zero_stage: bf16 with DeepSpeed's pipeline engine at ZeRO 0"):
        cfg_of("parallel.precision=bf16", "parallel.zero_stage=0", "parallel.pipeline_parallel=2")


def test_bf16_optimizer_adds_each_gradient_in_a_hook_where_it_accumulates_in_fp32():
    """``parallel.immediate_grad_update`` null: DeepSpeed's ``bf16.immediate_grad_update`` on exactly where
    BF16_Optimizer accumulates in fp32 (bf16, ZeRO 1, fp32 accumulation, not the pipeline engine), off elsewhere
    (nothing else reads it); false restores DeepSpeed's after-backward pass; true elsewhere is refused."""

    def flag(*over):
        return deepspeed_config(cfg_of(*over), 1, False)["bf16"]["immediate_grad_update"]

    bf16 = "parallel.precision=bf16"
    assert flag(bf16, "parallel.zero_stage=1") is True
    assert flag(bf16, "parallel.zero_stage=1", "parallel.grad_accum_dtype=fp32") is True
    assert flag(bf16, "parallel.zero_stage=1", "parallel.immediate_grad_update=false") is False  # the old path
    for over in (
        ["parallel.zero_stage=0"],
        ["parallel.zero_stage=2"],
        ["parallel.zero_stage=3"],
        ["parallel.zero_stage=1", "parallel.grad_accum_dtype=bf16"],
        ["parallel.zero_stage=1", "parallel.pipeline_engine=true"],
    ):
        assert flag(bf16, *over) is False, over
    assert deepspeed_config(cfg_of(), 1, False)["bf16"] == {"enabled": False, "immediate_grad_update": False}
    for over in (
        ["parallel.zero_stage=2"],
        ["parallel.precision=fp32", "parallel.zero_stage=1"],
        ["parallel.zero_stage=1", "parallel.grad_accum_dtype=bf16"],
        ["parallel.zero_stage=1", "parallel.pipeline_engine=true"],
    ):
        with pytest.raises(ConfigError, match=r"parallel\.immediate_grad_update: true applies only to .*BF16_Optim"):
            cfg_of(bf16, *over, "parallel.immediate_grad_update=true")


# ---------------------------------------------------------------- the AdamW kernel


@pytest.mark.parametrize("own_clipping", [False, True])
def test_adamw_is_fused_on_cuda_single_tensor_on_cpu(own_clipping):
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    cfg = cfg_of()
    gpu, cpu = (build_optimizer(module, cfg, own_clipping, cuda) for cuda in (True, False))
    assert (gpu.defaults["fused"], gpu.defaults["foreach"]) == (True, False)
    assert (cpu.defaults["fused"], cpu.defaults["foreach"]) == (False, False)
    assert all(g["fused"] for g in gpu.param_groups) and not any(g["fused"] for g in cpu.param_groups)
    assert adamw_kernel(cfg_of("optim.fused=true"), False) == {"fused": True, "foreach": False}
    assert adamw_kernel(cfg_of("optim.fused=false"), True) == {"fused": False, "foreach": False}
    # torch's fused AdamW also runs on CPU: forced there, it makes the single-tensor kernel's step
    steps = {}
    for fused in (True, False):
        torch.manual_seed(0)
        m = torch.nn.Linear(4, 4)
        opt = build_optimizer(m, cfg_of(f"optim.fused={str(fused).lower()}"), own_clipping, False)
        assert opt.defaults["fused"] is fused
        for p in m.parameters():
            p.grad = torch.linspace(-1, 1, p.numel()).view_as(p)
        before = m.weight.detach().clone()
        opt.step()
        steps[fused] = m.weight.detach() - before
    assert steps[True].abs().min() > 0
    torch.testing.assert_close(steps[True], steps[False])


# ---------------------------------------------------------------- fp32 accumulation, measured


@pytest.mark.multiproc
def test_fp32_accumulation_matches_one_large_batch_where_bf16_does_not(tmp_path):
    """32 accumulated bf16 micro-batches whose gradients cancel (tests/workers/grad_accum.py) against the same
    32 sequences as one micro-batch (one backward, the GEMMs sum over all tokens in fp32, the result rounded
    to bf16 once). Measured (CPU, torch 2.13, DeepSpeed 0.19.8): DeepSpeed's global norm of the large batch
    1.072e-3; accumulated in fp32 1.304e-3 (ZeRO 1/BF16_Optimizer, ZeRO 2, ZeRO 3 alike;
    the rest is the bf16 rounding of each micro-batch's own gradient, amplified by the cancellation) with a
    gradient error of 0.71 x the large batch's norm; accumulated in bf16 (the old default) 1.107e-2, 10x, with
    an error of 10.3 x. fp32 weights in fp32: 3.06e-3 (bf16 weights sit elsewhere near the optimum)."""
    bf16 = ["parallel.precision=bf16", "train.micro_batch_size=1"]
    cases = [
        ["big", ["parallel.precision=bf16", "parallel.zero_stage=1", "train.micro_batch_size=32"]],
        ["z1", [*bf16, "parallel.zero_stage=1"]],
        ["z2", [*bf16, "parallel.zero_stage=2"]],
        ["z3", [*bf16, "parallel.zero_stage=3"]],
        ["z1_bf16", [*bf16, "parallel.zero_stage=1", "parallel.grad_accum_dtype=bf16"]],
    ]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    args = ["tests/workers/grad_accum.py", str(tmp_path / "cases.json"), str(tmp_path)]
    (res,) = run_ranks(args, nprocs=1, timeout=600)
    rows = {r["name"]: r for r in (json.loads(x[7:]) for x in res.output.splitlines() if x.startswith("RESULT "))}
    assert sorted(rows) == sorted(c[0] for c in cases), res.output[-3000:]
    wrappers = {k: r["wrapper"] for k, r in rows.items()}
    assert wrappers == {
        "big": "BF16_Optimizer",
        "z1": "BF16_Optimizer",
        "z2": "DeepSpeedZeroOptimizer",
        "z3": "DeepSpeedZeroOptimizer_Stage3",
        "z1_bf16": "DeepSpeedZeroOptimizer",
    }
    ref = rows["big"]["norm"]
    g_ref = torch.load(tmp_path / "big.pt")
    assert abs(float(g_ref.norm()) - ref) <= 1e-3 * ref  # the saved gradient is what DeepSpeed's norm measured
    for name in ("z1", "z2", "z3"):  # fp32 accumulation: every path, the same sum
        assert abs(rows[name]["norm"] - rows["z1"]["norm"]) <= 1e-3 * ref, rows
        assert abs(rows[name]["norm"] - ref) <= 0.35 * ref, rows  # measured +22%
    err = {n: float((torch.load(tmp_path / f"{n}.pt") - g_ref).norm()) / ref for n in ("z1", "z2", "z3", "z1_bf16")}
    assert max(err[n] for n in ("z1", "z2", "z3")) < 1.0, err  # measured 0.71
    assert rows["z1_bf16"]["norm"] > 5 * ref, rows  # measured 10.3x
    assert err["z1_bf16"] > 5.0 and err["z1_bf16"] > 5 * err["z1"], err  # measured 10.3 vs 0.71


# ---------------------------------------------------------------- resume through BF16_Optimizer


@pytest.mark.multiproc
def test_bf16_resume_is_bitwise_through_bf16_optimizer():
    """bf16 ZeRO 1 at DP=2 (BF16_Optimizer, fp32 accumulation): a run stopped at step 6 and resumed in fresh
    processes logs the uninterrupted run's losses exactly; so does ZeRO 2 (fp32 gradient
    partitions)."""
    runs, resumes = [], []
    for z in (1, 2):
        common = ("train.steps=12", "train.eval_interval=0", "parallel.precision=bf16", f"parallel.zero_stage={z}")
        runs += [spec(f"bf16_z{z}_full", *common), spec(f"bf16_z{z}_part", *common, "train.exit_at_step=6")]
        resumes.append(spec(f"bf16_z{z}_part", *common))
    first = launch("bf16_first", runs, nprocs=2)
    assert first["codes"]["bf16_z1_part"] == first["codes"]["bf16_z2_part"] == {0: 75, 1: 75}
    second = launch("bf16_resume", resumes, nprocs=2)
    assert second["codes"]["bf16_z1_part"] == second["codes"]["bf16_z2_part"] == {0: 0, 1: 0}
    for z in (1, 2):
        a, b = losses(f"bf16_z{z}_full"), losses(f"bf16_z{z}_part")
        assert sorted(a) == sorted(b) == list(range(1, 13))
        assert [a[s] for s in range(7, 13)] == [b[s] for s in range(7, 13)]  # exact float equality
        assert events(f"bf16_z{z}_part", "resumed")[-1]["tag"] == "global_step6"
    assert (workdir() / "bf16_z1_full" / "checkpoints").is_dir()


@pytest.mark.multiproc
def test_immediate_grad_update_sums_what_deepspeeds_after_backward_pass_sums():
    """bf16, ZeRO 1, DP 2 (2 gloo ranks), 4 micro-batches per step, 8 steps: with ``parallel.immediate_grad_update``
    on (the hook adds each parameter's fresh bf16 gradient into the fp32 accumulator, then frees it) and off
    (DeepSpeed zeroes every bf16 ``.grad`` at the start of each backward and adds them all after it) the logged
    losses and global gradient norms are bit-identical: both add each micro-batch's own gradient once. The
    checkpoint of either loads into the other (stopped at step 4, resumed with the flag flipped): the resumed
    losses are the uninterrupted run's exactly."""
    common = (
        "parallel.precision=bf16",
        "parallel.zero_stage=1",
        "train.micro_batch_size=1",
        "train.steps=8",
        "train.eval_interval=0",
    )
    on, off = "parallel.immediate_grad_update=true", "parallel.immediate_grad_update=false"
    runs = [spec("igu_on", *common, on), spec("igu_off", *common, off)]
    runs += [spec("igu_off_on", *common, off, "train.exit_at_step=4")]
    runs += [spec("igu_on_off", *common, on, "train.exit_at_step=4")]
    first = launch("igu_first", runs, nprocs=2)
    assert first["codes"]["igu_off_on"] == first["codes"]["igu_on_off"] == {0: 75, 1: 75}
    second = launch("igu_resume", [spec("igu_off_on", *common, on), spec("igu_on_off", *common, off)], nprocs=2)
    assert second["codes"]["igu_off_on"] == second["codes"]["igu_on_off"] == {0: 0, 1: 0}
    step = {
        n: {r["step"]: r for r in records(n) if "loss" in r} for n in ("igu_on", "igu_off", "igu_off_on", "igu_on_off")
    }
    assert sorted(step["igu_on"]) == sorted(step["igu_off"]) == list(range(1, 9))
    for s in range(1, 9):  # exact float equality: losses and DeepSpeed's global gradient norm
        a, b = step["igu_on"][s], step["igu_off"][s]
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"]), (s, a, b)
        assert a["grad_norm"] is not None and not a["skipped"]
    for name in ("igu_off_on", "igu_on_off"):
        assert events(name, "resumed")[-1]["tag"] == "global_step4"
        for s in range(5, 9):
            assert step[name][s]["loss"] == step["igu_on"][s]["loss"], (name, s)
            assert step[name][s]["grad_norm"] == step["igu_on"][s]["grad_norm"], (name, s)
