"""A micro-batch on its way to the device: one host buffer, one copy, the unique ids made on the host.

:class:`Transfer` holds a run's choices (:meth:`Transfer.for_run`) and turns a micro-batch dict of host tensors
(``tokens``, ``labels``, ``position_ids``, ``loss_mask``: what :class:`~.datasets.Batches` and the benchmarks make) into
a :class:`MicroBatch` (:meth:`Transfer.prepare`), which :meth:`MicroBatch.to_device` hands to the device:

- packed (``data.packed_transfer``, the default): the four tensors (as int64, int64, int64, float32) and, when
  the unique ids are made on the host, those ids and their inverse (int64) are written into one contiguous
  ``uint8`` host buffer at 8-byte aligned offsets. On a CUDA run the buffer is pinned (allocated from torch's
  caching host allocator, which does not reuse a block before the non-blocking copies reading it have run); on
  the CPU never. ``to_device`` copies it with one ``to(device, non_blocking=True)`` and returns views of the
  device copy (on the CPU: views of the host buffer itself, no copy). A pageable ``.to(device)`` per tensor made
  the host wait for the GPU four times per micro-batch; a pinned non-blocking copy does not.
- unpacked (``data.packed_transfer=false``: the old path): each tensor ``.to(device)`` on its own.
- unique ids (``data.unique_ids``, :func:`unique_ids_on_host`): :func:`unique_ids` on the host, padded to a
  multiple of ``data.unique_bucket`` by repeating the last (largest) id, handed to the model as
  :class:`~leviathan_pretrain.model.inputs.UniqueIds` with the true count; the input layer then makes no
  ``torch.unique`` (a host synchronisation per micro-batch on a GPU: its output size depends on the data).

The host tensors of a packed micro-batch (``mb["tokens"]``, ...) are views of its buffer: reading them reads, and
changing them changes, what is sent. Every other reader of the micro-batch dicts (validation, the pipeline
engine's own loading, tests) sees the same four keys as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from leviathan_pretrain.model.inputs import UniqueIds

KEYS = ("tokens", "labels", "position_ids", "loss_mask")
DTYPES = {"tokens": torch.int64, "labels": torch.int64, "position_ids": torch.int64, "loss_mask": torch.float32}
ALIGN = 8  # bytes: every tensor of the buffer starts at a multiple (int64 views need it)


def unique_ids_on_host(cfg) -> bool:
    """Whether this run makes its unique ids on the host (``data.unique_ids``): ``host`` or ``auto`` for an input
    layer that is a :class:`~leviathan_pretrain.model.inputs.UniqueIdInput` outside the pipeline engine (which
    loads its own micro-batches; ``host`` is refused there at config load). The tables have no unique ids."""
    if cfg.data.unique_ids == "device" or cfg.parallel.uses_pipeline_engine:
        return False
    from leviathan_pretrain.model import variants
    from leviathan_pretrain.model.inputs import UniqueIdInput

    return issubclass(variants.layer_class(variants.get(cfg.model.variant)), UniqueIdInput)


def unique_ids(tokens: torch.Tensor, bucket: int = 1) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(ids, inverse, count)``: ``torch.unique(tokens, return_inverse=True)`` (sorted ids, ``inverse`` of
    ``tokens``' shape), the ids padded to a multiple of ``bucket`` by repeating the last one; ``count`` the true
    number of unique ids."""
    ids, inverse = torch.unique(tokens, return_inverse=True)
    count = ids.numel()
    pad = -count % bucket if count else 0
    if pad:
        ids = torch.cat([ids, ids[-1:].expand(pad)])
    return ids, inverse, count


class DeviceBatch(NamedTuple):
    """A micro-batch's tensors on the device; ``unique`` None where the layer makes its own (or has none)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    unique: UniqueIds | None


class MicroBatch(dict):
    """A prepared micro-batch: the dict of its four host tensors (views of ``buffer`` when packed), plus
    ``unique`` (host :class:`~leviathan_pretrain.model.inputs.UniqueIds`, or None), ``buffer`` (the packed
    ``uint8`` host buffer, or None) and ``layout`` (``(name, dtype, shape, byte offset)`` of each tensor in it)."""

    def __init__(self, tensors: dict, unique: UniqueIds | None = None, buffer=None, layout: tuple = ()):
        super().__init__(tensors)
        self.unique, self.buffer, self.layout = unique, buffer, layout

    def to_device(self, device) -> DeviceBatch:
        """The tensors on ``device``: packed, one non-blocking copy of the buffer and views of it; else one
        ``.to(device)`` per tensor (the old path)."""
        if self.buffer is None:
            t = {k: self[k].to(device) for k in KEYS}
            u = None if self.unique is None else UniqueIds(*(x.to(device) for x in self.unique[:2]), self.unique.count)
            return DeviceBatch(**t, unique=u)
        buf = self.buffer.to(device, non_blocking=True)
        views = {name: _view(buf, dtype, shape, offset) for name, dtype, shape, offset in self.layout}
        u = None if self.unique is None else UniqueIds(views.pop("unique_ids"), views.pop("inverse"), self.unique.count)
        return DeviceBatch(**views, unique=u)


def _view(buf: torch.Tensor, dtype: torch.dtype, shape: tuple, offset: int) -> torch.Tensor:
    n = torch.Size(shape).numel() * dtype.itemsize
    return buf[offset : offset + n].view(dtype).view(shape)


@dataclass(frozen=True)
class Transfer:
    """How a run's micro-batches reach the device (see the module doc): ``packed`` into one buffer, ``pin``
    (pinned host memory; CUDA runs), ``unique_bucket`` (make the unique ids on the host, padded to a multiple of
    it; None: the model makes them)."""

    packed: bool = True
    pin: bool = False
    unique_bucket: int | None = None

    @classmethod
    def for_run(cls, cfg, device) -> Transfer:
        """The run's choices: ``data.packed_transfer``, pinned on a CUDA ``device`` only, ``data.unique_ids``
        (:func:`unique_ids_on_host`) and ``data.unique_bucket``."""
        d = cfg.data
        cuda = torch.device(device).type == "cuda"
        bucket = d.unique_bucket if unique_ids_on_host(cfg) else None
        return cls(packed=d.packed_transfer, pin=cuda and d.packed_transfer, unique_bucket=bucket)

    def prepare(self, mb: dict) -> MicroBatch:
        """``mb`` (a dict of the four host tensors) as a :class:`MicroBatch`; one already prepared as it is."""
        if isinstance(mb, MicroBatch):
            return mb
        tensors = {k: torch.as_tensor(mb[k]) for k in KEYS}
        unique = None
        if self.unique_bucket is not None:
            unique = UniqueIds(*unique_ids(tensors["tokens"], self.unique_bucket))
        if not self.packed:
            return MicroBatch(tensors, unique)
        parts = [(k, tensors[k].to(DTYPES[k])) for k in KEYS]
        if unique is not None:
            parts += [("unique_ids", unique.ids), ("inverse", unique.inverse)]
        layout, offset = [], 0
        for name, t in parts:
            layout.append((name, t.dtype, tuple(t.shape), offset))
            offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
        buf = torch.empty(offset, dtype=torch.uint8, pin_memory=self.pin)
        views = {}
        for (name, t), (_, dtype, shape, off) in zip(parts, layout):
            views[name] = _view(buf, dtype, shape, off)
            views[name].copy_(t)
        host_unique = None if unique is None else UniqueIds(views["unique_ids"], views["inverse"], unique.count)
        return MicroBatch({k: views[k] for k in KEYS}, host_unique, buf, tuple(layout))
