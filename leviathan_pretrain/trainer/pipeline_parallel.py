"""The model as a DeepSpeed ``PipelineModule``: the pieces of ``model.model_pieces``, one ``LayerSpec`` each.

The layer list is the model's own assembly (model/assembly.py), so the PP = 1 model and the pipeline cannot
drift apart: input layer, ``num_layers`` transformer layers, final norm, head; TIED's input table is a
``TiedLayerSpec("embed", ...)`` used again as the head on the last stage (``tied_head``). DeepSpeed assigns
contiguous runs of pieces to stages, balancing the transformer layers (``partition_method="type:BlockPiece"``),
and seeds piece ``i`` from ``train.seed + i`` when building it (``seed_piece``, as the PP = 1 model does), so
the initial weights do not depend on the stage split. A checkpoint's ``layer_<i>-model_states.pt`` holds piece
``i``'s state dict (TIED: the shared table is saved with piece 0).

:class:`PipeLoss` is the loss on the last stage: ``mean_loss`` of the head's output (the fused head's operands
or the logits, model/head.py) over the loss mask.
"""

from __future__ import annotations

from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from leviathan_pretrain.model.assembly import model_pieces, seed_piece
from leviathan_pretrain.model.head import mean_loss
from leviathan_pretrain.model.recompute import mark_blocks
from leviathan_pretrain.model.settings import BuildSettings


class PipeLoss:
    """``loss_fn(head output, (labels [b, s], loss_mask [b, s])) -> scalar``."""

    def __call__(self, out, targets):
        labels, mask = targets
        return mean_loss(out, labels, mask)


def layer_specs(pieces) -> list[LayerSpec]:
    """DeepSpeed's layer list for ``pieces`` (a ``TiedLayerSpec`` for each use of a shared piece)."""
    return [
        TiedLayerSpec(p.tie, p.cls, *p.args, forward_fn=p.forward_fn, tied_weight_attr=[p.tied_weight])
        if p.tie
        else LayerSpec(p.cls, *p.args)
        for p in pieces
    ]


def build_pipeline(
    model, build: BuildSettings, *, stages: int, data_parallel: int, seed: int
) -> tuple[PipelineModule, PipeLoss]:
    """The ``PipelineModule`` of ``model`` (``ModelConfig``) over ``stages`` x TP x ``data_parallel`` ranks."""
    topo = PipeModelDataParallelTopology(num_pp=stages, num_mp=build.tensor_parallel, num_dp=data_parallel)
    loss = PipeLoss()
    module = PipelineModule(
        layers=layer_specs(model_pieces(model, build)),
        topology=topo,
        loss_fn=loss,
        seed_layers=True,
        seed_fn=seed_piece,
        base_seed=seed,
        partition_method="type:BlockPiece",
    )
    mark_blocks(module.forward_funcs, model)  # model.recompute=full: the first layers of this rank's stage
    return module, loss
