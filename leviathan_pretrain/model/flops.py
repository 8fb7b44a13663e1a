"""Model FLOPs per token (for MFU).

FLOPs convention (PaLM / Megatron-LM style, *model* FLOPs: no recomputation counted):

    flops/token = 6 * N_matmul  +  12 * L * D * s  +  input_layer

- ``N_matmul``: weights used in matmuls for every token: per layer QKV ``D*(D + 2*kv)``, attention output
  ``D*D``, SwiGLU ``3*D*F``; plus the output head ``V_pad*D`` (also when tied). Norms and table lookups: 0.
- ``6*L*s*q``: core attention (QK^T and AV, ``q`` = heads x head dim = D) counted for the causal half, as
  Megatron-LM's ``num_floating_point_operations`` does: a query attends to s/2 keys on average, so forward
  ``2 * 2 * q * s/2`` per token and layer, x3 for forward + backward.
- Input layers that compute rows per unique id (LEV, ALBERT, MLP ablations) cost
  ``3 * forward_flops_per_id * unique_ratio`` where ``unique_ratio`` = unique ids / tokens in the micro-batch
  (1.0, the default, is an upper bound; ``model.input_layer.last_unique_ratio`` holds the last measured one).
  LEV's forward per id: ``2*h*d^2`` (W_l) + ``7*h*d*r`` (3 gathered multiply-adds and the log-sum per
  element of the [h, d, r] block; transcendentals counted as 1) + ``2*h*r*D`` (W_out).
"""

from __future__ import annotations

from leviathan_pretrain.model import sizes, variants


def input_forward_flops_per_id(model) -> float:
    """Forward FLOPs of the input layer per unique id (0 for plain tables)."""
    return float(variants.get(model.variant).forward_flops_per_id(model))


def model_flops_per_token(cfg, unique_ratio: float = 1.0) -> float:
    """Training FLOPs (forward + backward) per token of ``cfg.model``; see the module doc for the convention."""
    m = cfg.model
    D, L, s = m.hidden_size, m.num_layers, m.seq_length
    per_layer = sizes.layer_params_split(m)[1]  # the matmul weights
    head = sizes.padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, cfg.parallel.tensor_parallel) * D
    q = m.num_attention_heads * (D // m.num_attention_heads)
    return 6.0 * (L * per_layer + head) + 6.0 * L * s * q + 3.0 * input_forward_flops_per_id(m) * unique_ratio
