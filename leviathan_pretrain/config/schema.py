"""The one config schema used by every entry point (train, params, evaluate, export, launchers).

``load_config(path, overrides)`` returns a validated :class:`Config`; invalid values fail at load
with a :class:`ConfigError` naming the dotted key. Field defaults follow the LEV spec
(``docs/lev.md``) and LLaMA-style GPT conventions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from leviathan_pretrain.config.loader import ConfigError, load, require
from leviathan_pretrain.config.parallel import ParallelConfig
from leviathan_pretrain.config.run import CheckpointConfig, TrainConfig
from leviathan_pretrain.model import variants  # closed forms only: no torch/megatron import

VARIANTS = variants.names()  # the paper's six (model/variants.py); a registered one is accepted too


LEV_KERNELS = ("auto", "torch", "triton")  # model.lev.kernel
LEV_GEMM_DTYPES = ("auto", "fp32", "model")  # model.lev.gemm_dtype


@dataclass
class LEVConfig:
    """LEV input layer hyper-parameters (spec defaults)."""

    digits: int = 3  # k: number of base-b digits of the token id
    base: int | None = None  # b; None -> ceil(V ** (1/k))
    seed_dim: int = 128  # d_seed
    heads: int = 8  # h
    knots: int = 16  # kappa (uniform knots on [0, 1])
    rank: int = 64  # r
    sigmoid_scale: float = 0.5  # u = sigmoid(scale * LN(W z))
    layernorm_eps: float = 1e-5
    log_eps: float = 1e-9  # M = sign * exp(sum log(|phi| + log_eps))
    init_std: float = 0.02  # codebooks C and head projections W_l
    spline_init_std: float = 0.1  # S = 1 + N(0, spline_init_std^2)
    # W_out ~ N(0, std^2); None -> init_std / sqrt(heads); "match": each head's W_out scaled at init so that
    # G's RMS over a fixed sample of ids is model.init_method_std, a table's (ours, not the paper's; docs/lev.md)
    out_init_std: float | str | None = None
    center: bool = False  # G = sum_l (M_l - 1) @ W_out_l: no common mode at init (ours, not the paper's)
    token_chunk: int | None = None  # unique ids per chunk of the spline work; None -> sized by chunk_mib
    # MiB of one chunk's work buffers (sizes.lev_chunk_ids); None -> per device: 48 on CPU, 512 on CUDA
    chunk_mib: float | None = None
    chunk_elements: int | None = None  # legacy (before chunk_mib): ids = chunk_elements // (heads/tp*d_seed*r)
    recompute: bool = True  # recompute chunk intermediates in backward instead of storing them
    # the spline product: torch (chunks, model/spline.py) | triton (model/spline_triton.py; a GPU, or the CPU under
    # TRITON_INTERPRET=1) | auto (triton on CUDA when it imports, else torch); recompute=false is always torch
    kernel: str = "auto"
    # LEV's output GEMM M @ W_out: fp32 | model (in the model dtype, bf16 on a GPU run) | auto (model on CUDA)
    gemm_dtype: str = "auto"

    def resolved_base(self, vocab_size: int) -> int:
        if self.base is not None:
            return self.base
        b = max(2, math.ceil(vocab_size ** (1.0 / self.digits)))
        while (b - 1) ** self.digits >= vocab_size and b > 2:  # float-rounding guard
            b -= 1
        while b**self.digits < vocab_size:
            b += 1
        return b

    def validate(self, prefix: str) -> None:
        require(self.digits >= 1, f"{prefix}.digits", f"must be >= 1, got {self.digits}")
        require(self.base is None or self.base >= 2, f"{prefix}.base", f"must be >= 2, got {self.base}")
        for name in ("seed_dim", "heads", "rank"):
            v = getattr(self, name)
            require(v >= 1, f"{prefix}.{name}", f"must be >= 1, got {v}")
        for name in ("token_chunk", "chunk_elements"):
            v = getattr(self, name)
            require(v is None or v >= 1, f"{prefix}.{name}", f"must be >= 1 or null (auto), got {v}")
        require(
            self.chunk_mib is None or self.chunk_mib > 0,
            f"{prefix}.chunk_mib",
            f"must be > 0 or null (per device), got {self.chunk_mib}",
        )
        require(
            self.chunk_mib is None or self.chunk_elements is None,
            f"{prefix}.chunk_mib",
            "set chunk_mib or the legacy chunk_elements, not both (chunk_elements: null)",
        )
        require(
            self.knots >= 3, f"{prefix}.knots", f"kappa must be >= 3 for a quadratic B-spline basis, got {self.knots}"
        )
        require(self.log_eps > 0, f"{prefix}.log_eps", "must be > 0")
        require(
            self.kernel in LEV_KERNELS,
            f"{prefix}.kernel",
            f"must be one of {', '.join(LEV_KERNELS)}, got {self.kernel!r}",
        )
        require(
            self.gemm_dtype in LEV_GEMM_DTYPES,
            f"{prefix}.gemm_dtype",
            f"must be one of {', '.join(LEV_GEMM_DTYPES)}, got {self.gemm_dtype!r}",
        )
        std = self.out_init_std
        require(
            std is None or std == "match" or (not isinstance(std, str) and std > 0),
            f"{prefix}.out_init_std",
            f'must be a positive number, null (init_std / sqrt(heads)) or "match", got {std!r}',
        )


RECOMPUTE = ("none", "selective", "full")
RECOMPUTE_MODULES = ("core_attn", "mlp")  # megatron-core's recompute_modules names that apply to a dense layer


@dataclass
class ModelConfig:
    """A LLaMA-style decoder-only GPT; ``variant`` picks the input representation."""

    variant: str = "lev"
    # null -> data.tokenizer's vocabulary (the head is padded as always); the schema default stays 32000 so that
    # configs which name neither load as before (every shipped config sets it)
    vocab_size: int | None = 32000
    hidden_size: int = 1024
    num_layers: int = 24
    num_attention_heads: int = 16
    num_query_groups: int | None = None  # GQA groups; None -> multi-head attention
    ffn_hidden_size: int | None = None  # None -> LLaMA rule: 8/3 * hidden, rounded up to 256
    seq_length: int = 2048
    norm_epsilon: float = 1e-5
    rotary_base: float = 10000.0
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    attention_backend: str = "auto"  # auto | sdpa (CPU-safe) | megatron (default mcore, GPU)
    # fused (chunked linear + cross entropy, model/loss.py) | liger (its training mean through Liger-Kernel's Triton
    # kernel, model/loss_liger.py: CUDA, TP = 1) | megatron (unfused logits) | auto (liger on CUDA at TP = 1 when
    # liger-kernel imports, else fused; resolved at model build)
    loss_impl: str = "auto"
    loss_chunk_tokens: int | None = None  # tokens per chunk of the fused loss; None -> sizes.loss_chunk_tokens
    lev: LEVConfig = field(default_factory=LEVConfig)
    albert_dim: int | None = None  # e; None -> matched to LEV's input parameter count
    mlp_hidden: int | None = None  # hidden width of flat_mlp / factored_mlp; None -> matched
    flat_mlp_dim: int | None = None  # flat_mlp's per-token table width e; None -> matched
    # torch.compile each transformer layer (BlockPiece.layer; not the input layer, norm or head): docs/model.md
    compile: bool = False
    # SwiGLU through megatron-core's fused (torch.compile'd) kernel; None -> on for CUDA, off on the CPU
    activation_fusion: bool | None = None
    # activation recompute (docs/training.md, "Memory levers"): none | selective (model.recompute_modules of every
    # layer: core_attn, mlp) | full (a layer keeps only its input; model.recompute_layers: the first N layers of
    # each pipeline stage, null: all of them)
    recompute: str = "none"
    recompute_modules: list[str] = field(default_factory=lambda: ["core_attn"])
    recompute_layers: int | None = None

    def resolved_ffn_hidden_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return int(math.ceil(8 * self.hidden_size / 3 / 256) * 256)

    def validate(self, prefix: str) -> None:
        require(
            self.variant in variants.REGISTRY,
            f"{prefix}.variant",
            f"unknown variant {self.variant!r}; choose one of {', '.join(variants.names())}",
        )
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "seq_length"):
            v = getattr(self, name)
            require(v is None or v >= 1, f"{prefix}.{name}", f"must be >= 1, got {v}")
        require(
            self.hidden_size % self.num_attention_heads == 0,
            f"{prefix}.hidden_size",
            f"{self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}",
        )
        if self.num_query_groups is not None:
            require(
                self.num_attention_heads % self.num_query_groups == 0,
                f"{prefix}.num_query_groups",
                f"num_attention_heads={self.num_attention_heads} is not divisible by {self.num_query_groups}",
            )
        require(
            self.attention_backend in ("auto", "sdpa", "megatron"),
            f"{prefix}.attention_backend",
            f"must be auto, sdpa or megatron, got {self.attention_backend!r}",
        )
        require(
            self.loss_impl in ("auto", "fused", "liger", "megatron"),
            f"{prefix}.loss_impl",
            f"must be auto, fused, liger or megatron, got {self.loss_impl!r}",
        )
        self._validate_recompute(prefix)
        require(
            self.loss_chunk_tokens is None or self.loss_chunk_tokens >= 1,
            f"{prefix}.loss_chunk_tokens",
            f"must be >= 1 or null (auto), got {self.loss_chunk_tokens}",
        )
        if variants.get(self.variant).digits and self.vocab_size is not None:  # else after resolve_vocab
            b = self.lev.resolved_base(self.vocab_size)
            require(
                b**self.lev.digits >= self.vocab_size,
                f"{prefix}.lev.base",
                f"b**k = {b}**{self.lev.digits} = {b**self.lev.digits} < vocab_size {self.vocab_size}; "
                "raise lev.base or lev.digits",
            )

    def _validate_recompute(self, prefix: str) -> None:
        require(
            self.recompute in RECOMPUTE,
            f"{prefix}.recompute",
            f"must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}",
        )
        bad = [m for m in self.recompute_modules if m not in RECOMPUTE_MODULES]
        require(
            not bad and (self.recompute != "selective" or self.recompute_modules),
            f"{prefix}.recompute_modules",
            f"a non-empty list of {', '.join(RECOMPUTE_MODULES)}, got {self.recompute_modules!r}",
        )
        if self.recompute_layers is not None:
            require(
                self.recompute == "full",
                f"{prefix}.recompute_layers",
                f"goes with {prefix}.recompute=full (the first N layers of each stage), not {self.recompute!r}",
            )
            require(
                1 <= self.recompute_layers <= self.num_layers,
                f"{prefix}.recompute_layers",
                f"must be 1..num_layers={self.num_layers}, or null for every layer; got {self.recompute_layers}",
            )
        require(
            self.recompute == "none" or not self.compile,
            f"{prefix}.recompute",
            f"{self.recompute!r} with {prefix}.compile=true is not tested against the eager gradients yet: "
            "use one of the two",
        )

    def validate_with(self, parallel: "ParallelConfig", data: "DataConfig", prefix: str = "model") -> None:
        """Checks that need other sections: TP divisibility of the sharded input layers and the tokenizer."""
        self.resolve_vocab(data, prefix)
        tp = parallel.tensor_parallel
        require(
            self.loss_impl != "liger" or tp == 1,
            f"{prefix}.loss_impl",
            f"liger needs parallel.tensor_parallel=1, got {tp}: its kernel normalises over the whole vocabulary row "
            "and a tensor-parallel rank holds a slice of it; use fused (or auto)",
        )
        for key, width in variants.get(self.variant).tp_widths(self).items():  # the widths it shards over TP
            require(
                width % tp == 0,
                "parallel.tensor_parallel",
                f"tensor_parallel={tp} does not divide the {self.variant} width {prefix}.{key}={width}",
            )

    def resolve_vocab(self, data: "DataConfig", prefix: str = "model") -> None:
        """``vocab_size`` from ``data.tokenizer`` when unset, else checked against it (an error naming both when
        the tokenizer has more ids; a warning when fewer)."""
        from leviathan_pretrain.data.tokenizer import open_data_tokenizer

        tok = open_data_tokenizer(data)
        if self.vocab_size is None:
            require(
                tok is not None,
                f"{prefix}.vocab_size",
                "not set, and there is no data.tokenizer to take it from; set one of them",
            )
            self.vocab_size = tok.vocab_size
            self.validate(prefix)
            return
        if tok is None:
            return
        n = tok.vocab_size
        require(
            n <= self.vocab_size,
            f"{prefix}.vocab_size",
            f"{self.vocab_size} is smaller than the vocabulary of data.tokenizer={data.tokenizer} ({tok.kind}, {n:,} "
            f"ids); set {prefix}.vocab_size={n}, or leave it unset to take the tokenizer's",
        )
        if n < self.vocab_size:
            import warnings

            warnings.warn(
                f"{prefix}.vocab_size={self.vocab_size} is larger than data.tokenizer's {n} ids; "
                "the extra ids are never seen (set them equal unless that is intended)",
                stacklevel=2,
            )


def split_weights(split: str) -> list[float]:
    """``"969,30,1"`` (or ``969/30/1``) -> ``[969.0, 30.0, 1.0]``; raises ValueError when malformed."""
    nums = [float(p) for p in split.replace("/", ",").split(",")]
    if len(nums) != 3 or any(n < 0 for n in nums) or sum(nums) <= 0:
        raise ValueError(split)
    return nums


@dataclass
class DataConfig:
    """Training data: megatron-core ``.bin/.idx`` shard prefixes, blended by weight, split by document."""

    prefixes: list[str] = field(default_factory=list)  # megatron-core .bin/.idx prefixes
    weights: list[float] | None = None  # blend weights, one per prefix (None: by size)
    split: str = "969,30,1"  # train,valid,test document split of every prefix
    valid_prefixes: list[str] | None = None  # a separate held-out set (then split's valid part is unused)
    # a SentencePiece .model, a Hugging Face tokenizer.json (or its directory), a .tiktoken file or tiktoken:NAME;
    # its fingerprint must equal the shards' manifest's and is recorded in checkpoints; model.vocab_size from it
    tokenizer: str | None = None
    tiktoken_pattern: str | None = None  # a .tiktoken file's split pattern: o200k | cl100k | p50k | r50k
    cache_dir: str | None = None  # megatron-core index cache; None -> <train.out_dir>/data_cache
    seed: int = 1234  # shuffling seed of the sample order
    eod_id: int | None = None  # end-of-document id; None -> from the manifest, else 0
    eod_mask_loss: bool = False  # no loss on predicting the token after an EOD
    require_prebuilt_cache: bool = False  # fail at start (exit 2) unless build_data_cache built the
    # index cache (else rank 0 builds it while others wait)
    # where a unique-id input layer's (LEV, ALBERT, the MLPs) unique ids are made: host (the data path, no host
    # synchronisation in the forward) | device (torch.unique in the forward) | auto (host at PP = 1 without the
    # pipeline engine, else device); the tables have none (data/transfer.py)
    unique_ids: str = "auto"
    unique_bucket: int = 256  # host unique ids are padded to a multiple of this (1: no padding)
    # one contiguous host buffer per micro-batch (pinned on CUDA), one non-blocking copy to the device; false: each
    # tensor copied on its own (pageable, blocking: the old path)
    packed_transfer: bool = True
    # the next global batch read, checked and prepared on one background thread while the current step runs (the
    # same batches, by sample position; data/prefetch.py); false: read at the start of each step. null:
    # on for CUDA runs (the host builds it while the GPU works), off on the CPU (it would take a core from compute)
    prefetch: bool | None = None

    def resolved_prefetch(self, device_type: str) -> bool:
        """``prefetch`` with null resolved for the run's device (``cuda`` / ``cpu``)."""
        return device_type == "cuda" if self.prefetch is None else self.prefetch

    def validate(self, prefix: str) -> None:
        if self.weights is not None:
            require(
                len(self.weights) == len(self.prefixes),
                f"{prefix}.weights",
                f"{len(self.weights)} weights for {len(self.prefixes)} prefixes",
            )
            require(
                all(w >= 0 for w in self.weights) and sum(self.weights) > 0,
                f"{prefix}.weights",
                "must be non-negative with a positive sum",
            )
        require(
            self.unique_ids in ("auto", "host", "device"),
            f"{prefix}.unique_ids",
            f"must be auto, host or device, got {self.unique_ids!r}",
        )
        require(
            self.unique_bucket >= 1,
            f"{prefix}.unique_bucket",
            f"must be >= 1 (1: no padding), got {self.unique_bucket}",
        )
        try:
            split_weights(self.split)
        except ValueError:
            raise ConfigError(
                f"{prefix}.split: expected three non-negative numbers like 969,30,1, got {self.split!r}"
            ) from None


@dataclass
class OptimConfig:
    """AdamW, linear warmup then cosine (or linear/constant) decay to ``min_lr``, gradient clipping."""

    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 100
    decay_steps: int | None = None  # steps of warmup + decay; None -> train.steps
    decay_style: str = "cosine"  # cosine | linear | constant
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # never on norms and biases
    decay_lev_codebooks: bool = False  # weight decay on LEV's digit codebooks C
    lev_lr_mult: float = 1.0  # LEV's own parameters (codebooks, projections, splines, heads) train at lr x this
    clip_grad: float = 1.0  # global gradient-norm clip; 0 disables
    loss_scale: float = 0.0  # fp16 only: 0 = dynamic loss scaling, else a static scale
    initial_loss_scale_power: int = 16  # fp16 dynamic scaling starts at 2**this
    # torch AdamW kernel: null = fused on CUDA, single-tensor (foreach=false) on CPU as before; true/false force
    # it (torch's fused AdamW also runs on CPU)
    fused: bool | None = None

    def validate(self, prefix: str) -> None:
        require(self.lr > 0, f"{prefix}.lr", "must be > 0")
        require(0 <= self.min_lr <= self.lr, f"{prefix}.min_lr", "must be in [0, lr]")
        require(self.warmup_steps >= 0, f"{prefix}.warmup_steps", "must be >= 0")
        require(self.decay_steps is None or self.decay_steps >= 1, f"{prefix}.decay_steps", "must be >= 1")
        require(
            self.decay_style in ("cosine", "linear", "constant"),
            f"{prefix}.decay_style",
            f"must be cosine, linear or constant, got {self.decay_style!r}",
        )
        require(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, f"{prefix}.beta1", "beta1 and beta2 must be in [0, 1)")
        require(self.eps > 0, f"{prefix}.eps", "must be > 0")
        require(self.weight_decay >= 0, f"{prefix}.weight_decay", "must be >= 0")
        require(self.lev_lr_mult > 0, f"{prefix}.lev_lr_mult", "must be > 0")
        require(self.clip_grad >= 0, f"{prefix}.clip_grad", "must be >= 0 (0 disables clipping)")
        require(self.loss_scale >= 0, f"{prefix}.loss_scale", "must be >= 0 (0 = dynamic)")


@dataclass
class LoggingConfig:
    log_interval: int = 10  # console line + full TensorBoard scalars every N steps
    tensorboard: bool = True
    tensorboard_dir: str | None = None  # None -> <train.out_dir>/tensorboard
    # Peak FLOP/s per device for MFU; None: from the GPU's name and parallel.precision (a known datasheet
    # figure, see trainer/metrics.py), and no MFU where it is unknown (every CPU: its peak is not knowable
    # reliably from software, so an MFU there could mean anything).
    peak_flops: float | None = None
    # The token vectors' geometry (model/geometry.py: input rows and head rows over 2,048 seeded ids) at step 0 and
    # every N steps (and the last): TensorBoard geometry/{input,head}/..., train_log.jsonl. 0: never.
    geometry_interval: int = 100
    geometry_buckets: bool = False  # also per training-frequency bucket (needs the shards' counts.npy; costlier)

    def validate(self, prefix: str) -> None:
        require(self.log_interval >= 1, f"{prefix}.log_interval", "must be >= 1")
        require(self.geometry_interval >= 0, f"{prefix}.geometry_interval", "must be >= 0 (0: never)")
        require(self.peak_flops is None or self.peak_flops > 0, f"{prefix}.peak_flops", "must be > 0 or null")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self, prefix: str = "") -> None:
        m, p = self.model, self.parallel
        tp = p.tensor_parallel
        require(
            m.num_attention_heads % tp == 0,
            "parallel.tensor_parallel",
            f"tensor_parallel={tp} does not divide model.num_attention_heads={m.num_attention_heads}",
        )
        groups = m.num_query_groups or m.num_attention_heads
        require(
            groups % tp == 0,
            "parallel.tensor_parallel",
            f"tensor_parallel={tp} does not divide model.num_query_groups={groups}",
        )
        require(
            not p.sequence_parallel or m.seq_length % tp == 0,
            "parallel.sequence_parallel",
            f"splits the sequence over tensor_parallel={tp} ranks, which does not divide model.seq_length="
            f"{m.seq_length}; set model.seq_length to a multiple of {tp}",
        )
        require(
            not (p.sequence_parallel and m.compile),
            "parallel.sequence_parallel",
            "with model.compile=true is not tested against the eager gradients yet (the sequence-parallel "
            "collectives inside a compiled layer); set model.compile=false",
        )
        m.validate_with(p, self.data)
        require(
            self.optim.lev_lr_mult == 1.0 or m.variant == "lev",
            "optim.lev_lr_mult",
            f"{self.optim.lev_lr_mult} scales the LR of LEV's parameters, but model.variant={m.variant} has none; "
            "leave it at 1.0",
        )
        require(
            self.data.unique_ids != "host" or not p.uses_pipeline_engine,
            "data.unique_ids",
            "host needs the PP = 1 engine: DeepSpeed's pipeline engine (parallel.pipeline_parallel > 1 or "
            "parallel.pipeline_engine) feeds its first stage (tokens, position_ids) alone; use auto or device",
        )
        require(
            m.num_layers % p.pipeline_parallel == 0 or m.num_layers >= p.pipeline_parallel,
            "parallel.pipeline_parallel",
            f"pipeline_parallel={p.pipeline_parallel} exceeds model.num_layers={m.num_layers}",
        )


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Load and validate a :class:`Config` from YAML plus dotted ``key=value`` overrides."""
    return load(Config, path, overrides)


def load_config_or_report(path: str | Path | None, overrides: list[str] | tuple = ()) -> Config | None:
    """For command-line entry points: :func:`load_config`, or print its one-line ``error: ...`` to stderr and
    return None (the caller exits 2)."""
    import sys

    try:
        return load_config(path, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def config_arguments(
    parser,
    config_help: str = "YAML config (may name a 'base:' file it extends)",
    overrides_help: str = "dotted overrides, e.g. parallel.tensor_parallel=2 train.steps=100",
) -> None:
    """Add ``--config FILE`` and the positional ``key=value`` overrides, the arguments of :func:`load_config`,
    to an ``argparse`` parser: every entry point that loads a config (train, build_data_cache, params)
    takes them alike."""
    parser.add_argument("--config", help=config_help)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help=overrides_help)
