"""The one reader of a run's TensorBoard scalars (TensorBoard's own ``EventAccumulator``): scalars written as
scalars or as tensors (newer writers). Torch-free; imports tensorboard only when called."""

from __future__ import annotations

from pathlib import Path


class EventsError(ValueError):
    """An event file that TensorBoard cannot read (truncated, foreign); names the directory."""


def read_scalars(tb_dir: Path, tags: tuple[str, ...] | list[str], keep: int = 0) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` in the order written, for each of ``tags`` (``[]``: not in the events).
    ``keep``: at most this many points per tag are held in memory (TensorBoard's reservoir, which always keeps
    the last); 0 keeps all."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    guidance = {ea.SCALARS: keep, ea.TENSORS: keep, ea.HISTOGRAMS: 1, ea.IMAGES: 1, ea.AUDIO: 1}
    try:
        acc = ea.EventAccumulator(str(tb_dir), size_guidance={**guidance, ea.COMPRESSED_HISTOGRAMS: 1})
        acc.Reload()
        have = acc.Tags()
        out = {}
        for tag in tags:
            if tag in have.get(ea.SCALARS, []):
                out[tag] = [(e.step, float(e.value)) for e in acc.Scalars(tag)]
            elif tag in have.get(ea.TENSORS, []):
                from tensorboard.util import tensor_util

                out[tag] = [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]
            else:
                out[tag] = []
    except Exception as e:  # a corrupt file: tensorboard raises many kinds
        raise EventsError(f"{tb_dir}: TensorBoard events not readable ({e})") from None
    return out
