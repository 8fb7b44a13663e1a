"""The model as a DeepSpeed ``PipelineModule`` (pipeline_parallel > 1), from the model package's pieces.

Layers, in order (DeepSpeed assigns contiguous runs of them to stages, balancing transformer layers):

1. :class:`InputStage`: ``build_input_layer`` (LEV or a baseline); ``(tokens, position_ids) -> [s, b, D]``.
   TIED: the input table is a ``TiedLayerSpec("embed", ...)`` shared with the head on the last stage.
2. :class:`BlockStage` x ``num_layers``: a megatron-core ``TransformerLayer`` from ``build_layer_spec``
   (``layer_number = i + 1``) with the CPU-safe rotary embedding from ``build_rotary``.
3. :class:`HeadStage`: ``build_output_head`` (final norm + vocab-parallel head) -> logits ``[s, b, V/tp]``.
   TIED: :class:`FinalNormStage` then the tied table again, whose ``forward_fn`` is the head matmul.

:class:`PipeLoss` is the loss on the last stage: megatron-core's vocab-parallel cross entropy, mean over the
loss mask. Every layer is seeded from ``train.seed + layer index`` when built (``seed_layers``), so the
initial weights do not depend on how layers are split into stages (PP = 2 starts from the PP = 1 weights).
"""
from __future__ import annotations

import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from megatron.core import tensor_parallel

from leviathan_pretrain.config import Config


class InputStage(torch.nn.Module):
    def __init__(self, cfg: Config, tconfig):
        super().__init__()
        from leviathan_pretrain.model import build_input_layer
        self.embedding = build_input_layer(cfg, tconfig)

    def forward(self, inputs):
        tokens, position_ids = inputs
        # contiguous: stage outputs are sent to the next stage as they are (torch p2p needs it)
        return self.embedding(input_ids=tokens, position_ids=position_ids).contiguous()


class TiedTable(InputStage):
    """The TIED variant's table: the input embedding on the first stage, the output head on the last."""

    @property
    def table(self) -> torch.nn.Parameter:
        return self.embedding.word_embeddings.weight


def tied_input_fn(module: TiedTable, inputs):
    return module(inputs)


def tied_head_fn(module: TiedTable, hidden):
    # ColumnParallelLinear without its own weight: identity forward / all-reduce backward over TP, then matmul.
    hidden = tensor_parallel.copy_to_tensor_model_parallel_region(hidden)
    return torch.matmul(hidden, module.table.t())


class BlockStage(torch.nn.Module):
    def __init__(self, cfg: Config, tconfig, layer_number: int):
        super().__init__()
        from megatron.core.transformer.spec_utils import build_module

        from leviathan_pretrain.model import build_layer_spec, build_rotary
        self.layer = build_module(build_layer_spec(cfg), config=tconfig, layer_number=layer_number)
        self.rotary = build_rotary(cfg, tconfig)

    def forward(self, hidden):
        out = self.layer(hidden, attention_mask=None, rotary_pos_emb=self.rotary(hidden.shape[0]))
        return (out[0] if isinstance(out, tuple) else out).contiguous()


class HeadStage(torch.nn.Module):
    def __init__(self, cfg: Config, tconfig, tied: bool = False):
        super().__init__()
        from leviathan_pretrain.model import build_output_head
        self.head = build_output_head(cfg, tconfig, tied=tied)

    def forward(self, hidden):
        return self.head(hidden)


class FinalNormStage(HeadStage):
    def __init__(self, cfg: Config, tconfig):
        super().__init__(cfg, tconfig, tied=True)

    def forward(self, hidden):
        return self.head.final_layernorm(hidden)


class PipeLoss:
    """``loss_fn(logits [s, b, V/tp], (labels [b, s], loss_mask [b, s])) -> scalar``; ``nan_next`` is the
    test-only NaN injection (see ``train.inject_nan_steps``)."""

    def __init__(self):
        self.nan_next = False

    def __call__(self, logits, targets):
        from leviathan_pretrain.model import OutputHead
        labels, mask = targets
        per_token = OutputHead.loss(logits, labels)
        loss = masked_mean(per_token, mask)
        if self.nan_next:
            loss = loss * float("nan")
        return loss


def masked_mean(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(per_token.dtype)
    return (per_token.float() * mask.float()).sum() / mask.float().sum().clamp(min=1.0)


def seed_layer(seed) -> None:
    """``PipelineModule``'s per-layer seeding (its layer index can be a numpy integer, which ``random.seed``
    rejects on Python >= 3.11)."""
    from deepspeed.runtime.utils import set_random_seed
    set_random_seed(int(seed))


def build_pipeline(cfg: Config, tconfig) -> tuple[PipelineModule, PipeLoss]:
    p = cfg.parallel
    from megatron.core import parallel_state as ps
    topo = PipeModelDataParallelTopology(num_pp=p.pipeline_parallel, num_mp=p.tensor_parallel,
                                         num_dp=ps.get_data_parallel_world_size())
    tied = cfg.model.variant == "tied"
    layers: list = []
    if tied:
        layers.append(TiedLayerSpec("embed", TiedTable, cfg, tconfig, forward_fn=tied_input_fn,
                                    tied_weight_attr=["embedding.word_embeddings.weight"]))
    else:
        layers.append(LayerSpec(InputStage, cfg, tconfig))
    layers += [LayerSpec(BlockStage, cfg, tconfig, i + 1) for i in range(cfg.model.num_layers)]
    if tied:
        layers.append(LayerSpec(FinalNormStage, cfg, tconfig))
        layers.append(TiedLayerSpec("embed", TiedTable, cfg, tconfig, forward_fn=tied_head_fn,
                                    tied_weight_attr=["embedding.word_embeddings.weight"]))
    else:
        layers.append(LayerSpec(HeadStage, cfg, tconfig))
    loss = PipeLoss()
    module = PipelineModule(layers=layers, topology=topo, loss_fn=loss, seed_layers=True, seed_fn=seed_layer,
                            base_seed=cfg.train.seed, partition_method="type:BlockStage")
    return module, loss
