"""The one assembly of the model: an ordered list of pieces, run in order at PP = 1 or cut into pipeline stages.

:func:`model_pieces` is the single definition of what the model is (torchtitan's "one model definition serves
unpipelined and pipelined runs", in the shape DeepSpeed's ``PipelineModule`` takes)::

    index    piece                                         state-dict keys (relative to the piece)
    0        InputPiece: the variant's input layer         embedding.*  (LEV: embedding.codebooks.weight, ...)
    1 .. L   BlockPiece(layer_number=i): TransformerLayer  layer.*      (layer.self_attention.linear_qkv.weight, ...)
    L + 1    FinalNorm: RMSNorm                            final_layernorm.weight
    L + 2    OutputPiece: vocab-parallel head              output_layer.weight
             TIED: tied_head on piece 0 (no weight of its own)

    loss:      the head given a LossRequest(hidden, labels [b, s], mask [b, s] | None) -> mean | [b, s]
               (model/head.py: fused chunked linear + cross entropy, or megatron-core's on the logits)

The same list is used two ways:

- :class:`GPT` (PP = 1): the pieces as children named like DeepSpeed names pipeline layers, so its state dict
  is exactly ``PipelineModule.state_dict()`` of the same pieces on one stage: ``"<index>.<piece key>"``, and
  for TIED the shared input piece under ``"tied_modules.embed.<piece key>"``. A pipeline checkpoint's file
  ``layer_<index>-model_states.pt`` holds ``<piece key>`` of piece ``<index>``.
- trainer/pipeline_parallel.py: ``LayerSpec`` per piece (``TiedLayerSpec("embed", ...)`` for TIED's input and head).

Both seed each piece from ``seed + index`` when built (:func:`seed_piece`, what ``PipelineModule``'s
``seed_layers`` does), so the initial weights depend neither on the stage split nor on PP = 1 vs pipeline.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import partial
from typing import Callable

import numpy as np
import torch

from leviathan_pretrain.model import variants
from leviathan_pretrain.model.gpt import (
    BlockPiece,
    FinalNorm,
    InputPiece,
    OutputPiece,
    build_transformer_config,
    tied_head,
)
from leviathan_pretrain.model.head import HeadInput, LossRequest, head_entry, logits_of
from leviathan_pretrain.model.recompute import mark_blocks
from leviathan_pretrain.model.settings import BuildSettings

# The state-dict layout described above. 1: megatron-core GPTModel at PP = 1 (embedding.*, decoder.layers.N.*,
# output_layer.*) and stage classes in the pipeline; 2: the pieces. Bump when names change, so a checkpoint
# can say which layout it holds.
LAYOUT_VERSION = 2
TIE_KEY = "embed"
TIED_WEIGHT = "embedding.word_embeddings.weight"  # TIED: the table shared by input and head, in InputPiece


@dataclass(frozen=True)
class Piece:
    """One piece: ``cls(*args)`` builds it. ``tie``: the key of a module shared between uses (TIED's table);
    the first use builds it, later uses reuse it through ``forward_fn(module, x)`` (``None``: its forward).
    ``tied_weight``: the shared parameter's attribute path in that module."""

    cls: type
    args: tuple
    tie: str | None = None
    forward_fn: Callable | None = None
    tied_weight: str | None = None

    def build(self) -> torch.nn.Module:
        return self.cls(*self.args)


def model_pieces(model, build: BuildSettings, tconfig=None) -> list[Piece]:
    """The ordered pieces of ``model`` (``ModelConfig``) built with ``build``; see the module doc."""
    tconfig = tconfig or build_transformer_config(model, build)
    common = (model, build, tconfig)
    tied = variants.get(model.variant).tied_head
    tie = dict(tie=TIE_KEY, tied_weight=TIED_WEIGHT) if tied else {}
    pieces = [Piece(InputPiece, common, **tie)]
    pieces += [Piece(BlockPiece, (*common, i + 1)) for i in range(model.num_layers)]
    pieces.append(Piece(FinalNorm, common))
    pieces.append(Piece(InputPiece, common, forward_fn=tied_head, **tie) if tied else Piece(OutputPiece, common))
    return pieces


def seed_piece(seed) -> None:
    """Seed python, numpy and torch for building one piece (DeepSpeed's ``set_random_seed``; the seed may be a
    numpy integer, which ``random.seed`` rejects on Python >= 3.11). On a GPU run (megatron-core's CUDA RNG
    tracker seeded by ``parallel.seed_everything``) the tracker too: megatron's layers initialised on the device
    draw their TP shards from its model-parallel state, which then depends on ``seed`` and the TP rank alone,
    not on the pipeline stage or on the pieces built before (CPU runs never seed the tracker)."""
    seed = int(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed % 2**63)
    from megatron.core import tensor_parallel

    if tensor_parallel.get_cuda_rng_tracker().get_states():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


class GPT(torch.nn.Module):
    """The model at PP = 1: ``pieces`` run in order.

    ``forward(input_ids [b, s], position_ids [b, s], attention_mask=None, labels=None, loss_mask=None,
    unique=None)`` returns the mean loss over ``loss_mask`` (a scalar) with ``labels`` and ``loss_mask``, the
    per-token loss ``[b, s]`` with ``labels`` alone, else the vocab-parallel logits ``[b, s, V_pad / tp]``. The
    model is causal: ``attention_mask`` must be ``None`` (no padding masks). ``unique``: the micro-batch's
    unique ids made beforehand (:class:`~.inputs.UniqueIds`, the trainer's ``data.unique_ids: host``), for the
    unique-id input layers (no ``torch.unique`` in the forward); ``None``: the layer makes them.
    :meth:`head_input` gives the fused head's operands (evaluation scores from them without the logits). With
    ``seed``, piece ``i`` is built after ``seed_piece(seed + i)``, as the pipeline builds it."""

    def __init__(self, pieces: list[Piece], config=None, seed: int | None = None):
        super().__init__()
        self.config = config
        self.tied_modules = torch.nn.ModuleDict()
        self._funcs: list[Callable] = []
        for i, piece in enumerate(pieces):
            if seed is not None:
                seed_piece(seed + i)
            if piece.tie is None:
                module = piece.build()
                self.add_module(str(i), module)
                self._funcs.append(module)
                continue
            if piece.tie not in self.tied_modules:
                self.tied_modules[piece.tie] = piece.build()
            module = self.tied_modules[piece.tie]
            self._funcs.append(module if piece.forward_fn is None else partial(piece.forward_fn, module))

    @property
    def input_layer(self) -> torch.nn.Module:
        """The variant's input layer (``LEVInput``, ``TableInput``, ...)."""
        return self._funcs[0].embedding

    def _hidden(self, input_ids, position_ids, unique=None):
        x = (input_ids, position_ids) if unique is None else (input_ids, position_ids, unique)
        for f in self._funcs[:-1]:
            x = f(x)
        return x

    def forward(self, input_ids, position_ids=None, attention_mask=None, labels=None, loss_mask=None, unique=None):
        if attention_mask is not None:
            raise ValueError("attention_mask: the model is causal and takes no padding mask; pass None")
        hidden = self._hidden(input_ids, position_ids, unique)
        if labels is None:
            return logits_of(self._funcs[-1](hidden)).transpose(0, 1).contiguous()
        return self._funcs[-1](LossRequest(hidden, labels, loss_mask))

    def head_input(self, input_ids, position_ids=None) -> HeadInput:
        """The final hidden states ``[s, b, D]`` (through ``copy_to_tp``, or gathered under sequence parallelism:
        :func:`~.head.head_entry`) and the head weight ``[V_pad / tp, D]``, for either ``model.loss_impl``."""
        owner = self._head_owner
        group = owner.tp_group
        hidden = head_entry(self._hidden(input_ids, position_ids), group, owner.head_options)
        return HeadInput(hidden, self.head_weight, group, owner.head_options.fused_chunk)  # the fp32-sized chunk

    @property
    def _head_owner(self) -> torch.nn.Module:
        return self.tied_modules[TIE_KEY] if TIE_KEY in self.tied_modules else self._funcs[-1]

    @property
    def head_weight(self) -> torch.nn.Parameter:
        """The output head's ``[V_pad / tp, D]`` weight (TIED: the input table itself)."""
        owner = self._head_owner
        return owner.table if TIE_KEY in self.tied_modules else owner.output_layer.weight


def build_model(model, build: BuildSettings, seed: int | None = None) -> GPT:
    """The PP = 1 model of ``model`` (``ModelConfig``); see :class:`GPT`. Parameters are created on the CPU
    (on the current GPU for megatron-core's layers in a CUDA run without ``init_on_cpu``); move the model with
    ``.to(device)`` (or let DeepSpeed do it). ``model.recompute=full`` marks its first layers
    (:func:`~.recompute.mark_blocks`)."""
    tconfig = build_transformer_config(model, build)
    gpt = GPT(model_pieces(model, build, tconfig), config=tconfig, seed=seed)
    mark_blocks(gpt._funcs, model)
    return gpt
