"""Saved activations per rank, the part of :mod:`.planner`'s memory estimate that forward and backward keep (pure
Python).

The formulas, sequence parallelism's divisions included, are :mod:`.planner`'s module docstring ("activations");
:mod:`.planner` re-exports these names. ``sp``: ``parallel.sequence_parallel`` (at TP >= 2): the tensors every TP rank
would otherwise hold in full (the norms' saved tensors, which include the column-parallel linears' inputs, a fully
recomputed layer's input, the final norm's, the pipeline's stage inputs and outputs) are the sequence shard, 1 / TP.
"""

from __future__ import annotations

from leviathan_pretrain.model import sizes, variants
from leviathan_pretrain.model.settings import resolved_attention


def attention_kind(m, device: str) -> str:
    """``sdpa`` or ``megatron``, as ``model.gpt.attention_backend`` resolves it (``auto``: sdpa on every device)."""
    return resolved_attention(m.attention_backend)


def layer_activation_bytes(
    m, tokens: int, tp: int, e: int, attention: str, selective: bool = True, sp: bool = False
) -> float:
    """Saved activations of one transformer layer for one micro-batch of ``tokens`` = s x b (see :mod:`.planner`), less
    what ``model.recompute=selective`` recomputes (``selective=False``: as if it did not); ``sp``: the two RMSNorms'
    ``2 (8 + e) D`` (their inputs, fp32 copies and outputs, the column-parallel linears' inputs) divided by TP."""
    D, F, s = m.hidden_size, m.resolved_ffn_hidden_size(), m.seq_length
    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    modules = set(m.recompute_modules) if selective and m.recompute == "selective" else set()
    A = 4 if groups < heads else 6
    if "core_attn" in modules and groups < heads:  # GQA's expanded k, v: the original ones kept instead
        A -= 2 * (1 - groups / heads)
    mlp = 0 if "mlp" in modules else 5 * F  # a recomputed MLP keeps its input: the norm's output, counted there
    norms = 2 * (8 + e) * D / (tp if sp else 1)
    out = tokens * (norms + e * (A * D + mlp) / tp)
    if attention == "megatron" and "core_attn" not in modules:
        out += tokens * heads / tp * s * (4 + e if e != 4 else 4)
    return out


def recompute_text(m) -> str:
    """``model.recompute`` in the plan's words: ``none``, ``selective (core_attn, mlp)``, ``full (first 2 layers of
    each stage)``, ``full (every layer)``."""
    if m.recompute == "selective":
        return f"selective ({', '.join(m.recompute_modules)})"
    if m.recompute == "full":
        n = m.recompute_layers
        return "full (every layer)" if n is None else f"full (first {n} layer{'s' * (n > 1)} of each stage)"
    return "none"


def recompute_bytes(
    m, blocks: int, tokens: int, tp: int, e: int, attention: str, sp: bool = False
) -> tuple[float, float]:
    """``(per micro-batch, working set)`` of a stage's ``blocks`` layers under ``model.recompute``: a layer that
    ``full`` recomputes keeps only its input (``e T D``, ``e T D / TP`` with ``sp``: the sequence shard); the others
    keep :func:`layer_activation_bytes`. The working set, once per stage: while a recomputed layer runs its backward
    its activations are all there again (``full``: a whole layer's; ``selective``: the recomputed modules')."""
    full = sizes.blocks_to_recompute(m, blocks)
    per_layer = layer_activation_bytes(m, tokens, tp, e, attention, sp=sp)
    kept = full * e * tokens * m.hidden_size / (tp if sp else 1) + (blocks - full) * per_layer
    whole = layer_activation_bytes(m, tokens, tp, e, attention, selective=False, sp=sp)
    working = whole if full else (whole - per_layer if m.recompute == "selective" and blocks else 0.0)
    return kept, working


def input_activation_bytes(m, tokens: int, tp: int, e: int) -> float:
    """The input layer's saved tensors for one micro-batch (unique-id layers: n = min(tokens, V) ids); the same with
    sequence parallelism (its output is scattered, what it saves is not)."""
    return float(variants.get(m.variant).activation_bytes(m, min(tokens, m.vocab_size), tp, e))


def stage_activation_bytes(m, st: dict, tokens: int, tp: int, e: int, pp: int, sp: bool = False) -> float:
    """One micro-batch's saved tensors of stage ``st`` (:func:`.stages.stage_layout`) outside its transformer layers:
    the input layer's, the final norm's ``T (8 + e) D``, with ``sp`` the head's all-gathered input ``e T D`` (kept in
    full on every rank; without ``sp`` it is the final norm's output, counted there) and, when PP > 1, DeepSpeed's
    pipe buffers (the stage input and output, ``2 e T D``); each ``/ TP`` with ``sp`` but the head's input."""
    D, shard = m.hidden_size, tp if sp else 1
    out = input_activation_bytes(m, tokens, tp, e) if st["input"] else 0.0
    out += tokens * (8 + e) * D / shard if st["final"] else 0.0
    out += e * tokens * D if st["head"] and sp else 0.0
    out += 2.0 * e * tokens * D / shard if pp > 1 else 0.0
    return out
