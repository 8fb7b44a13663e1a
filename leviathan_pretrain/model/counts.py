"""Parameter counts of a whole model by part (``input``, ``body``, ``head``, ``total``), without building it: the
closed forms of :mod:`.sizes` and the variants' registry (:mod:`.variants`). Pure Python, like both."""

from __future__ import annotations

from leviathan_pretrain.model import sizes, variants


def input_params(model, tensor_parallel: int = 1) -> int:
    """Parameters of the input representation (the whole model, not one TP rank's share). Tables count
    their padded rows (what is allocated); matched widths are computed from the real vocabulary."""
    return input_split(model, tensor_parallel).total


def input_split(model, tensor_parallel: int = 1):
    """The input layer's :class:`~leviathan_pretrain.model.variants.InputParams` (replicated + TP-sharded)."""
    v_pad = sizes.padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, tensor_parallel)
    return variants.get(model.variant).params(model, v_pad)


def head_params(model, tensor_parallel: int = 1) -> int:
    if variants.get(model.variant).tied_head:
        return 0
    return (
        sizes.padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, tensor_parallel)
        * model.hidden_size
    )


def param_breakdown(model, tensor_parallel: int = 1) -> dict:
    """``{"input", "body", "head", "total"}`` for the whole model (summed over TP ranks)."""
    out = {
        "input": input_params(model, tensor_parallel),
        "body": sizes.body_params(model),
        "head": head_params(model, tensor_parallel),
    }
    out["total"] = out["input"] + out["body"] + out["head"]
    return out
