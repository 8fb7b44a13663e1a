"""The LLaMA-style GPT's pieces on megatron-core layers, for every input variant.

Builders take ``ModelConfig`` and :class:`~.settings.BuildSettings` (tensor-parallel size and group,
precision, device), never the whole ``Config`` nor megatron-core's global parallel state:

- :func:`build_transformer_config` -> megatron-core ``TransformerConfig`` (RMSNorm, SwiGLU, no biases, GQA);
- :func:`build_layer_spec` -> the ``ModuleSpec`` of one ``TransformerLayer`` (megatron-core's local spec; on
  the ``sdpa`` backend its ``self_attention.submodules.core_attention`` is :class:`~.attention.SDPACoreAttention`);
- :func:`build_input_layer` -> the variant's input representation (LEV or a baseline);
- :func:`build_rotary` -> the CPU-safe RoPE.

The pieces below are what :mod:`.assembly` puts in order (the PP = 1 model and the DeepSpeed pipeline
alike). Each takes one tensor (the first: a ``(tokens, position_ids)`` tuple) and returns one tensor, so
every piece can be a pipeline layer:

- :class:`InputPiece` (``embedding``: the input layer): ``(tokens [b, s], position_ids [b, s]) -> [s, b, D]``;
- :class:`BlockPiece` (``layer``: a ``TransformerLayer`` from the spec, with its RoPE): ``[s, b, D] -> [s, b, D]``;
- :class:`FinalNorm` (``final_layernorm``: RMSNorm): ``[s, b, D] -> [s, b, D]``;
- :class:`OutputPiece` (``output_layer``: vocab-parallel ``ColumnParallelLinear``): ``[s, b, D] -> [s, b, V_pad/tp]``
  logits, or with ``model.loss_impl: fused`` the head's operands (:class:`~.head.HeadInput`); given a
  :class:`~.head.LossRequest` it returns the loss (model/head.py).

TIED has no :class:`OutputPiece`: :func:`tied_head` uses the :class:`InputPiece`'s own table as the head.

Seeding is the caller's. On the CPU (and with ``init_on_cpu``) megatron-core's weights are initialised from
full master tensors (``use_cpu_initialization``), so a TP = N model starts from the TP = 1 weights; on a GPU
megatron-core initialises each shard on the device. The input layers' own tensor-parallel parameters (LEV:
~2M) always come from CPU master tensors (model/tp.py).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig

from leviathan_pretrain.model import sizes, variants
from leviathan_pretrain.model.attention import CPUSafeRotaryEmbedding, SDPACoreAttention
from leviathan_pretrain.model.head import HeadOptions, head_forward
from leviathan_pretrain.model.recompute import active, checkpointed, recomputed
from leviathan_pretrain.model.settings import BuildSettings, ModelConfigError, resolved_attention
from leviathan_pretrain.model.sp import SPColumnParallelLinear, SPRMSNorm, SPRowParallelLinear


def attention_backend(model, build: BuildSettings) -> str:
    """``sdpa`` or ``megatron`` (:func:`~leviathan_pretrain.model.settings.resolved_attention`); ``megatron``
    off CUDA is refused."""
    backend = resolved_attention(model.attention_backend)
    if backend == "megatron" and build.torch_device.type != "cuda":
        raise ModelConfigError(
            "model.attention_backend: 'megatron' (DotProductAttention) needs CUDA; use 'sdpa' or 'auto' on CPU"
        )
    return backend


def activation_fusion(model, build: BuildSettings) -> bool:
    """``model.activation_fusion`` resolved: ``None`` (auto) is on for CUDA, off on the CPU. On, SwiGLU runs
    through megatron-core's ``bias_swiglu_impl`` (no bias here: its ``SwiGLUFunction``, a ``torch.compile``'d
    forward and hand-written backward that saves only the fc1 output)."""
    fused = model.activation_fusion
    if fused is None:
        fused = build.torch_device.type == "cuda"
    if fused:
        needs_compiler("model.activation_fusion", build)
    return bool(fused)


def needs_compiler(key: str, build: BuildSettings) -> None:
    """``torch.compile`` (inductor) on the CPU builds C++ kernels: refuse at build, not at the first step,
    when no C++ compiler is found (on a GPU inductor writes Triton kernels)."""
    if build.torch_device.type == "cuda":
        return
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()  # inductor's own search (CXX, else g++), run once per process
    except Exception as e:  # noqa: BLE001 - InvalidCxxCompiler and whatever the search raises
        raise ModelConfigError(
            f"{key}: torch.compile on the CPU needs a C++ compiler (inductor found none: {type(e).__name__}; "
            "install g++ or set CXX)"
        ) from None


def padded_vocab_size(model, build: BuildSettings) -> int:
    return sizes.padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, build.tensor_parallel)


def build_transformer_config(model, build: BuildSettings) -> TransformerConfig:
    """megatron-core ``TransformerConfig``: LLaMA-style (RMSNorm, SwiGLU, no biases, GQA via
    ``num_query_groups``), no dropout, bf16/fp16 params per ``build.precision``, fused kernels off (portable).
    On a GPU megatron-core initialises each TP shard on the device (no full V x D master tensors on the CPU
    of every rank); on the CPU, or with ``init_on_cpu``, from full CPU master weights."""
    m = model
    cpu_init = build.init_on_cpu or build.torch_device.type != "cuda"
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.resolved_ffn_hidden_size(),
        kv_channels=m.hidden_size // m.num_attention_heads,
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=m.init_method_std,
        use_cpu_initialization=cpu_init,
        perform_initialization=True,
        params_dtype=build.params_dtype,
        bf16=build.precision == "bf16",
        fp16=build.precision == "fp16",
        # Pipelining is DeepSpeed's (trainer/pipeline_parallel.py), never megatron-core's schedules: each stage's layers
        # are described as one stage-free model (megatron's pipeline settings would demand pipeline_dtype).
        tensor_model_parallel_size=build.tensor_parallel,
        pipeline_model_parallel_size=1,
        sequence_parallel=build.sequence_parallel,
        cuda_graph_scope=[],
        bias_activation_fusion=activation_fusion(m, build),
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
    )


class GroupRowParallelLinear(tensor_parallel.RowParallelLinear):
    """megatron-core's ``RowParallelLinear`` handing its own ``tp_group`` to the linear function instead of
    ``None``. Same computation (the row-parallel linear has no input-gradient all-reduce, the group is unused
    there), but without megatron's "tp_group is None" ``DeprecationWarning`` on rank 0 at every call, which
    ``torch.compile`` cannot trace: it split each compiled layer into ~10 graphs. Used with ``model.compile``."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if kwargs.get("tp_group", self.tp_group) is None:
            kwargs["tp_group"] = self.tp_group
        return super()._forward_impl(input, weight, *args, **kwargs)


def _replace(spec, path: str, module):
    """``spec`` with ``submodules.<a>.submodules.<b>...`` (``path`` = ``a.b``) set to ``module``."""
    head, _, rest = path.partition(".")
    sub = module if not rest else _replace(getattr(spec.submodules, head), rest, module)
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, **{head: sub}))


def sequence_parallel(build: BuildSettings) -> bool:
    """Whether ``parallel.sequence_parallel`` is in effect: on, with a tensor-parallel group of 2 or more."""
    return bool(build.sequence_parallel) and build.tensor_parallel > 1


def norm_spec(build: BuildSettings):
    """The RMSNorm of the layers and the final norm: megatron-core's ``WrappedTorchNorm`` (``torch.nn.RMSNorm``),
    or under sequence parallelism :class:`~.sp.SPRMSNorm` (the same module and key; its weight's gradient summed
    over TP)."""
    if sequence_parallel(build):
        return ModuleSpec(module=SPRMSNorm, params={"tp_group": build.tp_group})
    return WrappedTorchNorm


def build_layer_spec(model, build: BuildSettings) -> ModuleSpec:
    """``ModuleSpec`` of one ``TransformerLayer`` (megatron-core's local spec, RMSNorm); on the ``sdpa``
    backend its ``self_attention.submodules.core_attention`` is :class:`SDPACoreAttention`; with
    ``model.compile`` its two row-parallel linears are :class:`GroupRowParallelLinear`; under sequence
    parallelism its linears and norms are model/sp.py's (the same parameters and keys)."""
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if attention_backend(model, build) == "sdpa":
        spec = _replace(spec, "self_attention.core_attention", SDPACoreAttention)
    if model.compile:
        spec = _replace(spec, "self_attention.linear_proj", GroupRowParallelLinear)
        spec = _replace(spec, "mlp.linear_fc2", GroupRowParallelLinear)
    if sequence_parallel(build):
        for path in ("self_attention.linear_qkv", "mlp.linear_fc1"):
            spec = _replace(spec, path, SPColumnParallelLinear)
        for path in ("self_attention.linear_proj", "mlp.linear_fc2"):
            spec = _replace(spec, path, SPRowParallelLinear)
        for path in ("input_layernorm", "pre_mlp_layernorm"):
            spec = _replace(spec, path, norm_spec(build))
    return spec


def build_rotary(model, tconfig: TransformerConfig) -> CPUSafeRotaryEmbedding:
    """RoPE over ``kv_channels``; ``rotary(seq_len)`` -> ``[s, 1, 1, kv_channels]`` for ``rotary_pos_emb``."""
    return CPUSafeRotaryEmbedding(
        kv_channels=tconfig.kv_channels, rotary_percent=1.0, rotary_base=model.rotary_base, use_cpu_initialization=True
    )


def build_input_layer(model, build: BuildSettings, tconfig: TransformerConfig) -> torch.nn.Module:
    """The input representation chosen by ``model.variant`` (its class: model/variants.py):
    ``forward(input_ids [b, s], position_ids=None) -> hidden [s, b, D]``."""
    try:
        variant = variants.get(model.variant)
    except ValueError as e:
        raise ModelConfigError(str(e)) from None
    cls = variants.layer_class(variant)
    return cls.from_model(tconfig, model, padded_vocab_size(model, build), build.tp_group)


# ---- the pieces -------------------------------------------------------------------------------------------
class InputPiece(torch.nn.Module):
    """``(tokens [b, s], position_ids [b, s]) -> hidden [s, b, D]`` through ``embedding`` (the input layer).
    A third element, the micro-batch's :class:`~.inputs.UniqueIds` (the PP = 1 model's ``unique``), is handed to
    the input layer (the unique-id layers use it, the tables ignore it).
    For TIED it also serves as the output head (:func:`tied_head`), its table being :attr:`table`."""

    def __init__(self, model, build: BuildSettings, tconfig: TransformerConfig):
        super().__init__()
        self.embedding = build_input_layer(model, build, tconfig)
        self.tp_group = build.tp_group
        if variants.get(model.variant).tied_head:  # the table is also the output head (tied_head)
            self.head_options = HeadOptions.of(model, build, padded_vocab_size(model, build) // build.tensor_parallel)

    def forward(self, inputs):
        tokens, position_ids, *unique = inputs
        kw = {"unique": unique[0]} if unique and unique[0] is not None else {}
        # contiguous: stage outputs are sent to the next pipeline stage as they are (torch p2p needs it)
        return self.embedding(input_ids=tokens, position_ids=position_ids, **kw).contiguous()

    @property
    def table(self) -> torch.nn.Parameter:
        """TIED / UNTIED: the ``[V_pad / tp, D]`` vocab-parallel input table."""
        return self.embedding.word_embeddings.weight


def tied_head(piece: InputPiece, hidden):
    """TIED's output head: ``hidden [s, b, D] @ table^T -> logits [s, b, V_pad / tp]`` (what megatron-core's
    ``ColumnParallelLinear`` does with an external weight: identity forward / all-reduce backward over TP), or
    the fused head's operands / a loss (:func:`~.head.head_forward`)."""
    return head_forward(hidden, piece.table, piece.tp_group, piece.head_options)


def compile_layer(layer: torch.nn.Module, build: BuildSettings) -> None:
    """``model.compile``: ``layer.compile()`` (torchtitan's per-block ``torch.compile``), in place: the
    module, its parameters, state-dict keys and the hooks DeepSpeed puts on it and its children stay as they
    are; only its ``__call__`` runs through dynamo. Compiled on the first forward (per input shape)."""
    needs_compiler("model.compile", build)
    layer.compile()


# model.recompute=selective: recompute_modules name -> the layer's submodule (megatron-core's names)
RECOMPUTED_SUBMODULES = {"core_attn": ("self_attention", "core_attention"), "mlp": ("mlp",)}


class BlockPiece(torch.nn.Module):
    """One ``TransformerLayer`` (``build_module(spec, config, layer_number, pg_collection)``) with its RoPE.
    ``model.recompute`` (model/recompute.py): ``selective`` checkpoints the submodules ``model.recompute_modules``
    names (their class becomes its checkpointed subclass: the same parameters and state-dict keys), ``full`` the
    whole layer when :attr:`recompute` is set (:func:`~.recompute.mark_blocks`)."""

    def __init__(self, model, build: BuildSettings, tconfig: TransformerConfig, layer_number: int):
        super().__init__()
        pgs = ProcessGroupCollection(tp=build.tp_group, pp=None, cp=None)
        self.layer = build_module(
            build_layer_spec(model, build), config=tconfig, layer_number=layer_number, pg_collection=pgs
        )
        self.rotary = build_rotary(model, tconfig)
        self.seq_shards = build.tensor_parallel if sequence_parallel(build) else 1  # RoPE spans the whole sequence
        self.recompute = False
        if model.recompute == "selective":
            for name in model.recompute_modules:
                sub = functools.reduce(getattr, RECOMPUTED_SUBMODULES[name], self.layer)
                sub.__class__ = recomputed(type(sub))
        if model.compile:  # the layer alone: RoPE's per-instance cache stays eager (see compile_layer)
            compile_layer(self.layer, build)

    def forward(self, hidden):
        # RoPE where the hidden states are, over the whole sequence (under SP ``hidden`` holds 1 / tp of it)
        rope = self.rotary(hidden.shape[0] * self.seq_shards, device=hidden.device)
        if self.recompute and active(self):
            return checkpointed(self._layer, hidden, rope)
        return self._layer(hidden, rope)

    def _layer(self, hidden, rope):
        out = self.layer(hidden, attention_mask=None, rotary_pos_emb=rope)
        return (out[0] if isinstance(out, tuple) else out).contiguous()


class FinalNorm(torch.nn.Module):
    """The final RMSNorm: megatron-core's ``WrappedTorchNorm`` (``torch.nn.RMSNorm``), the class the local spec's
    layer norms use, never ``transformer_block.LayerNormImpl``: that is TENorm with Transformer Engine, and the
    Apex ``FusedLayerNorm`` (which refuses RMSNorm) whenever ``apex`` is importable. Under sequence parallelism
    :class:`~.sp.SPRMSNorm` (:func:`norm_spec`)."""

    def __init__(self, model, build: BuildSettings, tconfig: TransformerConfig):
        super().__init__()
        self.final_layernorm = build_module(
            norm_spec(build), config=tconfig, hidden_size=tconfig.hidden_size, eps=tconfig.layernorm_epsilon
        )

    def forward(self, hidden):
        return self.final_layernorm(hidden)


class OutputPiece(MegatronModule):
    """The untied vocab-parallel head: ``ColumnParallelLinear`` (no bias, no gather) -> ``[s, b, V_pad / tp]``."""

    def __init__(self, model, build: BuildSettings, tconfig: TransformerConfig):
        super().__init__(config=tconfig)
        self.tp_group = build.tp_group
        self.head_options = HeadOptions.of(model, build, padded_vocab_size(model, build) // build.tensor_parallel)
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            tconfig.hidden_size,
            padded_vocab_size(model, build),
            config=tconfig,
            init_method=tconfig.init_method,
            bias=False,
            skip_bias_add=False,
            gather_output=False,
            tp_group=build.tp_group,
        )

    def forward(self, hidden):
        # under SP the head gathers the sequence and multiplies by its weight itself (head_forward)
        unfused = None if self.head_options.sequence_parallel else (lambda h: self.output_layer(h)[0])
        return head_forward(hidden, self.output_layer.weight, self.tp_group, self.head_options, unfused)
