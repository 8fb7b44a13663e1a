"""The one config schema used by every entry point (train, params, evaluate, export, launchers).

``load_config(path, overrides)`` returns a validated :class:`Config`; invalid values fail at load
with a :class:`ConfigError` naming the dotted key. Field defaults follow the LEV spec
(``shared/notes/lev-spec.md``) and LLaMA-style GPT conventions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from leviathan_pretrain.configlib import ConfigError, load, require, to_dict  # noqa: F401

VARIANTS = ("lev", "tied", "untied", "albert", "flat_mlp", "factored_mlp")


@dataclass
class LEVConfig:
    """LEV input layer hyper-parameters (spec defaults)."""
    digits: int = 3                # k: number of base-b digits of the token id
    base: int | None = None        # b; None -> ceil(V ** (1/k))
    seed_dim: int = 128            # d_seed
    heads: int = 8                 # h
    knots: int = 16                # kappa (uniform knots on [0, 1])
    rank: int = 64                 # r
    sigmoid_scale: float = 0.5     # u = sigmoid(scale * LN(W z))
    layernorm_eps: float = 1e-5
    log_eps: float = 1e-9          # M = sign * exp(sum log(|phi| + log_eps))
    init_std: float = 0.02         # codebooks C and head projections W_l
    spline_init_std: float = 0.1   # S = 1 + N(0, spline_init_std^2)
    out_init_std: float | None = None  # W_out ~ N(0, std^2); None -> init_std / sqrt(heads)
    token_chunk: int | None = None  # unique ids per chunk of the [ids, heads, d_seed, r] work; None -> auto
    chunk_elements: int = 16_777_216  # auto chunk: at most this many elements per [ids, heads/tp, d_seed, r] block
    recompute: bool = True         # recompute chunk intermediates in backward instead of storing them

    def resolved_base(self, vocab_size: int) -> int:
        if self.base is not None:
            return self.base
        b = max(2, math.ceil(vocab_size ** (1.0 / self.digits)))
        while (b - 1) ** self.digits >= vocab_size and b > 2:   # float-rounding guard
            b -= 1
        while b ** self.digits < vocab_size:
            b += 1
        return b

    def validate(self, prefix: str) -> None:
        require(self.digits >= 1, f"{prefix}.digits", f"must be >= 1, got {self.digits}")
        require(self.base is None or self.base >= 2, f"{prefix}.base", f"must be >= 2, got {self.base}")
        for name in ("seed_dim", "heads", "rank", "chunk_elements"):
            v = getattr(self, name)
            require(v >= 1, f"{prefix}.{name}", f"must be >= 1, got {v}")
        require(self.token_chunk is None or self.token_chunk >= 1, f"{prefix}.token_chunk",
                f"must be >= 1 or null (auto), got {self.token_chunk}")
        require(self.knots >= 3, f"{prefix}.knots",
                f"kappa must be >= 3 for a quadratic B-spline basis, got {self.knots}")
        require(self.log_eps > 0, f"{prefix}.log_eps", "must be > 0")


@dataclass
class ModelConfig:
    """A LLaMA-style decoder-only GPT; ``variant`` picks the input representation."""
    variant: str = "lev"
    vocab_size: int = 32000
    hidden_size: int = 1024
    num_layers: int = 24
    num_attention_heads: int = 16
    num_query_groups: int | None = None    # GQA groups; None -> multi-head attention
    ffn_hidden_size: int | None = None     # None -> LLaMA rule: 8/3 * hidden, rounded up to 256
    seq_length: int = 2048
    norm_epsilon: float = 1e-5
    rotary_base: float = 10000.0
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    attention_backend: str = "auto"        # auto | sdpa (CPU-safe) | megatron (default mcore, GPU)
    lev: LEVConfig = field(default_factory=LEVConfig)
    albert_dim: int | None = None          # e; None -> matched to LEV's input parameter count
    mlp_hidden: int | None = None          # hidden width of flat_mlp / factored_mlp; None -> matched
    flat_mlp_dim: int | None = None        # flat_mlp's per-token table width e; None -> matched

    def resolved_ffn_hidden_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return int(math.ceil(8 * self.hidden_size / 3 / 256) * 256)

    def validate(self, prefix: str) -> None:
        require(self.variant in VARIANTS, f"{prefix}.variant",
                f"unknown variant {self.variant!r}; choose one of {', '.join(VARIANTS)}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "seq_length"):
            v = getattr(self, name)
            require(v >= 1, f"{prefix}.{name}", f"must be >= 1, got {v}")
        require(self.hidden_size % self.num_attention_heads == 0, f"{prefix}.hidden_size",
                f"{self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}")
        if self.num_query_groups is not None:
            require(self.num_attention_heads % self.num_query_groups == 0, f"{prefix}.num_query_groups",
                    f"num_attention_heads={self.num_attention_heads} is not divisible by {self.num_query_groups}")
        require(self.attention_backend in ("auto", "sdpa", "megatron"), f"{prefix}.attention_backend",
                f"must be auto, sdpa or megatron, got {self.attention_backend!r}")
        if self.variant in ("lev", "factored_mlp"):
            b = self.lev.resolved_base(self.vocab_size)
            require(b ** self.lev.digits >= self.vocab_size, f"{prefix}.lev.base",
                    f"b**k = {b}**{self.lev.digits} = {b ** self.lev.digits} < vocab_size {self.vocab_size}; "
                    "raise lev.base or lev.digits")

    def validate_with(self, parallel: "ParallelConfig", data: "DataConfig", prefix: str = "model") -> None:
        """Checks that need other sections: TP divisibility of the sharded input layers and the tokenizer."""
        tp = parallel.tensor_parallel
        if self.variant in ("flat_mlp", "factored_mlp"):
            from leviathan_pretrain.model import sizes
            hidden = sizes.flat_mlp_dims(self)[1] if self.variant == "flat_mlp" else sizes.factored_mlp_hidden(self)
            require(hidden % tp == 0, f"{prefix}.mlp_hidden",
                    f"the {self.variant} hidden width {hidden} is not divisible by parallel.tensor_parallel={tp}")
        if data.tokenizer:
            n = tokenizer_vocab_size(data.tokenizer)
            require(n <= self.vocab_size, f"{prefix}.vocab_size",
                    f"{self.vocab_size} is smaller than the vocabulary of data.tokenizer={data.tokenizer} ({n} "
                    f"pieces); set {prefix}.vocab_size={n}")
            if n < self.vocab_size:
                import warnings
                warnings.warn(f"{prefix}.vocab_size={self.vocab_size} is larger than data.tokenizer's {n} pieces; "
                              "the extra ids are never seen (set them equal unless that is intended)", stacklevel=2)


def tokenizer_vocab_size(path: str) -> int:
    """Pieces in a SentencePiece ``.model`` (sentencepiece is imported only here)."""
    if not Path(path).is_file():
        raise ConfigError(f"data.tokenizer: {path} does not exist")
    import sentencepiece as spm
    try:
        return spm.SentencePieceProcessor(model_file=str(path)).vocab_size()
    except Exception as e:  # noqa: BLE001 - sentencepiece raises bare RuntimeError/OSError
        raise ConfigError(f"data.tokenizer: {path} is not a SentencePiece model ({e})") from None



@dataclass
class ParallelConfig:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    sequence_parallel: bool = False        # GPU only
    zero_stage: int = 1
    backend: str = "auto"                  # auto (nccl on GPU, gloo on CPU) | nccl | gloo
    precision: str = "fp32"                # fp32 | bf16 | fp16
    device: str = "auto"                   # auto | cpu | cuda

    def validate(self, prefix: str) -> None:
        require(self.tensor_parallel >= 1, f"{prefix}.tensor_parallel", "must be >= 1")
        require(self.pipeline_parallel >= 1, f"{prefix}.pipeline_parallel", "must be >= 1")
        require(self.zero_stage in (0, 1, 2, 3), f"{prefix}.zero_stage", f"must be 0-3, got {self.zero_stage}")
        require(not (self.pipeline_parallel > 1 and self.zero_stage > 1), f"{prefix}.zero_stage",
                f"DeepSpeed's pipeline engine supports ZeRO stage <= 1; got zero_stage={self.zero_stage} "
                f"with pipeline_parallel={self.pipeline_parallel}")
        require(self.backend in ("auto", "nccl", "gloo"), f"{prefix}.backend", f"unknown {self.backend!r}")
        require(self.precision in ("fp32", "bf16", "fp16"), f"{prefix}.precision", f"unknown {self.precision!r}")
        require(self.device in ("auto", "cpu", "cuda"), f"{prefix}.device", f"unknown {self.device!r}")


@dataclass
class DataConfig:
    prefixes: list[str] = field(default_factory=list)  # megatron-core .bin/.idx prefixes
    weights: list[float] | None = None                  # blend weights, one per prefix
    split: str = "969,30,1"                              # train,valid,test document split
    valid_prefixes: list[str] | None = None              # a separate held-out set instead of split
    tokenizer: str | None = None                         # tokenizer.model (checksum, vocab check)
    cache_dir: str | None = None                         # megatron-core index cache
    seed: int = 1234

    def validate(self, prefix: str) -> None:
        if self.weights is not None:
            require(len(self.weights) == len(self.prefixes), f"{prefix}.weights",
                    f"{len(self.weights)} weights for {len(self.prefixes)} prefixes")
            require(all(w >= 0 for w in self.weights) and sum(self.weights) > 0, f"{prefix}.weights",
                    "must be non-negative with a positive sum")
        parts = self.split.replace("/", ",").split(",")
        try:
            nums = [float(p) for p in parts]
        except ValueError:
            raise ConfigError(f"{prefix}.split: expected numbers like 969,30,1, got {self.split!r}") from None
        require(len(nums) == 3 and all(n >= 0 for n in nums) and sum(nums) > 0, f"{prefix}.split",
                f"expected three non-negative numbers like 969,30,1, got {self.split!r}")


@dataclass
class OptimConfig:
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 100
    decay_steps: int | None = None         # None -> train.steps
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_lev_codebooks: bool = False      # weight decay on LEV codebooks C
    clip_grad: float = 1.0

    def validate(self, prefix: str) -> None:
        require(self.lr > 0, f"{prefix}.lr", "must be > 0")
        require(0 <= self.min_lr <= self.lr, f"{prefix}.min_lr", "must be in [0, lr]")
        require(self.warmup_steps >= 0, f"{prefix}.warmup_steps", "must be >= 0")


@dataclass
class TrainConfig:
    steps: int = 1000
    micro_batch_size: int = 4
    global_batch_size: int = 8
    seed: int = 1234
    eval_interval: int = 200
    eval_iters: int = 10
    max_bad_steps: int = 5                 # consecutive NaN/Inf steps before stopping
    out_dir: str = "runs/default"          # checkpoints/ and tensorboard/ below this

    def validate(self, prefix: str) -> None:
        for name in ("steps", "micro_batch_size", "global_batch_size", "eval_iters", "max_bad_steps"):
            v = getattr(self, name)
            require(v >= 1, f"{prefix}.{name}", f"must be >= 1, got {v}")


@dataclass
class CheckpointConfig:
    save_interval: int = 500
    keep_last: int = 3
    resume: bool = True

    def validate(self, prefix: str) -> None:
        require(self.save_interval >= 1, f"{prefix}.save_interval", "must be >= 1")
        require(self.keep_last >= 1, f"{prefix}.keep_last", "must be >= 1")


@dataclass
class LoggingConfig:
    log_interval: int = 10
    tensorboard: bool = True
    peak_flops: float = 989e12             # per device, for MFU (H100/H200 dense bf16)

    def validate(self, prefix: str) -> None:
        require(self.log_interval >= 1, f"{prefix}.log_interval", "must be >= 1")


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
        require(m.num_attention_heads % tp == 0, "parallel.tensor_parallel",
                f"tensor_parallel={tp} does not divide model.num_attention_heads={m.num_attention_heads}")
        groups = m.num_query_groups or m.num_attention_heads
        require(groups % tp == 0, "parallel.tensor_parallel",
                f"tensor_parallel={tp} does not divide model.num_query_groups={groups}")
        if m.variant == "lev":
            require(m.lev.heads % tp == 0, "parallel.tensor_parallel",
                    f"tensor_parallel={tp} does not divide model.lev.heads={m.lev.heads}")
        m.validate_with(p, self.data)
        require(m.num_layers % p.pipeline_parallel == 0 or m.num_layers >= p.pipeline_parallel,
                "parallel.pipeline_parallel",
                f"pipeline_parallel={p.pipeline_parallel} exceeds model.num_layers={m.num_layers}")


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> Config:
    """Load and validate a :class:`Config` from YAML plus dotted ``key=value`` overrides."""
    return load(Config, path, overrides)
