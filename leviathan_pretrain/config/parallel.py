"""The ``parallel`` section of the config schema (:class:`ParallelConfig`): world layout, ZeRO, precision,
gradient accumulation dtype, DeepSpeed buckets and the collectives' timeouts. ``leviathan_pretrain.config``
re-exports it; validation raises :class:`~leviathan_pretrain.config.loader.ConfigError` naming the dotted key."""

from __future__ import annotations

from dataclasses import dataclass

from leviathan_pretrain.config.loader import require


def batch_problem(global_batch: int, micro_batch: int, dp: int) -> str | None:
    """Why ``global_batch`` does not split into micro-batches x data-parallel ranks (None: it does)."""
    unit = micro_batch * dp
    if global_batch % unit == 0:
        return None
    near = max(1, round(global_batch / unit)) * unit
    return (
        f"train.global_batch_size: {global_batch} is not a multiple of train.micro_batch_size x data-parallel size "
        f"= {micro_batch} x {dp} = {unit}; set it to a multiple of {unit} (e.g. {near}) "
        "or change train.micro_batch_size or the number of ranks"
    )


def accumulation_steps(global_batch: int, micro_batch: int, dp: int) -> int:
    """Micro-batches per optimizer step on each data-parallel rank (the batch must split: :func:`batch_problem`)."""
    return max(1, global_batch // (micro_batch * dp))


@dataclass
class ParallelConfig:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    pipeline_engine: bool = False  # use DeepSpeed's pipeline engine even at pipeline_parallel=1
    # Megatron's sequence parallelism at TP >= 2: the norms, residuals and the input layer's output are split along
    # the sequence over the TP group (all-reduces become reduce-scatter + all-gather); model/tp.py, model/sp.py
    sequence_parallel: bool = False
    zero_stage: int = 1
    backend: str = "auto"  # auto (nccl on GPU, gloo on CPU) | nccl | gloo
    precision: str = "fp32"  # fp32 | bf16 | fp16
    device: str = "auto"  # auto | cpu | cuda
    # True: megatron-core's layers draw their full master weights on the CPU and keep their slice (TP = N
    # starts from exactly the TP = 1 weights; every rank then builds whole V x D tables on the CPU: slow,
    # GBs of RAM at V = 200k). False: on the GPU, per TP shard (megatron's default). CPU runs always do the former.
    init_on_cpu: bool = False
    # bf16 gradient accumulation over micro-batches (DeepSpeed data_types.grad_accum_dtype): auto = fp32 at ZeRO
    # 1-3 (ZeRO 1: BF16_Optimizer), bf16 at ZeRO 0 (DeepSpeed 0.19.8 has no fp32 path there) and with the
    # pipeline engine (BF16_Optimizer sums wrong gradients there) | fp32 | bf16
    grad_accum_dtype: str = "auto"
    # DeepSpeed bf16.immediate_grad_update: BF16_Optimizer adds each parameter's bf16 gradient into its fp32
    # accumulator from a hook as soon as autograd has it, then frees it (false: DeepSpeed's default, every bf16
    # gradient kept and added after each backward). null: on wherever BF16_Optimizer accumulates in fp32 (bf16,
    # ZeRO 1, fp32 accumulation, not the pipeline engine); true elsewhere is refused (nothing reads it there)
    immediate_grad_update: bool | None = None
    overlap_comm: bool | None = None  # ZeRO 1/2: reduce gradients during backward; null: true on CUDA, false on CPU
    reduce_bucket_elements: int = 500_000_000  # ZeRO 1-3 reduce bucket (GPU: 2 of them with overlap_comm)
    allgather_bucket_elements: int = 500_000_000  # ZeRO 1/2 and BF16_Optimizer weight all-gather chunk
    timeout_minutes: float = 10.0  # every collective of the training steps (TP/PP/DP groups, the per-step stop vote)
    init_timeout_minutes: float = 60.0  # start-up (data checks, index build) and checkpoint saves

    def validate(self, prefix: str) -> None:
        require(self.tensor_parallel >= 1, f"{prefix}.tensor_parallel", "must be >= 1")
        require(self.pipeline_parallel >= 1, f"{prefix}.pipeline_parallel", "must be >= 1")
        require(self.zero_stage in (0, 1, 2, 3), f"{prefix}.zero_stage", f"must be 0-3, got {self.zero_stage}")
        require(
            not ((self.pipeline_parallel > 1 or self.pipeline_engine) and self.zero_stage > 1),
            f"{prefix}.zero_stage",
            f"DeepSpeed's pipeline engine supports ZeRO stage <= 1; got zero_stage={self.zero_stage} "
            f"with pipeline_parallel={self.pipeline_parallel}",
        )
        require(self.backend in ("auto", "nccl", "gloo"), f"{prefix}.backend", f"unknown {self.backend!r}")
        require(self.precision in ("fp32", "bf16", "fp16"), f"{prefix}.precision", f"unknown {self.precision!r}")
        require(self.device in ("auto", "cpu", "cuda"), f"{prefix}.device", f"unknown {self.device!r}")
        require(
            self.grad_accum_dtype in ("auto", "fp32", "bf16"),
            f"{prefix}.grad_accum_dtype",
            f"must be auto, fp32 or bf16, got {self.grad_accum_dtype!r}",
        )
        require(
            self.grad_accum_dtype != "bf16" or self.precision == "bf16",
            f"{prefix}.grad_accum_dtype",
            f"bf16 accumulation needs parallel.precision=bf16 (got {self.precision}); use auto",
        )
        require(
            self.grad_accum_dtype != "fp32" or self.precision != "fp16",
            f"{prefix}.grad_accum_dtype",
            "fp16 runs accumulate in fp16 (DeepSpeed's loss-scaled path); use auto",
        )
        require(
            not (self.grad_accum_dtype == "fp32" and self.precision == "bf16" and self.zero_stage == 0),
            f"{prefix}.grad_accum_dtype",
            "fp32 accumulation of bf16 gradients needs parallel.zero_stage >= 1: DeepSpeed 0.19.8 has no ZeRO 0 "
            "path for it (_do_optimizer_sanity_check raises NotImplementedError); use zero_stage=1 (BF16_Optimizer, "
            "the same memory at DP=1) or grad_accum_dtype=bf16",
        )
        require(
            not (self.precision == "bf16" and self.uses_pipeline_engine and self.resolved_grad_accum_dtype == "fp32"),
            f"{prefix}.grad_accum_dtype",
            "fp32 accumulation with DeepSpeed's pipeline engine uses BF16_Optimizer, which sums wrong gradients "
            "there when accumulating (DeepSpeed 0.19.8, tests/test_grad_accum.py); use grad_accum_dtype=bf16",
        )
        require(
            not (self.precision == "bf16" and self.uses_pipeline_engine and self.zero_stage == 0),
            f"{prefix}.zero_stage",
            "bf16 with DeepSpeed's pipeline engine at ZeRO 0 uses BF16_Optimizer, which sums wrong gradients "
            "there when accumulating (DeepSpeed 0.19.8, tests/test_grad_accum.py); use zero_stage=1",
        )
        require(
            self.immediate_grad_update is not True or self.uses_bf16_optimizer_fp32,
            f"{prefix}.immediate_grad_update",
            "true applies only to DeepSpeed's BF16_Optimizer accumulating in fp32 (parallel.precision=bf16, "
            "zero_stage=1, grad_accum_dtype auto or fp32, not the pipeline engine); here precision="
            f"{self.precision}, zero_stage={self.zero_stage}, accumulation {self.resolved_grad_accum_dtype}"
            + (", the pipeline engine" if self.uses_pipeline_engine else "")
            + ": leave it null (or false)",
        )
        for name in ("reduce_bucket_elements", "allgather_bucket_elements"):
            v = getattr(self, name)
            require(v >= 2 and v % 2 == 0, f"{prefix}.{name}", f"must be an even number >= 2 (DeepSpeed), got {v}")
        require(self.timeout_minutes > 0, f"{prefix}.timeout_minutes", "must be > 0")
        require(self.init_timeout_minutes > 0, f"{prefix}.init_timeout_minutes", "must be > 0")
        require(
            not self.sequence_parallel or self.tensor_parallel >= 2,
            f"{prefix}.sequence_parallel",
            f"splits the sequence over the tensor-parallel group, which has 1 rank here (tensor_parallel="
            f"{self.tensor_parallel}); set parallel.tensor_parallel >= 2 or sequence_parallel=false",
        )

    @property
    def uses_pipeline_engine(self) -> bool:
        return self.pipeline_parallel > 1 or self.pipeline_engine

    @property
    def resolved_grad_accum_dtype(self) -> str:
        """The dtype gradients accumulate in: ``grad_accum_dtype`` with ``auto`` resolved (fp32 for bf16 at ZeRO
        1-3, else the model dtype)."""
        if self.grad_accum_dtype != "auto":
            return self.grad_accum_dtype
        if self.precision == "bf16":  # the pipeline engine: see validate (BF16_Optimizer's wrong sums there)
            return "fp32" if self.zero_stage >= 1 and not self.uses_pipeline_engine else "bf16"
        return self.precision

    @property
    def uses_bf16_optimizer_fp32(self) -> bool:
        """Whether DeepSpeed (0.19.8) runs this layout through ``BF16_Optimizer`` with an fp32 accumulator: bf16
        at ZeRO 1 with fp32 accumulation, outside the pipeline engine (which refuses fp32, see validate)."""
        return (
            self.precision == "bf16"
            and self.zero_stage == 1
            and self.resolved_grad_accum_dtype == "fp32"
            and not self.uses_pipeline_engine
        )

    @property
    def resolved_immediate_grad_update(self) -> bool:
        """DeepSpeed's ``bf16.immediate_grad_update``: ``immediate_grad_update`` with null resolved (on wherever
        :attr:`uses_bf16_optimizer_fp32`, else off)."""
        if self.immediate_grad_update is None:
            return self.uses_bf16_optimizer_fp32
        return self.immediate_grad_update

    def resolved_overlap_comm(self, cuda: bool) -> bool:
        """``overlap_comm`` with ``null`` resolved for this device (true on CUDA, false on CPU)."""
        return cuda if self.overlap_comm is None else self.overlap_comm
