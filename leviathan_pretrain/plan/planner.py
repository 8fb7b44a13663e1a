"""The training plan of a run before it is submitted: parallel grid, batch arithmetic, per-GPU memory estimate.

``make_plan(cfg, nodes, ranks_per_node, device="gpu", mem_limit_gb=80.0)`` returns a :class:`Plan`; its
``problems`` lists every geometry that cannot work (``"<dotted key or --option>: reason"``), and
``format_plan(plan)`` is the human summary a launcher prints. Pure Python (no torch, megatron or DeepSpeed
import): parameter counts come from :mod:`leviathan_pretrain.model.sizes`, the rest is arithmetic.

Grid and batch (what ``parallel.ParallelDims`` and ``trainer/engine.py`` compute): world = nodes x ranks per
node; DP = world / (TP x PP); accumulation = global batch / (micro batch x DP); tokens/step = global x seq.

Memory convention: bytes per rank, for the most loaded pipeline stage (the maximum over the stages DeepSpeed's
``partition_method="type:BlockPiece"`` makes: stage 0 also holds the input layer, the last stage the final
norm and the head). Three phases of a step do not overlap: forward/backward (``activations + logits``),
the gradient reduction (``buffers``) and the optimizer step (``step`` temporaries), so::

    total = parameters + gradients + optimizer + runtime + max(activations + logits, buffers, step)

except where DeepSpeed's bucket is live during backward (ZeRO >= 1 on GPU, see :func:`buffers_in_backward`):
``... + runtime + buffers + max(activations + logits, step)``. Sizes are bytes; GiB = 2**30 bytes.

- **parameters**: this rank's share: transformer linears and vocab-parallel tables/head divided by TP as
  megatron-core shards them (the padded vocabulary, ``sizes.padded_vocab_size``); norms, LEV's codebooks and
  the other replicated input-layer pieces in full; LEV's per-head parts divided by TP (docs/lev.md). TIED with
  PP > 1 holds its table on the first and the last stage (DeepSpeed's ``TiedLayerSpec``). Bytes per parameter
  follow the optimizer wrapper DeepSpeed 0.19.8 picks for ``engine.deepspeed_config`` (a = 4 where bf16
  gradients accumulate in fp32, ``parallel.grad_accum_dtype`` auto at ZeRO >= 1 without the pipeline, else w):

  ========================================  =======  ===========  ============  =========================
  case (w = 2 for bf16/fp16, 4 for fp32)    weights  gradients    optimizer     step temporaries
  ========================================  =======  ===========  ============  =========================
  fp32, ZeRO 0 (our AdamW, no wrapper)      4        4            8 (m, v)      16 x largest tensor
  bf16/fp16, ZeRO 0 (FP16_UnfusedOptimizer) 2        2            12            4 (fp32 grads) + 8 x lt.
  bf16, ZeRO 1, a = 4 (BF16_Optimizer)      2        4 (acc) *    12 / DP       8 / DP
  ZeRO 1 (DeepSpeedZeroOptimizer)           w        w            12 / DP       12 / DP
  ZeRO 2                                    w        a / DP       12 / DP       12 / DP
  ZeRO 3                                    w / DP   a / DP       12 / DP       12 / DP
  ========================================  =======  ===========  ============  =========================

  12 = fp32 master weights + Adam m + v (the ZeRO paper's K = 12), also for an fp32 model under ZeRO >= 1.
  * BF16_Optimizer keeps the whole accumulator; with ``parallel.immediate_grad_update`` (its default) each bf16
  ``.grad`` is added in and freed as autograd finishes it (counted: 2 x the largest tensor), without it every bf16
  ``.grad`` is kept (zeroed, never freed: 2 more). Step temporaries:
  the fp32 gradients made before ``optimizer.step`` (FP16_UnfusedOptimizer: of every parameter; ZeRO: the flat
  fp32 partition, 4 / DP; BF16_Optimizer's fp32 accumulator is used in place) and torch AdamW's
  temporaries, 8 B per element of the tensor it works on (the whole flat partition under ZeRO, else the
  largest tensor); our fp32 clipping squares each gradient in float64 (16 B x the largest tensor). Gradients
  are counted as held through forward and backward, which they are from the second micro-batch of an
  accumulation on (at accumulation 1 they are mostly allocated as backward frees activations: the estimate
  is high by up to the gradients there); they are freed after the step (ZeRO 0 and 1 alike, measured),
  except BF16_Optimizer's.
- **activations** (per micro-batch, times the micro-batches in flight on that stage: ``min(PP - stage,
  accumulation)`` for DeepSpeed's 1F1B, 1 at PP = 1), e = activation bytes (2 bf16/fp16, 4 fp32), T = s x b
  tokens, per transformer layer: ``T * (2 (8 + e) D + e (A D + 5 F) / TP)``, A = 6 with multi-head attention
  (q and k after RoPE, the whole QKV output a ``v`` view keeps alive, the attention output), 4 with GQA (q
  and the expanded k, v, the output); the 5F are SwiGLU's fc1 output (2F), SiLU output, the linear half plus
  its offset and fc2's input. Each RMSNorm is torch's composite ``rms_norm`` (measured on CPU: the input and
  the normalised input in fp32, the output in e; a fused kernel on GPU would keep less). Attention: SDPA
  (``auto``, every device) has no s^2 term; ``megatron`` (``DotProductAttention``) keeps the fp32 softmax and its
  cast to e: ``T * a / TP * s * (4 + e)`` per layer (4 alone in fp32), plus one layer's working set ``(2 e + 4) b
  a / TP s^2`` (megatron's global baddbmm buffer and the fp32 scores). Stage 0 adds the input layer's saved
  tensors (LEV: four fp32 ``[n, heads / TP, d_seed]`` tensors and M ``[n, heads / TP, r]``, n = min(T, V) unique
  ids, an upper bound), the last stage the final norm ``T (8 + e) D``; with PP > 1 each micro-batch in flight
  also keeps its stage input and output in DeepSpeed's pipe buffers (``2 e T D``). When accumulating, one more
  tensor: autograd's fresh gradient of the stage's largest weight (``e`` x its elements), which exists next to
  the accumulated ``.grad`` until it is added in (the head's, at the start of backward). No dropout.
  ``model.recompute`` (:func:`recompute_bytes`): ``selective`` drops the recomputed modules' tensors
  (``mlp``: the 5F; ``core_attn``: megatron's softmax, GQA's expanded k and v) and ``full`` keeps only ``e T D``
  per recomputed layer, each adding once the activations of the layer being recomputed.
  ``parallel.sequence_parallel`` (Megatron's sequence parallelism, TP >= 2; :mod:`.activations`): what every TP
  rank holds in full without it is the sequence shard, divided by TP: the norms' ``2 (8 + e) D`` (the
  column-parallel linears' inputs among them: saved as the shard, gathered again in backward), a fully recomputed
  layer's ``e T D``, the final norm's ``T (8 + e) D``, the pipe buffers' ``2 e T D``; ``e (A D + 5 F) / TP`` and
  the input layer's tensors are unchanged. The head all-gathers the sequence first and keeps its input ``e T D`` in
  full (counted only with SP: without it that tensor is the final norm's output).
- **logits** (last stage, one micro-batch; :func:`logits_bytes`): ``model.loss_impl=fused`` (model/loss.py)
  holds one chunk of c tokens (``sizes.loss_chunk_tokens``, balanced by ``sizes.balanced_chunk``) at a time:
  ``c * V_pad / TP * (4 + e)`` (the e GEMM output next to its fp32 copy; 4 alone in fp32), the hidden-state
  gradient ``e T D`` and, for e != 4, the fp32 sum of the head weight's gradient plus one chunk's e product
  (``(4 + e) V_pad / TP * D``).
  ``liger`` (model/loss_liger.py; ``auto`` resolves to it for a GPU plan at TP = 1 when liger-kernel and triton are
  installed here: ``settings.resolved_loss_impl``) holds only the e logits of a chunk, sized from the same budget at
  e bytes per logit: ``c * V_pad * e``, the fp32 hidden-state gradient ``4 T D`` and, for e != 4, the fp32 sum of the
  head weight's gradient ``4 V_pad D`` (on a GPU the chunk's product is summed inside the GEMM). A GPU whose kernel
  fails to compile falls back to ``fused`` under ``auto``, which holds more (the plan does not know).
  ``megatron``: ``T * V_pad / TP * 4`` for the fp32 softmax ``vocab_parallel_cross_entropy`` keeps for
  backward, plus ``T * V_pad / TP * e`` for the e logits next to it (in fp32 the cast is a no-op).
- **buffers**: DeepSpeed's gradient buckets, B = ``parallel.reduce_bucket_elements`` (5e8): ZeRO 0 flattens the
  gradients for the all-reduce (``min(P, 5e8)`` elements in the gradient dtype); BF16_Optimizer
  casts its fp32 accumulator to bf16 for the all-reduce (2P), below 5e8 elements after flattening all groups
  into one fp32 bucket (+4P); ZeRO 1/2 keep a B-element bucket in w, two with ``overlap_comm`` (on by default on
  GPU; ``torch.empty``: a GPU reserves all of it, a CPU only touches ``min(B, P)``); ZeRO 3 adds the 5e7-element
  prefetch bucket. No separate all-gather buffer (stage 1/2 gather into the flat weights in place).
- **runtime**: a fixed :data:`GPU_RUNTIME_GIB` on GPU (CUDA context, cuBLAS workspaces, NCCL communicators'
  buffers; an allowance, not a measurement), 0 on CPU.

Not counted: allocator fragmentation (reserved minus allocated; keep ~10% headroom), DeepSpeed's alignment
padding, LEV's chunk buffers (they live inside its forward/backward only, never at the peak), the data
loader and other host-side bookkeeping (~40 MB of RSS on CPU). ``benchmarks/bench_memory.py`` checks the
CPU-applicable parts against the real trainer's peak RSS (within ~5% low at the default benchmark model).

Problems (``plan.problems``, filled by :func:`make_plan`; :func:`plan_problems` returns them): TP x PP not
dividing the world size, a global batch that is not a multiple of micro batch x DP, PP > num_layers, fp16 or
``attention_backend=megatron`` on CPU, and the estimated total over ``mem_limit_gb``, which names up to three
layouts that fit on the same nodes (:func:`fitting_layouts`) as overrides. What config loading already refuses
(TP not dividing the heads, ZeRO > 1 with PP > 1, sequence parallelism at TP = 1) is not checked again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.dtypes import DTYPES, nbytes
from leviathan_pretrain.config.parallel import accumulation_steps, batch_problem
from leviathan_pretrain.model import counts, sizes, variants
from leviathan_pretrain.model.settings import liger_installed, resolved_loss_impl
from leviathan_pretrain.plan import layouts
from leviathan_pretrain.plan.activations import (
    attention_kind,
    recompute_bytes,
    recompute_text,
    stage_activation_bytes,
)
from leviathan_pretrain.plan.layouts import Layout
from leviathan_pretrain.plan.stages import stage_layout

GIB = 2**30
GPU_RUNTIME_GIB = 2.0  # CUDA context + cuBLAS workspaces (~0.75 GiB) + NCCL communicators (~1.25 GiB): an allowance
DS_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's fallback all-reduce bucket (MEMORY_OPT_ALLREDUCE_SIZE)
DS_PREFETCH_ELEMENTS = 50_000_000  # ZeRO-3 stage3_prefetch_bucket_size default
BYTES = {name: nbytes(name) for name in DTYPES}
COMPONENTS = ("parameters", "gradients", "optimizer", "activations", "logits", "buffers", "step", "runtime")


@dataclass
class Plan:
    nodes: int
    ranks_per_node: int
    world: int
    tp: int
    pp: int
    dp: int
    micro_batch: int
    global_batch: int
    grad_accum: int
    seq_length: int
    tokens_per_step: int
    device: str  # "gpu" or "cpu"
    mem_limit_gb: float | None  # GiB per GPU; None: no check (e.g. CPU runs)
    memory: dict[str, float] = field(default_factory=dict)  # bytes per rank by component, and "total"
    problems: list[str] = field(default_factory=list)  # "<dotted key or --option>: reason"
    stage: int = 0  # the most loaded pipeline stage (the one ``memory`` describes)
    optimizer: str = ""  # the optimizer wrapper DeepSpeed will use
    zero_stage: int = 0
    precision: str = "fp32"
    params_per_rank: int = 0  # parameters held by one rank of that stage (before ZeRO partitioning)
    buffers_in_backward: bool = False  # see buffers_in_backward(): how ``total`` adds the buffers
    loss_impl: str = ""  # model.loss_impl as the build would resolve it (loss_impl())
    recompute: str = "none"  # model.recompute in words (recompute_text())
    sequence_parallel: bool = False  # parallel.sequence_parallel (at TP >= 2)


# ---------------------------------------------------------------- parameters per TP rank


def _layer_params(m, tp: int) -> int:
    """One transformer layer's parameters on one TP rank (two RMSNorms replicated)."""
    replicated, sharded = sizes.layer_params_split(m)
    return replicated + sharded // tp


def _input_params(m, tp: int) -> int:
    """The input layer's parameters on one TP rank (vocab-parallel tables and sharded heads/hidden divided by TP,
    the rest replicated), as the layers in model/inputs.py and model/lev.py allocate them."""
    return counts.input_split(m, tp).per_rank(tp)


def _head_params(m, tp: int) -> int:
    """The output head on one TP rank (TIED: its table, which the last stage holds when PP > 1)."""
    return sizes.padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp) * m.hidden_size // tp


def _largest_tensor(m, tp: int, st: dict) -> int:
    """Elements of the largest parameter tensor on one rank of stage ``st`` (what per-tensor temporaries scale
    with: a fresh gradient before it is added into ``.grad``, AdamW's and our clipping's per-tensor work)."""
    D, F = m.hidden_size, m.resolved_ffn_hidden_size()
    kv = (m.num_query_groups or m.num_attention_heads) * (D // m.num_attention_heads)
    v_pad = sizes.padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    cands = [2 * F * D // tp, D * (D + 2 * kv) // tp] if st["blocks"] else [m.hidden_size]
    if st["head"]:
        cands.append(_head_params(m, tp))
    if st["input"]:
        cands.append(variants.get(m.variant).largest_tensor(m, tp, v_pad))
    return max(cands)


def buffers_in_backward(device: str, zero_stage: int, pipeline: bool = False) -> bool:
    """True when DeepSpeed's bucket is live together with the activations: ZeRO >= 1 on GPU without the
    pipeline engine, where the reduce bucket is allocated in full when the first gradient hook fires at the start
    of backward. ZeRO 0 (and the pipeline engine) reduce after backward, and on CPU the bucket's pages fill only
    as gradients move into it (their own storage is freed): measured, it adds to neither peak there."""
    return device == "gpu" and zero_stage >= 1 and not pipeline


def peak_total(mem: dict, in_backward: bool) -> float:
    """``parameters + gradients + optimizer + runtime``, plus ``buffers + max(activations + logits, step)`` when
    the buffers are live during backward (:func:`buffers_in_backward`), else ``max(activations + logits,
    buffers, step)``: the three phases (forward/backward, gradient reduction, optimizer step) do not overlap."""
    fixed = mem["parameters"] + mem["gradients"] + mem["optimizer"] + mem["runtime"]
    act, buf = mem["activations"] + mem["logits"], mem["buffers"]
    if in_backward:
        return fixed + buf + max(act, mem["step"])
    return fixed + max(act, buf, mem["step"])


# ---------------------------------------------------------------- the loss path


def loss_impl(m, tp: int, device: str) -> str:
    """``model.loss_impl`` as a build on ``device`` (``gpu``/``cpu``) would resolve it (``auto``: ``liger`` on a GPU at
    TP = 1 when liger-kernel is installed here, else ``fused``)."""
    liger_ok = m.loss_impl == "auto" and device == "gpu" and tp == 1 and liger_installed()
    return resolved_loss_impl(m.loss_impl, device, tp, liger_ok)


def logits_bytes(m, tokens: int, tp: int, e: int, device: str) -> float:
    """The loss path's memory for one micro-batch of ``tokens`` on the last stage (see the module doc)."""
    v = sizes.padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp) // tp
    cast = e if e != 4 else 0  # the model-dtype logits next to their fp32 copy (none in fp32)
    impl = loss_impl(m, tp, device)
    if impl == "megatron":
        return float(tokens * v * (4 + cast))
    if impl == "liger":
        c = sizes.balanced_chunk(tokens, sizes.loss_chunk_tokens(v, device, m.loss_chunk_tokens, e))
        gw = (4 + e * (device == "cpu")) * v * m.hidden_size * (e != 4)  # the CPU: a model-dtype product per chunk
        return float(c * v * e + 4 * tokens * m.hidden_size + gw)
    c = sizes.balanced_chunk(tokens, sizes.loss_chunk_tokens(v, device, m.loss_chunk_tokens))
    return float(c * v * (4 + cast) + e * tokens * m.hidden_size + (4 + e) * v * m.hidden_size * (e != 4))


# ---------------------------------------------------------------- optimizer wrappers


def optimizer_wrapper(cfg) -> str:
    """The optimizer DeepSpeed 0.19.8 wraps ours in for this config (``engine._do_optimizer_sanity_check``)."""
    p = cfg.parallel
    if p.zero_stage == 3:
        return "DeepSpeedZeroOptimizer_Stage3"
    if p.uses_bf16_optimizer_fp32:  # bf16, ZeRO 1, fp32 accumulation, not the pipeline engine
        return "BF16_Optimizer"
    if p.zero_stage in (1, 2):
        return "DeepSpeedZeroOptimizer"
    return "AdamW (no wrapper)" if p.precision == "fp32" else "FP16_UnfusedOptimizer"


def state_bytes(cfg, params: int, largest: int, dp: int, device: str) -> dict[str, float]:
    """``parameters``, ``gradients``, ``optimizer``, ``buffers``, ``step`` bytes for ``params`` parameters on
    one rank (see the module doc's table)."""
    pc = cfg.parallel
    w, z, kind = BYTES[pc.precision], pc.zero_stage, optimizer_wrapper(cfg)
    a = 4 if pc.precision == "bf16" and pc.resolved_grad_accum_dtype == "fp32" else w
    P, B = float(params), pc.reduce_bucket_elements

    def bucket(elements: int) -> float:  # torch.empty: the GPU reserves it all, a CPU only touches what is written
        return elements * w if device == "gpu" else min(elements, params) * w

    if kind == "AdamW (no wrapper)":
        out = dict(parameters=4 * P, gradients=4 * P, optimizer=8 * P, step=16.0 * largest)
        out["buffers"] = 4.0 * min(P, DS_BUCKET_ELEMENTS)
    elif kind == "FP16_UnfusedOptimizer":
        out = dict(parameters=2 * P, gradients=2 * P, optimizer=12 * P, step=4 * P + 8.0 * largest)
        out["buffers"] = 2.0 * min(P, DS_BUCKET_ELEMENTS)
    elif kind == "BF16_Optimizer":
        # immediate_grad_update (the default): each bf16 .grad is added into the fp32 accumulator as autograd
        # finishes it, then freed: about the largest one at a time; without it every bf16 .grad stays
        lp = 2.0 * largest if pc.resolved_immediate_grad_update else 2 * P
        out = dict(parameters=2 * P, gradients=4 * P + lp, optimizer=12 * P / dp, step=8 * P / dp)
        out["buffers"] = 2 * P + 4 * P * (P < DS_BUCKET_ELEMENTS)
    else:
        overlap = z in (1, 2) and pc.resolved_overlap_comm(device == "gpu")
        out = dict(
            parameters=w * P / (dp if z == 3 else 1),
            gradients=(a * P / dp) if z >= 2 else w * P,
            optimizer=12 * P / dp,
            step=12 * P / dp,
            buffers=bucket(B) * (2 if overlap else 1) + (bucket(DS_PREFETCH_ELEMENTS) if z == 3 else 0.0),
        )
    return out


# ---------------------------------------------------------------- the plan


def _stage_memory(cfg, st: dict, stage: int, pp: int, tp: int, dp: int, gas: int, device: str):
    """``({component: bytes, "total": bytes}, parameters)`` of one rank of pipeline stage ``stage``."""
    m, t, pipeline = cfg.model, cfg.train, cfg.parallel.uses_pipeline_engine
    e = BYTES[cfg.parallel.precision]
    b, s = t.micro_batch_size, m.seq_length
    T = b * s
    params = st["blocks"] * _layer_params(m, tp)
    params += _input_params(m, tp) if st["input"] else 0
    params += m.hidden_size if st["final"] else 0
    params += _head_params(m, tp) if st["head"] and not (variants.get(m.variant).tied_head and st["input"]) else 0
    largest = _largest_tensor(m, tp, st)
    mem = state_bytes(cfg, params, largest, dp, device)
    attn, sp = attention_kind(m, device), cfg.parallel.sequence_parallel and tp > 1
    per_mb, working = recompute_bytes(m, st["blocks"], T, tp, e, attn, sp)
    per_mb += stage_activation_bytes(m, st, T, tp, e, pp, sp)
    in_flight = min(pp - stage, gas) if pp > 1 else 1
    act = in_flight * per_mb + working
    # accumulating: autograd's fresh gradient of the largest weight, before it is added into .grad (with
    # immediate_grad_update, only ever on BF16_Optimizer, no .grad is kept: counted with the gradients instead)
    if gas > 1 and not cfg.parallel.resolved_immediate_grad_update:
        act += e * largest
    if attn == "megatron" and st["blocks"]:
        act += (2 * e + 4 if e != 4 else 2 * e) * b * m.num_attention_heads / tp * s * s
    logits = logits_bytes(m, T, tp, e, device) if st["head"] else 0.0
    mem.update(activations=act, logits=float(logits), runtime=GPU_RUNTIME_GIB * GIB if device == "gpu" else 0.0)
    mem["total"] = peak_total(mem, buffers_in_backward(device, cfg.parallel.zero_stage, pipeline))
    return {k: float(mem[k]) for k in (*COMPONENTS, "total")}, params


def make_plan(cfg, nodes: int, ranks_per_node: int, device: str = "gpu", mem_limit_gb: float | None = 80.0) -> Plan:
    """The plan of ``cfg`` (a loaded :class:`~leviathan_pretrain.config.Config`) on ``nodes`` x ``ranks_per_node``
    ranks; ``device`` is ``"gpu"`` or ``"cpu"``; ``mem_limit_gb`` the GPU's memory in GiB (None: no check)."""
    if device not in ("gpu", "cpu"):
        raise ValueError(f"device must be 'gpu' or 'cpu', got {device!r}")
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tp, pp = p.tensor_parallel, p.pipeline_parallel
    world = nodes * ranks_per_node
    problems = []
    if nodes < 1 or ranks_per_node < 1:
        problems.append(
            f"--nodes/--gpus-per-node: need at least 1 node and 1 rank per node, got {nodes} x {ranks_per_node}"
        )
    if world >= 1 and world % (tp * pp):
        problems.append(
            f"--nodes/--gpus-per-node: world size {nodes} x {ranks_per_node} = {world} is not divisible by "
            f"parallel.tensor_parallel x parallel.pipeline_parallel = {tp} x {pp} = {tp * pp}; use a multiple of "
            f"{tp * pp} ranks or change parallel.tensor_parallel/parallel.pipeline_parallel"
        )
    dp = max(1, world // (tp * pp))
    mb, gb = t.micro_batch_size, t.global_batch_size
    if problem := batch_problem(gb, mb, dp):
        problems.append(problem)
    gas = accumulation_steps(gb, mb, dp)
    if pp > m.num_layers:
        problems.append(
            f"parallel.pipeline_parallel: {pp} stages for model.num_layers={m.num_layers} layers (a stage would "
            f"hold none); use at most {m.num_layers}"
        )
    if device == "cpu" and p.precision == "fp16":
        problems.append("parallel.precision: fp16 needs CUDA (DeepSpeed has no CPU fp16 path); use fp32 or bf16 on CPU")
    if device == "cpu" and m.attention_backend == "megatron":
        problems.append("model.attention_backend: 'megatron' (DotProductAttention) needs CUDA; use 'sdpa' or 'auto'")
    per_stage = [
        _stage_memory(cfg, st, i, pp, tp, dp, gas, device) for i, st in enumerate(stage_layout(m.num_layers, pp))
    ]
    stage = max(range(pp), key=lambda i: per_stage[i][0]["total"])
    memory, params = per_stage[stage]
    plan = Plan(
        nodes=nodes,
        ranks_per_node=ranks_per_node,
        world=world,
        tp=tp,
        pp=pp,
        dp=dp,
        micro_batch=mb,
        global_batch=gb,
        grad_accum=gas,
        seq_length=m.seq_length,
        tokens_per_step=gb * m.seq_length,
        device=device,
        mem_limit_gb=mem_limit_gb,
        memory=memory,
        problems=problems,
        stage=stage,
        optimizer=optimizer_wrapper(cfg),
        zero_stage=p.zero_stage,
        precision=p.precision,
        params_per_rank=params,
        buffers_in_backward=buffers_in_backward(device, p.zero_stage, p.uses_pipeline_engine),
        loss_impl=loss_impl(m, tp, device),
        recompute=recompute_text(m),
        sequence_parallel=p.sequence_parallel and tp > 1,
    )
    if mem_limit_gb is not None and memory["total"] > mem_limit_gb * GIB:
        problems.append(_memory_problem(cfg, plan))
    return plan


# ---------------------------------------------------------------- layouts that fit


def fitting_layouts(
    cfg, nodes: int, ranks_per_node: int, device: str = "gpu", mem_limit_gb: float = 80.0, count: int = 3
) -> tuple[list[Layout], Layout | None]:
    """``(up to count layouts that fit, the smallest of all)`` on the same ``nodes`` x ``ranks_per_node``, cheapest
    first (:func:`.layouts.fitting_layouts`: what it tries and in which order): each one :func:`make_plan`."""

    def total(c) -> float | None:
        plan = make_plan(c, nodes, ranks_per_node, device, None)
        return None if plan.problems else plan.memory["total"]

    return layouts.fitting_layouts(cfg, nodes * ranks_per_node, ranks_per_node, total, mem_limit_gb * GIB, count)


def _memory_problem(cfg, plan: Plan) -> str:
    mem, p = plan.memory, cfg.parallel
    ranked = sorted(COMPONENTS, key=lambda k: -mem[k])
    top = ", ".join(f"{k} {mem[k] / GIB:.1f}" for k in ranked[:3] if mem[k] > 0)
    hints = []
    acts = mem["activations"] + mem["logits"] >= mem["parameters"] + mem["gradients"] + mem["optimizer"]
    if acts:
        hints.append("a smaller train.micro_batch_size (activations and logits scale with it)")
        if not plan.sequence_parallel:
            need = "; needs parallel.tensor_parallel >= 2" if plan.tp == 1 else ""
            hints.append(f"parallel.sequence_parallel=true (divides the norms' and residuals' activations by TP{need})")
        hints += [h for h in [layouts.recompute_hint(cfg.model)] if h]
        hints.append("more parallel.tensor_parallel (divides activations, logits and weights)")
    else:
        if plan.dp > 1 and p.zero_stage < (1 if plan.pp > 1 else 3):
            hints.append(
                f"a higher parallel.zero_stage (partitions optimizer states, then gradients, then weights over "
                f"DP={plan.dp})"
            )
        hints.append("more parallel.tensor_parallel or parallel.pipeline_parallel (fewer weights per rank)")
        hints.append("a smaller train.micro_batch_size")
    where = f"pipeline stage {plan.stage}, " if plan.pp > 1 else ""
    what = "activations and logits" if acts else "weights, gradients and optimizer states"
    text = (
        f"--gpu-mem-gb: estimated {mem['total'] / GIB:.1f} GiB per GPU ({where}largest: {top} GiB; {what} dominate) "
        f"exceeds {plan.mem_limit_gb:g} GiB; try " + ", or ".join(hints)
    )
    fits, smallest = fitting_layouts(cfg, plan.nodes, plan.ranks_per_node, plan.device, plan.mem_limit_gb)
    scope = (
        f"on {plan.nodes} x {plan.ranks_per_node} GPUs (ZeRO 1, micro batch {plan.micro_batch}, global batch "
        f"{plan.global_batch})"
    )
    if fits:
        rows = [f"    {lay.total / GIB:.1f} GiB: {' '.join(lay.overrides)}" for lay in fits]
        return "\n".join([text, f"  layouts that fit {scope}, cheapest first; add one as overrides:", *rows])
    tried = "TP 1-8 x PP x sequence parallel x recompute none/selective/full"
    if smallest is None:
        return f"{text}\n  no layout ({tried}) can run {scope}"
    return (
        f"{text}\n  no layout ({tried}) fits {scope}; the smallest, {smallest.total / GIB:.1f} GiB: "
        f"{' '.join(smallest.overrides)}; use more nodes or a smaller train.micro_batch_size"
    )


def plan_problems(plan: Plan) -> list[str]:
    """The plan's problems (:func:`make_plan` fills ``plan.problems``; empty: the geometry can work)."""
    return list(plan.problems)


def format_plan(plan: Plan) -> str:
    """A multi-line human summary: grid, batch arithmetic, the memory table (GiB) against the limit, problems."""
    mem = plan.memory
    lines = [
        f"plan: {plan.nodes} node(s) x {plan.ranks_per_node} rank(s) = world {plan.world} ({plan.device}); "
        f"TP {plan.tp} x PP {plan.pp} x DP {plan.dp}",
        f"batch: micro {plan.micro_batch} x accumulation {plan.grad_accum} x DP {plan.dp} = global "
        f"{plan.global_batch} sequences x {plan.seq_length} tokens = {plan.tokens_per_step:,} tokens/step",
        f"memory per rank, GiB (pipeline stage {plan.stage} of {plan.pp}; ZeRO {plan.zero_stage}, {plan.precision}, "
        f"{plan.optimizer}; {plan.params_per_rank / 1e6:,.1f}M parameters on this rank; loss {plan.loss_impl}; "
        f"sequence parallel {'on' if plan.sequence_parallel else 'off'}; recompute {plan.recompute}):",
    ]
    for k in COMPONENTS:
        lines.append(f"  {k:<12} {mem[k] / GIB:9.2f}")
    limit = plan.mem_limit_gb
    share = f" of {limit:g} ({100 * mem['total'] / (limit * GIB):.0f}%)" if limit else " (no limit checked)"
    lines.append(f"  {'total':<12} {mem['total'] / GIB:9.2f}{share}")
    if plan.buffers_in_backward:
        lines.append(
            "  (total = parameters + gradients + optimizer + runtime + buffers + max(activations + logits, step))"
        )
    else:
        lines.append(
            "  (total = parameters + gradients + optimizer + runtime + max(activations + logits, buffers, step))"
        )
    lines += [f"problem: {x}" for x in plan.problems] or ["problems: none"]
    return "\n".join(lines)
