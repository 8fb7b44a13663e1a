"""The training plan and per-rank memory estimate (leviathan_pretrain/plan/planner.py): pure arithmetic, no
processes."""

from __future__ import annotations

import pytest

from leviathan_pretrain.config import VARIANTS, load_config
from leviathan_pretrain.model import counts, sizes
from leviathan_pretrain.plan.planner import BYTES, COMPONENTS, GIB, format_plan, make_plan, plan_problems
from leviathan_pretrain.plan.stages import partition_balanced, stage_layout

BIG = "configs/1.2b-lev.yaml"
TINY = "configs/tiny-cpu-lev.yaml"


def cfg_of(path=BIG, *overrides):
    return load_config(path, list(overrides))


def keys(plan) -> list[str]:
    return [p.split(":", 1)[0] for p in plan_problems(plan)]


def replicated(m) -> int:
    """Parameters every TP rank holds in full: the norms, and the input layer's unsharded pieces."""
    D, lev = m.hidden_size, m.lev
    out = 2 * D * m.num_layers + D
    codebooks = lev.digits * lev.resolved_base(m.vocab_size) * lev.seed_dim
    if m.variant == "lev":
        out += codebooks
    if m.variant == "factored_mlp":
        out += codebooks + 2 * lev.seed_dim
    if m.variant == "albert":
        out += sizes.albert_dim(m) * D
    return out


# ---------------------------------------------------------------- problems


def test_tp_pp_not_dividing_the_world_is_reported():
    plan = make_plan(cfg_of(BIG, "parallel.tensor_parallel=2", "parallel.pipeline_parallel=2"), 3, 2)
    assert keys(plan) == ["--nodes/--gpus-per-node"]
    assert "6" in plan.problems[0] and "parallel.tensor_parallel" in plan.problems[0]


def test_global_batch_not_divisible_by_micro_x_dp_is_reported():
    plan = make_plan(cfg_of(BIG, "parallel.tensor_parallel=2", "train.global_batch_size=520"), 16, 8)
    assert keys(plan) == ["train.global_batch_size"]
    assert "8 x 64 = 512" in plan.problems[0]


def test_more_stages_than_layers_is_reported():
    cfg = cfg_of(TINY)  # 4 layers; config loading refuses PP > layers, a launcher may still ask for it
    cfg.parallel.pipeline_parallel = 8
    plan = make_plan(cfg, 1, 8, device="cpu", mem_limit_gb=None)
    assert "parallel.pipeline_parallel" in keys(plan)


def test_memory_over_the_limit_names_the_option_and_the_cure():
    cfg = cfg_of(
        BIG,
        "train.micro_batch_size=64",
        "train.global_batch_size=64",
        "parallel.zero_stage=0",
        "parallel.precision=bf16",
    )
    plan = make_plan(cfg, 1, 1)
    assert keys(plan) == ["--gpu-mem-gb"]
    msg = plan.problems[0]
    assert "activations" in msg and "train.micro_batch_size" in msg and "parallel.tensor_parallel" in msg
    assert plan.memory["total"] > 80 * GIB
    assert not make_plan(cfg, 1, 1, mem_limit_gb=None).problems  # no limit, no check


def test_state_dominated_overflow_suggests_a_higher_zero_stage():
    cfg = cfg_of(BIG, "train.micro_batch_size=1", "train.global_batch_size=64", "parallel.zero_stage=0")
    plan = make_plan(cfg, 8, 8, mem_limit_gb=16)
    assert keys(plan) == ["--gpu-mem-gb"] and "parallel.zero_stage" in plan.problems[0]


def test_cpu_only_refusals():
    cfg = cfg_of(TINY, "parallel.precision=fp16", "model.attention_backend=megatron")
    assert set(keys(make_plan(cfg, 1, 1, device="cpu", mem_limit_gb=None))) == {
        "parallel.precision",
        "model.attention_backend",
    }


# ---------------------------------------------------------------- a good geometry


def test_good_geometry_numbers():
    cfg = cfg_of(BIG, "parallel.tensor_parallel=2", "parallel.zero_stage=1")
    plan = make_plan(cfg, 16, 8)
    assert plan.problems == []
    assert (plan.world, plan.tp, plan.pp, plan.dp) == (128, 2, 1, 64)
    assert (plan.micro_batch, plan.global_batch, plan.grad_accum) == (8, 512, 1)
    assert plan.tokens_per_step == 512 * 512 == plan.global_batch * plan.seq_length
    assert plan.memory["total"] < 80 * GIB and plan.memory["runtime"] > 0
    few = make_plan(cfg, 2, 8)  # DP 8: accumulation 512 / (8 x 8)
    assert (few.dp, few.grad_accum, few.problems) == (8, 8, [])
    text = format_plan(plan)
    for s in ("TP 2 x PP 1 x DP 64", "262,144 tokens/step", "accumulation 1", "total", "of 80", "problems: none"):
        assert s in text
    assert set(plan.memory) == {*COMPONENTS, "total"}
    mem = plan.memory
    assert mem["total"] == pytest.approx(
        sum(mem[k] for k in ("parameters", "gradients", "optimizer", "buffers", "runtime"))
        + max(mem["activations"] + mem["logits"], mem["step"])
    )


# ---------------------------------------------------------------- parameter bytes


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_parameter_bytes_equal_the_closed_form_count_at_tp1(variant, precision):
    cfg = cfg_of(f"configs/1.2b-{variant}.yaml", "parallel.zero_stage=0", f"parallel.precision={precision}")
    plan = make_plan(cfg, 1, 1)
    total = counts.param_breakdown(cfg.model, 1)["total"]
    assert plan.params_per_rank == total
    assert plan.memory["parameters"] == total * BYTES[precision]


@pytest.mark.parametrize("variant", VARIANTS)
def test_tensor_parallel_divides_all_but_the_replicated_parameters(variant):
    one = make_plan(cfg_of(f"configs/1.2b-{variant}.yaml", "parallel.zero_stage=0"), 1, 1)
    cfg2 = cfg_of(f"configs/1.2b-{variant}.yaml", "parallel.zero_stage=0", "parallel.tensor_parallel=2")
    two = make_plan(cfg2, 1, 2)
    R = replicated(cfg2.model)
    # sharded pieces halve; the padded vocabulary is a multiple of 128 x TP, so count the whole model at TP = 2
    assert two.params_per_rank == R + (counts.param_breakdown(cfg2.model, 2)["total"] - R) // 2
    assert one.params_per_rank == counts.param_breakdown(cfg2.model, 1)["total"]
    assert two.memory["parameters"] == two.params_per_rank * 2  # bf16


def test_zero_stages_partition_what_they_should():
    plans = {
        z: make_plan(cfg_of(BIG, "parallel.tensor_parallel=2", f"parallel.zero_stage={z}"), 16, 8) for z in range(4)
    }
    dp, P = 64, plans[0].params_per_rank
    z0, z1, z2, z3 = (plans[z].memory for z in range(4))
    assert z0["parameters"] == z1["parameters"] == z2["parameters"] == 2 * P  # bf16 weights
    assert z3["parameters"] == z2["parameters"] / dp
    assert z0["optimizer"] == 12 * P  # FP16_UnfusedOptimizer: fp32 master + Adam m + v, not partitioned
    assert z1["optimizer"] == z0["optimizer"] / dp == z2["optimizer"] == z3["optimizer"]
    assert z0["gradients"] == 2 * P  # ZeRO 0: bf16 accumulation (DeepSpeed has no fp32 path there)
    # BF16_Optimizer: the whole fp32 accumulator + (immediate_grad_update, the default) the bf16 .grad autograd is
    # finishing, freed once added in (the largest tensor's); without it every bf16 .grad stays
    assert 4 * P < z1["gradients"] < 5 * P  # 2 x the largest tensor (here the TIED table's slice, a third of P)
    old = cfg_of(BIG, "parallel.tensor_parallel=2", "parallel.zero_stage=1", "parallel.immediate_grad_update=false")
    old = make_plan(old, 16, 8).memory
    assert old["gradients"] == 6 * P  # every bf16 .grad kept
    assert z2["gradients"] == 4 * P / dp == z3["gradients"]  # fp32 gradient partitions
    assert [plans[z].optimizer for z in range(4)] == [
        "FP16_UnfusedOptimizer",
        "BF16_Optimizer",
        "DeepSpeedZeroOptimizer",
        "DeepSpeedZeroOptimizer_Stage3",
    ]
    assert z1["step"] == 8 * P / dp  # the fp32 accumulator is stepped in place: AdamW's temporaries only
    assert z1["buffers"] == 2 * P  # its bf16 copy for the all-reduce (P > 5e8: one bucket per group)
    assert z0["activations"] == z1["activations"] == z2["activations"] == z3["activations"]
    fp32 = {z: make_plan(cfg_of(TINY, f"parallel.zero_stage={z}"), 1, 4, device="cpu") for z in (0, 1)}
    Q = fp32[0].params_per_rank
    assert fp32[0].memory["optimizer"] == 8 * Q  # plain AdamW: m + v only
    assert fp32[1].memory["optimizer"] == 12 * Q / 4  # DeepSpeed keeps an fp32 master copy under ZeRO >= 1


def test_bf16_accumulation_keeps_the_old_wrappers():
    bf16 = {
        z: make_plan(cfg_of(BIG, "parallel.grad_accum_dtype=bf16", f"parallel.zero_stage={z}"), 8, 8).memory
        for z in (1, 2)
    }
    P = make_plan(cfg_of(BIG, "parallel.zero_stage=1"), 8, 8).params_per_rank
    assert bf16[1]["gradients"] == 2 * P and bf16[2]["gradients"] == 2 * P / 64
    plan = make_plan(cfg_of(BIG, "parallel.grad_accum_dtype=bf16", "parallel.zero_stage=1"), 8, 8)
    assert plan.optimizer == "DeepSpeedZeroOptimizer"
    pipe = make_plan(cfg_of(BIG, "parallel.zero_stage=1", "parallel.pipeline_parallel=2"), 8, 8)
    assert pipe.optimizer == "DeepSpeedZeroOptimizer" and pipe.memory["gradients"] == 2 * pipe.params_per_rank


@pytest.mark.parametrize("zero", [1, 2])
def test_buffers_follow_the_bucket_size_and_overlap_comm(zero):
    def buffers(device, *o):
        over = ("parallel.precision=fp32", f"parallel.zero_stage={zero}", *o)
        return make_plan(cfg_of(BIG, *over), 8, 8, device=device, mem_limit_gb=None).memory["buffers"]

    assert buffers("gpu") == 2 * 500_000_000 * 4  # overlap_comm on GPU: two fp32 reduce buckets
    assert buffers("gpu", "parallel.overlap_comm=false") == 500_000_000 * 4
    assert buffers("gpu", "parallel.reduce_bucket_elements=2e8") == 2 * 200_000_000 * 4
    P = make_plan(cfg_of(BIG, "parallel.precision=fp32", f"parallel.zero_stage={zero}"), 8, 8).params_per_rank
    assert buffers("cpu") == min(P, 500_000_000) * 4  # CPU: one bucket (no overlap), only its written pages


# ---------------------------------------------------------------- activations and pipeline stages


def test_activations_scale_with_the_micro_batch_and_divide_by_tp():
    def mem(micro, *o):  # accumulation 1 throughout (no fresh-gradient term)
        cfg = cfg_of("configs/1.2b-tied.yaml", f"train.micro_batch_size={micro}", *o)
        dp = 64 // cfg.parallel.tensor_parallel
        cfg.train.global_batch_size = micro * dp
        plan = make_plan(cfg, 8, 8)
        assert plan.grad_accum == 1 and not plan.problems
        return plan.memory

    one, two = mem(4, "model.loss_impl=megatron"), mem(8, "model.loss_impl=megatron")
    assert two["activations"] == pytest.approx(2 * one["activations"])
    assert two["logits"] == pytest.approx(2 * one["logits"])  # the whole [T, V] logits
    tp2 = mem(8, "parallel.tensor_parallel=2", "model.loss_impl=megatron")
    assert tp2["logits"] < two["logits"] / 2 * 1.01  # vocab-parallel logits (V_pad may grow by <= 128 x TP rows)
    assert two["activations"] / 2 < tp2["activations"] < two["activations"]  # norms are not divided (no SP)


def test_fused_loss_holds_one_chunk_of_logits():
    cfg = cfg_of("configs/200m-tied.yaml")  # micro 32 x 512 tokens, V 200,064, bf16
    fused, unfused = (
        make_plan(cfg_of("configs/200m-tied.yaml", f"model.loss_impl={i}"), 1, 8) for i in ("fused", "megatron")
    )
    m, T, e = cfg.model, cfg.train.micro_batch_size * cfg.model.seq_length, 2
    v = sizes.padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 1)
    c = sizes.balanced_chunk(T, sizes.loss_chunk_tokens(v, "cuda"))  # 16,384 tokens in 7 chunks of <= 2,341
    assert c == 2341
    assert fused.memory["logits"] == c * v * (4 + e) + e * T * m.hidden_size + (4 + e) * v * m.hidden_size
    assert unfused.memory["logits"] == T * v * (4 + e)
    assert unfused.memory["logits"] / fused.memory["logits"] > 5
    assert fused.memory["total"] < unfused.memory["total"] - 10 * 2**30


def test_liger_loss_holds_one_chunk_of_model_dtype_logits(monkeypatch):
    """model.loss_impl=liger: the chunk from the same budget at 2 bytes a logit (no fp32 copy), the fp32 hidden
    gradient and the fp32 head-gradient sum; auto counts it for a GPU plan at TP = 1 when liger-kernel is
    installed, else the fused term (and always on a CPU plan or at TP > 1)."""
    from leviathan_pretrain.plan import planner

    def plan(*o, device="gpu", tp=1):
        cfg = cfg_of("configs/200m-tied.yaml", f"parallel.tensor_parallel={tp}", *o)
        return make_plan(cfg, 1, 8, device=device)

    cfg = cfg_of("configs/200m-tied.yaml")  # micro 32 x 512 tokens, V 200,064, bf16
    m, T, e = cfg.model, cfg.train.micro_batch_size * cfg.model.seq_length, 2
    v = sizes.padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 1)
    c = sizes.balanced_chunk(T, sizes.loss_chunk_tokens(v, "cuda", None, e))  # 16,384 tokens in 4 chunks of 4,096
    assert c == 4096
    liger, fused = plan("model.loss_impl=liger"), plan("model.loss_impl=fused")
    assert liger.loss_impl == "liger" and "loss liger" in format_plan(liger)
    assert liger.memory["logits"] == c * v * e + 4 * T * m.hidden_size + 4 * v * m.hidden_size
    assert liger.memory["logits"] < fused.memory["logits"] - 2**30  # 2.15 GiB against 3.50
    monkeypatch.setattr(planner, "liger_installed", lambda: True)
    assert plan().loss_impl == "liger" and plan().memory["logits"] == liger.memory["logits"]
    assert plan(device="cpu").loss_impl == plan(tp=2).loss_impl == "fused"
    monkeypatch.setattr(planner, "liger_installed", lambda: False)
    assert plan().loss_impl == "fused" and plan().memory["logits"] == fused.memory["logits"]


def test_pipeline_stages_follow_deepspeed_partitioning():
    assert partition_balanced([0] + [1] * 16 + [0, 0], 4)[1:-1] == [5, 9, 13]
    layout = stage_layout(16, 4)
    assert [s["blocks"] for s in layout] == [4, 4, 4, 4]
    assert layout[0]["input"] and layout[3]["head"] and layout[3]["final"] and not layout[0]["head"]
    cfg = cfg_of(BIG, "parallel.pipeline_parallel=4")  # ZeRO 1, accumulation 512 / 8 / 4 = 16 >= 4 stages
    plan = make_plan(cfg, 2, 8)
    assert (plan.dp, plan.grad_accum, plan.problems) == (4, 16, [])
    assert plan.stage == 3 and plan.memory["logits"] > 0  # SDPA (auto): the head's stage is the most loaded
    scores = make_plan(cfg_of(BIG, "parallel.pipeline_parallel=4", "model.attention_backend=megatron"), 2, 8)
    assert scores.stage == 0  # megatron's s^2 scores: 4 micro-batches in flight on stage 0
    single = make_plan(cfg_of(BIG), 16, 8)
    assert scores.params_per_rank < single.params_per_rank / 2
    assert scores.memory["logits"] == 0  # the head is on the last stage


def test_auto_attention_is_sdpa_on_gpu_without_the_s2_scores():
    """``attention_backend=auto`` is SDPA on a GPU too (model/gpt.py): the plan counts no s^2 term for it."""
    from leviathan_pretrain.plan.activations import attention_kind

    m = cfg_of(BIG).model
    assert m.attention_backend == "auto"
    assert attention_kind(m, "gpu") == attention_kind(m, "cpu") == "sdpa"

    def act(seq, backend):
        cfg = cfg_of(BIG, f"model.seq_length={seq}", f"model.attention_backend={backend}", "train.micro_batch_size=4")
        cfg.train.global_batch_size = 4 * 128
        return make_plan(cfg, 16, 8).memory["activations"]

    assert act(512, "auto") == act(512, "sdpa")
    assert act(1024, "auto") == pytest.approx(2 * act(512, "auto"))  # linear in s (T = s x b), no s^2
    assert act(1024, "megatron") > 2 * act(512, "megatron") > 2 * act(512, "auto")


def test_cpu_plan_has_no_runtime_and_no_limit():
    plan = make_plan(cfg_of(TINY), 1, 1, device="cpu", mem_limit_gb=None)
    assert plan.memory["runtime"] == 0 and plan.problems == [] and plan.mem_limit_gb is None
    mem = plan.memory  # ZeRO 0 / CPU: gradient flattening, optimizer step and forward/backward do not overlap
    assert mem["total"] == pytest.approx(
        mem["parameters"]
        + mem["gradients"]
        + mem["optimizer"]
        + max(mem["activations"] + mem["logits"], mem["buffers"], mem["step"])
    )
    assert "no limit checked" in format_plan(plan)


def test_recompute_modes_keep_what_they_say():
    """model.recompute: selective drops the recomputed modules' tensors (megatron's softmax with core_attn on the
    megatron backend, the MLP's 5F with mlp), full keeps e T D per recomputed layer; each adds once the activations
    of the layer being recomputed. Fewer activations, never more parameters or state."""
    from leviathan_pretrain.plan.activations import layer_activation_bytes

    def plan_of(*o):
        return make_plan(cfg_of("configs/1.2b-tied.yaml", "model.attention_backend=megatron", *o), 8, 8)

    base, e = plan_of(), 2  # bf16
    cfg = cfg_of("configs/1.2b-tied.yaml", "model.attention_backend=megatron")
    m, T, L = cfg.model, cfg.train.micro_batch_size * cfg.model.seq_length, cfg.model.num_layers
    whole = layer_activation_bytes(m, T, 1, e, "megatron")
    acts = {}
    for name, o in {
        "attn": ("model.recompute=selective",),
        "mlp": ("model.recompute=selective", "model.recompute_modules=[mlp]"),
        "full": ("model.recompute=full",),
        "full2": ("model.recompute=full", "model.recompute_layers=2"),
    }.items():
        plan = plan_of(*o)
        assert {k: plan.memory[k] for k in ("parameters", "optimizer")} == {
            k: base.memory[k] for k in ("parameters", "optimizer")
        }
        acts[name] = plan.memory["activations"]
        if name == "full2":
            assert "recompute full (first 2 layers of each stage))" in format_plan(plan)
    s, heads = m.seq_length, m.num_attention_heads
    softmax = T * heads * s * (4 + e)  # per layer, what core_attn's recompute drops (and adds back for one layer)
    assert base.memory["activations"] - acts["attn"] == pytest.approx((L - 1) * softmax)
    mlp = T * e * 5 * m.resolved_ffn_hidden_size()
    assert base.memory["activations"] - acts["mlp"] == pytest.approx((L - 1) * mlp)
    assert base.memory["activations"] - acts["full"] == pytest.approx(L * (whole - e * T * m.hidden_size) - whole)
    assert acts["full"] < acts["full2"] < base.memory["activations"] and acts["attn"] < base.memory["activations"]


def test_sequence_parallelism_divides_the_norms_and_the_full_tensors_by_tp():
    """parallel.sequence_parallel: the norms' 2 (8 + e) D per layer, a fully recomputed layer's input, the final norm
    and the pipe buffers become the sequence shard (/ TP); the head keeps its all-gathered input e T D in full; the
    tensor-parallel e (A D + 5 F) / TP, the input layer, the weights and the states do not change."""
    from leviathan_pretrain.plan.activations import layer_activation_bytes, recompute_bytes, stage_activation_bytes

    cfg = cfg_of("configs/7b-tied.yaml")  # TP 2, SP on, bf16, micro 2 x 2048 tokens
    m, tp, e = cfg.model, cfg.parallel.tensor_parallel, 2
    T, D, L = cfg.train.micro_batch_size * m.seq_length, m.hidden_size, m.num_layers
    shard = 1 - 1 / tp  # what SP takes off a tensor every TP rank held in full
    norms = T * 2 * (8 + e) * D * shard
    for attention in ("sdpa", "megatron"):
        on = layer_activation_bytes(m, T, tp, e, attention, sp=True)
        assert layer_activation_bytes(m, T, tp, e, attention) - on == pytest.approx(norms, rel=1e-12)

    def plan(sp, *o):
        return make_plan(cfg_of("configs/7b-tied.yaml", f"parallel.sequence_parallel={sp}", *o), 8, 8)

    on, off = plan("true"), plan("false")
    assert (on.sequence_parallel, off.sequence_parallel) == (True, False)
    assert "sequence parallel on; recompute none" in format_plan(on) and "sequence parallel off" in format_plan(off)
    final, head = T * (8 + e) * D * shard, e * T * D  # PP 1, accumulation 32: one micro-batch in flight
    assert off.memory["activations"] - on.memory["activations"] == pytest.approx(L * norms + final - head, rel=1e-12)
    for k in ("parameters", "gradients", "optimizer", "logits", "buffers", "step", "runtime"):
        assert on.memory[k] == off.memory[k], k
    # full recompute keeps e T D / TP per layer; the recomputed layer's working set loses the norms' share too
    full = cfg_of("configs/7b-tied.yaml", "model.recompute=full").model
    kept_on, work_on = recompute_bytes(full, 16, T, tp, e, "sdpa", sp=True)
    kept_off, work_off = recompute_bytes(full, 16, T, tp, e, "sdpa")
    assert kept_off - kept_on == pytest.approx(16 * e * T * D * shard, rel=1e-12)
    assert work_off - work_on == pytest.approx(norms, rel=1e-12)
    # PP > 1: the pipe buffers 2 e T D / TP on every stage; the input layer's tensors are unchanged
    first = {"blocks": 16, "input": True, "final": False, "head": False}
    last = {"blocks": 16, "input": False, "final": True, "head": True}
    pipe = 2 * e * T * D * shard
    for st, diff in ((first, pipe), (last, pipe + final - head)):
        got = stage_activation_bytes(m, st, T, tp, e, 2) - stage_activation_bytes(m, st, T, tp, e, 2, sp=True)
        assert got == pytest.approx(diff, rel=1e-12)
