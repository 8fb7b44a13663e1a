"""Resume a checkpoint at another data-parallel size (a requeued job on fewer or more nodes).

ZeRO 0 keeps the whole optimizer state on every rank: DeepSpeed's normal load works at any DP size. ZeRO 1-3
partition the optimizer state (and, at stage 3, the weights) over the DP group, and DeepSpeed refuses to load
those partitions into another DP size. For them we use DeepSpeed's *universal checkpoint*:

1. rank 0 converts ``<dir>/<tag>`` into ``<dir>/<tag>/universal`` with ``deepspeed.checkpoint.ds_to_universal``
   (called in-process; one fp32 weight + Adam moments file per parameter; ``CONVERTED`` marks it done, so a
   second resume reuses it; it lives inside our own checkpoint directory and is pruned with it);
2. every rank loads it with ``load_universal_checkpoint`` switched on for that one load.

Measured on CPU (tiny model, DP 2 -> 1 and 1 -> 2, ZeRO 1/2/3, also TP=2 and PP=2): the resumed losses and
gradient norms equal the uninterrupted run's to 5e-7 (the difference between uninterrupted DP=1 and DP=2 runs
themselves). Changing TP or PP is refused (:func:`check_layout`): the converter does not know megatron-core's
row/column-parallel layouts, so it could only round-trip the same TP.

Work-arounds for DeepSpeed 0.19.8, each needed for exact results (found by comparing optimizer states):

- megatron-core's state dict holds ``<layer>._extra_state: None``; the converter calls ``.float()`` on every
  module entry: those entries are dropped while converting;
- our checkpoints carry no ``universal_checkpoint_info``: converted with ``inject_missing_state``;
- the converter's Megatron-DeepSpeed layer-file map divides by (layer files - 2) // PP: zero for tiny PP
  models; that map is unused by the conversion and made best-effort;
- ZeRO-3's universal load copies param group 0's hyper-parameters into every group (weight decay would land
  on norms and biases): this run's own group settings are restored after the load;
- ZeRO-3's universal load puts one shared ``step`` tensor into every sub-group's state, which torch's AdamW
  increments once per sub-group (bias correction runs ahead): each sub-group gets its own copy;
- ZeRO-3 with TP > 1 cuts a TP slice out of a universal tensor only for parameters with AutoTP metadata: we
  describe our layout (the converter concatenated TP slices along dim 0) on every parameter for the load;
- the converter and the universal loader call ``torch.load(weights_only=False)`` themselves: both run with
  ``torch.load`` forced to weights-only with our allow-list (no arbitrary unpickling, as everywhere else).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from leviathan_pretrain.trainer.checkpoint.names import CheckpointError
from leviathan_pretrain.trainer.checkpoint.record import ParallelLayout
from leviathan_pretrain.trainer.checkpoint.safe_io import safe_load

UNIVERSAL = "universal"
DONE = "CONVERTED"


def check_layout(saved: ParallelLayout, tp: int, pp: int, dp: int, zero_stage: int, reshard: bool, where) -> None:
    """Raise ``CheckpointError`` unless this run can load a checkpoint written with layout ``saved``."""
    old = (saved.tp, saved.pp, saved.dp, saved.zero_stage)
    was = f"TP={old[0]} PP={old[1]} DP={old[2]} ZeRO {old[3]}"
    now = f"TP={tp} PP={pp} DP={dp} ZeRO {zero_stage}"
    if (old[0], old[1]) != (tp, pp):
        raise CheckpointError(
            f"{where}: written with {was}, this run has {now}; changing tensor or pipeline "
            f"parallelism on resume is not supported: resume with parallel.tensor_parallel="
            f"{old[0]} parallel.pipeline_parallel={old[1]} (any number of nodes)"
        )
    if old[3] is not None and old[3] != zero_stage:
        raise CheckpointError(
            f"{where}: written with {was}, this run has {now}; resume with parallel.zero_stage={old[3]}"
        )
    if old[2] != dp and not reshard:
        raise CheckpointError(
            f"{where}: written with {was}, this run has {now}; set checkpoint.reshard=true "
            "to resume at another data-parallel size (DeepSpeed universal checkpoint)"
        )


@contextlib.contextmanager
def weights_only_torch_load(drop_none_module_entries: bool = False):
    """Force ``torch.load`` to weights-only loading with our allow-list while DeepSpeed's converter/loader run."""
    real = torch.load

    def load(f, map_location=None, *args, **kw):
        torch.load = real  # safe_load calls torch.load itself
        try:
            obj = safe_load(f, map_location)
        finally:
            torch.load = load
        if drop_none_module_entries and isinstance(obj, dict) and isinstance(obj.get("module"), dict):
            obj["module"] = {k: v for k, v in obj["module"].items() if v is not None}
        return obj

    torch.load = load
    try:
        yield
    finally:
        torch.load = real


def _best_effort_layer_maps() -> None:
    from deepspeed.checkpoint.deepspeed_checkpoint import DeepSpeedCheckpoint as C

    if getattr(C, "_leviathan_patched", False):
        return
    orig = C._build_transformer_file_map

    def build(self):
        try:
            return orig(self)
        except ZeroDivisionError:  # fewer transformer layer files than pipeline stages
            return {}

    C._build_transformer_file_map = build
    C._leviathan_patched = True


def convert(tag_dir: Path) -> tuple[Path, float]:
    """``<tag_dir>/universal`` from DeepSpeed's files (rank 0; reused when already converted)."""
    from deepspeed.checkpoint import ds_to_universal

    out = Path(tag_dir) / UNIVERSAL
    if (out / DONE).is_file():
        return out, 0.0
    shutil.rmtree(out, ignore_errors=True)  # our own half-done conversion, inside our checkpoint
    args = argparse.Namespace(
        input_folder=str(tag_dir),
        output_folder=str(out),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    _best_effort_layer_maps()
    t0 = time.perf_counter()
    ds_to_universal.cnt = 0
    with weights_only_torch_load(drop_none_module_entries=True), contextlib.redirect_stdout(io.StringIO()):
        ds_to_universal.main(args)
    seconds = time.perf_counter() - t0
    (out / DONE).write_text(f"{seconds:.3f}\n")
    return out, seconds


def _zero3_tp_layout(ds_engine):
    """ZeRO-3 + TP > 1: tell the universal loader each parameter's TP slice (dim 0, equal parts); undo after."""
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META
    from deepspeed.utils import groups
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_world_size()
    params = list(ds_engine.module.parameters())
    for p in params:
        shape = tuple(getattr(p, "ds_shape", p.shape))
        setattr(p, DS_AUTOTP_UC_META, {"partition_dim": 0, "logical_shape": (tp * shape[0], *shape[1:])})
    had = groups._TENSOR_MODEL_PARALLEL_GROUP
    if had is None:
        groups._TENSOR_MODEL_PARALLEL_GROUP = ps.get_tensor_model_parallel_group()

    def undo():
        for p in params:
            delattr(p, DS_AUTOTP_UC_META)
        groups._TENSOR_MODEL_PARALLEL_GROUP = had

    return undo


def load_universal(ds_engine, ckpt_dir: Path, tag: str, zero_stage: int, log=print):
    """Collective: convert on rank 0 (the others wait on the world group), then load on every rank.
    Returns DeepSpeed's ``(path, client_state)``."""
    from megatron.core import parallel_state as ps

    tag_dir = Path(ckpt_dir) / tag
    box = [None]
    if dist.get_rank() == 0:
        try:
            _, seconds = convert(tag_dir)
            box = [("ok", seconds)]
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            box = [("error", f"{type(e).__name__}: {e}")]
    dist.broadcast_object_list(box, src=0)
    if box[0][0] == "error":
        raise CheckpointError(f"{tag_dir}: conversion to DeepSpeed's universal format failed ({box[0][1]})")
    if dist.get_rank() == 0:
        log(
            f"[train] resharding {tag}: DeepSpeed universal checkpoint {tag_dir / UNIVERSAL}"
            + (f" (converted in {box[0][1]:.1f} s)" if box[0][1] else " (reused)")
        )
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in ds_engine.optimizer.param_groups]
    undo = _zero3_tp_layout(ds_engine) if zero_stage == 3 and ps.get_tensor_model_parallel_world_size() > 1 else None
    ds_engine._config.load_universal_checkpoint = True
    try:
        with weights_only_torch_load():
            path, client = ds_engine.load_checkpoint(
                str(tag_dir), tag=UNIVERSAL, load_optimizer_states=True, load_lr_scheduler_states=False
            )
    finally:
        ds_engine._config.load_universal_checkpoint = False
        if undo:
            undo()
    for g, h in zip(ds_engine.optimizer.param_groups, hyper):
        g.update(h)
    inner = getattr(ds_engine.optimizer, "optimizer", None)
    for st in inner.state.values() if inner is not None else ():
        if torch.is_tensor(st.get("step")):
            st["step"] = st["step"].clone()
    return path, client
