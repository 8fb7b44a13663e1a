"""Parameter counts of a whole model by part (``input``, ``body``, ``head``, ``total``), without building it: the
closed forms of :mod:`.sizes` and the variants' registry (:mod:`.variants`). Pure Python, like both.

One vocabulary for every command that prints a count (``params``, ``train``, ``evaluate``, ``export_hf``):

- **trained parameters** (``total``): what the optimizer updates, the whole model summed over TP ranks:
  ``input layer`` + ``transformer body`` (the layers and the final norm) + ``output head`` (0 for TIED, whose
  head is the input table). Tables hold megatron's padded vocabulary (``model.vocab_size`` rounded up to a
  multiple of ``make_vocab_size_divisible_by x TP``); the padded rows are trained parameters too (their logits
  are in the training softmax) and each count that holds some says how many (``padding``).
- **exported parameters**: the dense Hugging Face Llama of ``export_hf``: the transformer body, the
  ``V x D`` ``embed_tokens`` table (every input layer materialised: LEV's few trained parameters become a whole
  table) and, unless TIED, the ``V x D`` ``lm_head``; ``V = model.vocab_size``, the padded rows dropped.
"""

from __future__ import annotations

from leviathan_pretrain.model import sizes, variants

TRAINED = "trained parameters"
EXPORTED = "exported parameters"


def input_params(model, tensor_parallel: int = 1) -> int:
    """Parameters of the input representation (the whole model, not one TP rank's share). Tables count
    their padded rows (what is allocated); matched widths are computed from the real vocabulary."""
    return input_split(model, tensor_parallel).total


def input_split(model, tensor_parallel: int = 1):
    """The input layer's :class:`~leviathan_pretrain.model.variants.InputParams` (replicated + TP-sharded)."""
    return variants.get(model.variant).params(model, padded_vocab(model, tensor_parallel))


def padded_vocab(model, tensor_parallel: int = 1) -> int:
    """The rows of the model's vocabulary tables: ``model.vocab_size`` padded as megatron pads it for TP."""
    return sizes.padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, tensor_parallel)


def head_params(model, tensor_parallel: int = 1) -> int:
    if variants.get(model.variant).tied_head:
        return 0
    return padded_vocab(model, tensor_parallel) * model.hidden_size


def param_breakdown(model, tensor_parallel: int = 1) -> dict:
    """``{"input", "body", "head", "total"}`` for the whole model (summed over TP ranks); ``total``: the trained
    parameters."""
    out = {
        "input": input_params(model, tensor_parallel),
        "body": sizes.body_params(model),
        "head": head_params(model, tensor_parallel),
    }
    out["total"] = out["input"] + out["body"] + out["head"]
    return out


def padding_params(model, tensor_parallel: int = 1) -> int:
    """The trained parameters in the padded vocabulary rows (of every table with ``V_pad`` rows: TIED / UNTIED's
    input table, ALBERT's and Flat-MLP's, the untied head); 0 when ``model.vocab_size`` needs no padding."""
    spec, v = variants.get(model.variant), model.vocab_size
    unpadded = spec.params(model, v).total + (0 if spec.tied_head else v * model.hidden_size)
    return input_params(model, tensor_parallel) + head_params(model, tensor_parallel) - unpadded


def exported_params(model) -> int:
    """The parameters of the Hugging Face Llama export (see the module doc)."""
    tables = 1 if variants.get(model.variant).tied_head else 2
    return sizes.body_params(model) + tables * model.vocab_size * model.hidden_size


def param_summary(model, tensor_parallel: int = 1) -> dict:
    """:func:`param_breakdown` and what the counts' descriptions need: ``padding`` (trained parameters in padded
    rows), ``vocab_size``, ``padded_vocab_size``, ``tensor_parallel``."""
    return {
        **param_breakdown(model, tensor_parallel),
        "padding": padding_params(model, tensor_parallel),
        "vocab_size": model.vocab_size,
        "padded_vocab_size": padded_vocab(model, tensor_parallel),
        "tensor_parallel": tensor_parallel,
    }


def millions(n: int) -> str:
    return f"{n / 1e6:,.2f}M"


def padding_text(s: dict) -> str:
    """``"49,152 of them in padded vocabulary rows (8,000 ids padded to 8,192 rows at TP=2)"``; empty without
    padding. ``s``: :func:`param_summary`'s keys (``vocab_size`` and the rest may be missing: then the rows are
    not named)."""
    if not s.get("padding"):
        return ""
    text = f"{s['padding']:,} of them in padded vocabulary rows"
    if s.get("vocab_size") and s.get("padded_vocab_size"):
        text += f" ({s['vocab_size']:,} ids padded to {s['padded_vocab_size']:,} rows"
        text += f" at TP={s['tensor_parallel']})" if s.get("tensor_parallel") else ")"
    return text


def trained_text(s: dict) -> str:
    """One line: ``"5,562,752 trained parameters (5.56M) = input layer 55,424 + transformer body 3,410,176 +
    output head 2,097,152; 49,152 of them in padded vocabulary rows (...)"``; ``s``: :func:`param_summary`'s
    keys (``input``, ``body``, ``head``, ``total``; the padding ones optional)."""
    head = f"{s['head']:,}" if s["head"] else "0 (tied: the input table)"
    text = (
        f"{s['total']:,} {TRAINED} ({millions(s['total'])}) = input layer {s['input']:,} + transformer body "
        f"{s['body']:,} + output head {head}"
    )
    pad = padding_text(s)
    return f"{text}; {pad}" if pad else text


def exported_text(model, n: int | None = None) -> str:
    """One line: ``"7,506,176 exported parameters (7.51M) = transformer body 3,410,176 + embed_tokens 8,000 x 256
    (the lev input layer materialised) + lm_head 8,000 x 256"``; ``n``: the count to print (the export's own; the
    closed form when None)."""
    V, D = model.vocab_size, model.hidden_size
    n = exported_params(model) if n is None else n
    spec = variants.get(model.variant)
    table = spec.layer.endswith(":TableInput")  # TIED / UNTIED: the trained table, its padded rows dropped
    made = f"the {model.variant} input table" if table else f"the {model.variant} input layer materialised"
    head = "lm_head tied to it" if spec.tied_head else f"lm_head {V:,} x {D}"
    return (
        f"{n:,} {EXPORTED} ({millions(n)}) = transformer body {sizes.body_params(model):,} + embed_tokens "
        f"{V:,} x {D} ({made}) + {head}"
    )
