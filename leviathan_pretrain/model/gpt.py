"""The LLaMA-style megatron-core GPT and its stage building blocks, for every input variant.

One definition serves both training paths:

- ``build_model(cfg)`` (pipeline_parallel == 1): megatron-core's ``GPTModel`` built from
  :func:`build_layer_spec` (RMSNorm, SwiGLU, no biases, optional GQA; SDPA core attention on CPU), with
  two attributes replaced after construction, megatron-core's own extension points:

  * ``model.embedding`` <- :func:`build_input_layer` (GPTModel calls ``self.embedding(input_ids=...,
    position_ids=...)`` and expects ``[s, b, D]``). For TIED the replacement is again a
    ``LanguageModelEmbedding`` (``model.embedding.word_embeddings.weight`` is the table the output layer
    is tied to; ``setup_embeddings_and_output_layer()`` is re-run after the swap).
  * ``model.rotary_pos_emb`` <- :func:`build_rotary` (CPU-safe RoPE).

  Everything else (``model.decoder``: TransformerBlock with the final norm, ``model.output_layer``: the
  vocab-parallel ``ColumnParallelLinear`` head, the vocab-parallel cross entropy) is GPTModel's own.
  GPTModel first allocates its own ``LanguageModelEmbedding``; it is dropped by the swap (a temporary
  ``V_pad/tp x D`` table at build time).

- A DeepSpeed ``PipelineModule`` (pipe.py, the trainer's) from the same pieces: :func:`build_input_layer`
  (first stage), ``build_module(build_layer_spec(cfg), config=tconfig, layer_number=i + 1)`` per layer with
  :func:`build_rotary` for the ``rotary_pos_emb`` argument, and :func:`build_output_head` (final norm +
  vocab-parallel head, last stage).

Seeding is the caller's (``parallel.seed_everything``). On the CPU (and with ``parallel.init_on_cpu``)
megatron-core's weights are initialised from full master tensors (``use_cpu_initialization``), so a TP = N
model starts from the TP = 1 weights; on a GPU megatron-core initialises each shard on the device. The input
layers' own tensor-parallel parameters (LEV: ~2M) always come from CPU master tensors (model/tp.py).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import LayerNormImpl
from megatron.core.transformer.transformer_config import TransformerConfig

from leviathan_pretrain.config import Config, ConfigError
from leviathan_pretrain.model import sizes
from leviathan_pretrain.model.attention import CPUSafeRotaryEmbedding, SDPACoreAttention
from leviathan_pretrain.model.inputs import (AlbertInput, FactoredMLPInput, FlatMLPInput, TableInput,
                                             check_token_ids)
from leviathan_pretrain.model.lev import LEVInput
from leviathan_pretrain.model.tp import tp_size


def resolve_device(cfg: Config, device=None) -> torch.device:
    if device is not None:
        return torch.device(device)
    want = cfg.parallel.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(want)


def attention_backend(cfg: Config, device=None) -> str:
    """``sdpa`` or ``megatron`` (``auto``: megatron-core's default attention on CUDA, SDPA on CPU)."""
    backend = cfg.model.attention_backend
    dev = resolve_device(cfg, device)
    if backend == "auto":
        return "megatron" if dev.type == "cuda" else "sdpa"
    if backend == "megatron" and dev.type != "cuda":
        raise ConfigError("model.attention_backend: 'megatron' (DotProductAttention) needs CUDA; "
                          "use 'sdpa' or 'auto' on CPU")
    return backend


def padded_vocab_size(cfg: Config) -> int:
    m = cfg.model
    return sizes.padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, cfg.parallel.tensor_parallel)


def build_transformer_config(cfg: Config, device=None) -> TransformerConfig:
    """megatron-core ``TransformerConfig`` for ``cfg.model`` / ``cfg.parallel``: LLaMA-style (RMSNorm,
    SwiGLU, no biases, GQA via ``num_query_groups``), no dropout, CPU initialisation from full master
    weights, bf16/fp16 params per ``parallel.precision``, fused kernels off (portable)."""
    m, p = cfg.model, cfg.parallel
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[p.precision]
    # On a GPU megatron-core initialises each TP shard on the device (no full V x D master tensors on the
    # CPU of every rank); on the CPU, or with parallel.init_on_cpu, from full CPU master weights.
    cpu_init = p.init_on_cpu or resolve_device(cfg, device).type != "cuda"
    return TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups, ffn_hidden_size=m.resolved_ffn_hidden_size(),
        kv_channels=m.hidden_size // m.num_attention_heads,
        normalization="RMSNorm", layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=m.init_method_std,
        use_cpu_initialization=cpu_init, perform_initialization=True,
        params_dtype=dtype, bf16=p.precision == "bf16", fp16=p.precision == "fp16",
        # Pipelining is DeepSpeed's (trainer/pipe.py), never megatron-core's schedules: each stage's layers
        # are described as one stage-free model (megatron's pipeline settings would demand pipeline_dtype).
        tensor_model_parallel_size=p.tensor_parallel, pipeline_model_parallel_size=1,
        sequence_parallel=p.sequence_parallel, cuda_graph_scope=[],
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
    )


def build_layer_spec(cfg: Config, device=None) -> ModuleSpec:
    """``ModuleSpec`` of one ``TransformerLayer`` (megatron-core's local spec, RMSNorm); on the ``sdpa``
    backend its ``self_attention.submodules.core_attention`` is :class:`SDPACoreAttention`."""
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if attention_backend(cfg, device) == "sdpa":
        attn = spec.submodules.self_attention
        attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules,
                                                                      core_attention=SDPACoreAttention))
        spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, self_attention=attn))
    return spec


def build_rotary(cfg: Config, tconfig: TransformerConfig) -> CPUSafeRotaryEmbedding:
    """RoPE over ``kv_channels``; ``rotary(seq_len)`` -> ``[s, 1, 1, kv_channels]`` for ``rotary_pos_emb``."""
    return CPUSafeRotaryEmbedding(kv_channels=tconfig.kv_channels, rotary_percent=1.0,
                                  rotary_base=cfg.model.rotary_base, use_cpu_initialization=True)


def build_input_layer(cfg: Config, tconfig: TransformerConfig) -> torch.nn.Module:
    """The input representation chosen by ``model.variant``: ``forward(input_ids [b, s], position_ids=None)
    -> hidden [s, b, D]`` (sharded along s under sequence parallelism)."""
    m = cfg.model
    if m.variant in ("tied", "untied"):
        return TableInput(tconfig, m.vocab_size, padded_vocab_size(cfg), m.seq_length)
    if m.variant == "lev":
        return LEVInput(tconfig, m)
    if m.variant == "albert":
        return AlbertInput(tconfig, m, padded_vocab_size(cfg))
    if m.variant == "flat_mlp":
        return FlatMLPInput(tconfig, m, padded_vocab_size(cfg))
    if m.variant == "factored_mlp":
        return FactoredMLPInput(tconfig, m)
    raise ConfigError(f"model.variant: unknown variant {m.variant!r}")


class OutputHead(MegatronModule):
    """Last pipeline stage: final RMSNorm + the vocab-parallel head (``ColumnParallelLinear``, no gather).

    ``forward(hidden [s, b, D], weight=None) -> logits [s, b, V_pad / tp]``; pass the input table's
    ``word_embeddings.weight`` as ``weight`` when tied (then the head allocates no weight of its own).
    ``loss(logits, labels [b, s]) -> [b, s]`` is megatron-core's vocab-parallel cross entropy."""

    def __init__(self, cfg: Config, tconfig: TransformerConfig, tied: bool | None = None):
        super().__init__(config=tconfig)
        tied = cfg.model.variant == "tied" if tied is None else tied
        self.final_layernorm = build_module(LayerNormImpl, config=tconfig, hidden_size=tconfig.hidden_size,
                                            eps=tconfig.layernorm_epsilon)
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            tconfig.hidden_size, padded_vocab_size(cfg), config=tconfig, init_method=tconfig.init_method,
            bias=False, skip_bias_add=False, gather_output=False, skip_weight_param_allocation=tied)

    @property
    def weight(self):
        return self.output_layer.weight

    def forward(self, hidden, weight=None):
        logits, _ = self.output_layer(self.final_layernorm(hidden), weight=weight)
        return logits

    @staticmethod
    def loss(logits, labels):
        return tensor_parallel.vocab_parallel_cross_entropy(logits, labels.t().contiguous()).t().contiguous()


def build_output_head(cfg: Config, tconfig: TransformerConfig, tied: bool | None = None) -> OutputHead:
    return OutputHead(cfg, tconfig, tied)


def build_model(cfg: Config, device=None) -> GPTModel:
    """megatron-core ``GPTModel`` (pre_process = post_process = True) with ``model.variant``'s input layer.

    ``model(input_ids [b, s], position_ids [b, s], attention_mask=None, labels=[b, s])`` returns the
    per-token loss ``[b, s]``; without labels the logits ``[b, s, V_pad / tp]`` (vocab-parallel shard).
    Parameters are created on the CPU (on the current GPU for megatron-core's layers in a CUDA run without
    ``parallel.init_on_cpu``); move the model with ``.to(device)`` (or let DeepSpeed do it).
    Needs megatron-core's parallel state (``parallel.init_distributed``), pipeline_parallel == 1."""
    if cfg.parallel.pipeline_parallel != 1:
        raise ConfigError("parallel.pipeline_parallel: build_model is the PP = 1 path; build a DeepSpeed "
                          "PipelineModule from build_input_layer / build_layer_spec / build_output_head")
    if tp_size() != cfg.parallel.tensor_parallel:
        raise ConfigError(f"parallel.tensor_parallel={cfg.parallel.tensor_parallel} but megatron-core's "
                          f"tensor-parallel group has {tp_size()} ranks (call init_distributed(cfg.parallel) first)")
    tconfig = build_transformer_config(cfg, device)
    m = cfg.model
    model = GPTModel(config=tconfig, transformer_layer_spec=build_layer_spec(cfg, device),
                     vocab_size=padded_vocab_size(cfg), max_sequence_length=m.seq_length,
                     pre_process=True, post_process=True, parallel_output=True,
                     share_embeddings_and_output_weights=m.variant == "tied",
                     position_embedding_type="rope", rotary_base=m.rotary_base)
    model.rotary_pos_emb = build_rotary(cfg, tconfig)
    model.embedding = build_input_layer(cfg, tconfig)
    if isinstance(model.embedding, TableInput):
        model.setup_embeddings_and_output_layer()
    return model


__all__ = ["build_transformer_config", "build_layer_spec", "build_rotary", "build_input_layer",
           "build_output_head", "build_model", "OutputHead", "padded_vocab_size", "attention_backend",
           "check_token_ids"]
