"""CPU-safe pieces for megatron-core's GPT: SDPA core attention and a rotary embedding that stays put.

- :class:`SDPACoreAttention` replaces ``DotProductAttention`` in the layer spec's
  ``self_attention.submodules.core_attention`` (megatron-core's own extension point): same constructor and
  ``forward`` signature, but it calls ``torch.nn.functional.scaled_dot_product_attention`` instead of
  allocating from megatron's global CUDA memory buffer.
- :class:`CPUSafeRotaryEmbedding` is megatron-core's ``RotaryEmbedding`` on the device of the hidden states
  it serves (the stock one always moves ``inv_freq`` to the current CUDA device).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import divide

from leviathan_pretrain.model.settings import ModelConfigError, group_size


class SDPACoreAttention(MegatronModule):
    """``core_attention`` for megatron-core's ``SelfAttention``: ``[s, b, heads, dim]`` in, ``[s, b, heads*dim]`` out.

    Causal masking by ``is_causal`` (megatron's ``attention_mask`` is ignored for causal layers, as in
    ``DotProductAttention``); an explicit boolean mask (True = masked out) is honoured for non-causal
    mask types. GQA: key/value heads are repeated to the query heads."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ModelConfigError("parallel: context parallelism is not supported by the SDPA core attention")
        self.attn_mask_type = attn_mask_type
        world = group_size(pg_collection.tp if pg_collection is not None else None)  # heads are TP-sharded
        self.heads = divide(config.num_attention_heads, world)
        self.groups = divide(config.num_query_groups or config.num_attention_heads, world)
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("SDPA core attention: packed sequences / attention bias are not supported")
        if self.heads != self.groups:
            key = key.repeat_interleave(self.heads // self.groups, dim=2)
            value = value.repeat_interleave(self.heads // self.groups, dim=2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        mask_type = attn_mask_type or self.attn_mask_type
        causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
        mask = None if causal or attention_mask is None else ~attention_mask
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal and q.shape[2] > 1,
            dropout_p=self.dropout if self.training else 0.0,
            scale=self.scale,
        )
        s, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


class CPUSafeRotaryEmbedding(RotaryEmbedding):
    """megatron-core's RoPE on the device of the hidden states it serves: ``rotary(seq_len, device=hidden.device)``
    moves ``inv_freq`` there (the stock ``get_emb`` moves it to ``torch.cuda.current_device()`` whenever CUDA
    exists, so a CPU model on a GPU node, ``parallel.device=cpu`` or ``evaluate --device cpu``, mixed devices).
    Each instance keeps its last embedding (key: seq_len, offset, packed_seq, cp_group, device): megatron-core's
    ``lru_cache`` on ``forward`` is class-wide (32 entries for all layers) and has no device in its key."""

    _last = None  # (key, embedding)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None, device=None):
        """``[max_seq_len, 1, 1, dim]`` on ``device`` (``None``: where ``inv_freq`` is; the CPU as built)."""
        if device is not None and self.inv_freq.device != torch.device(device):
            self.inv_freq = self.inv_freq.to(device=device)
        key = (max_seq_len, offset, packed_seq, cp_group, self.inv_freq.device)
        if self._last is None or self._last[0] != key:
            # megatron-core's forward without its cache: get_emb, then the context-parallel slice
            self._last = (key, RotaryEmbedding.forward.__wrapped__(self, max_seq_len, offset, packed_seq, cp_group))
        return self._last[1]

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # on inv_freq's device, never moved to CUDA here
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]
