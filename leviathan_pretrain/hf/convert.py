"""Conversion of a loaded run (evaluation/load.py's ``load_trained``) to Hugging Face Llama pieces, and greedy decoding.

- :func:`llama_config` -> ``LlamaConfig`` of the run's ``cfg.model`` (RMSNorm, SwiGLU, GQA, RoPE, no biases);
- :func:`llama_state_dict` -> HF names -> fp32 tensors: megatron-core's fused ``linear_qkv`` (per query group
  ``[q heads of the group; k; v]``) and ``linear_fc1`` (``[gate; up]``) split, the padded vocabulary rows
  dropped, the input layer of every non-table variant materialised into the dense ``embed_tokens`` table;
  :func:`check_llama_layout` compares names and shapes with a meta-device ``LlamaForCausalLM``;
- :func:`greedy_decode` -> greedy continuation with the repo's own model (the reference for HF ``generate()``).

The tokenizer is written by :mod:`.tokenizer`. Used by ``python -m leviathan_pretrain.export_hf`` (docs/export.md).
"""

from __future__ import annotations

import torch

from leviathan_pretrain.evaluation.scoring import logits_for
from leviathan_pretrain.hf.tokenizer import ExportError

# ---------------------------------------------------------------- greedy reference decoding


def greedy_decode(model, ids: torch.Tensor, n: int, vocab_size: int, eos_id: int | None = None) -> torch.Tensor:
    """``ids [b, s]`` followed by ``n`` greedily chosen tokens: ``[b, s + n]`` (no KV cache: the whole prefix is
    recomputed each step with :func:`~.evaluation.scoring.logits_for`). With ``eos_id``, a row that has produced
    it keeps producing ``eos_id`` and decoding stops once every row has (the result may then be shorter)."""
    out = ids
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    for _ in range(n):
        nxt = logits_for(model, out, vocab_size)[:, -1].argmax(dim=-1)
        if eos_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            done |= nxt == eos_id
        out = torch.cat([out, nxt[:, None]], dim=1)
        if eos_id is not None and bool(done.all()):
            break
    return out


# ---------------------------------------------------------------- the model


def llama_config(cfg, tokenizer_ids: dict, dtype: str):
    """The ``LlamaConfig`` of the run's ``cfg.model`` (``tokenizer_ids``: bos / eos / pad ids,
    :func:`.tokenizer.special_ids`)."""
    from transformers import LlamaConfig

    m = cfg.model
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.resolved_ffn_hidden_size(),
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_query_groups or m.num_attention_heads,
        head_dim=m.hidden_size // m.num_attention_heads,
        hidden_act="silu",
        rms_norm_eps=m.norm_epsilon,
        rope_parameters={"rope_type": "default", "rope_theta": float(m.rotary_base)},
        max_position_embeddings=m.seq_length,
        initializer_range=m.init_method_std,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=m.variant == "tied",
        bos_token_id=tokenizer_ids["bos"],
        eos_token_id=tokenizer_ids["eos"],
        pad_token_id=tokenizer_ids["pad"],
        dtype=dtype,
    )


def embedding_table(model, vocab_size: int) -> torch.Tensor:
    """The dense ``[V, D]`` input table: TIED / UNTIED's own rows (padding dropped), else the materialised
    function of the token id (LEV, ALBERT, flat / factored MLP)."""
    layer = model.input_layer
    if hasattr(layer, "materialize"):
        return layer.materialize(dtype=torch.float32).float()
    return layer.word_embeddings.weight[:vocab_size].float()


def llama_state_dict(model, cfg) -> dict[str, torch.Tensor]:
    """HF Llama names -> fp32 tensors of the merged TP = 1 ``model`` (model/assembly.py's ``GPT``); every weight
    of the model is used exactly once (an unmapped weight is an error, never silently dropped)."""
    m = cfg.model
    V, L = m.vocab_size, m.num_layers
    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    hn, ffn = m.hidden_size // heads, m.resolved_ffn_hidden_size()
    sd = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    used = {k for k in sd if k.startswith("0.embedding.") or k.startswith("tied_modules.")}
    out = {"model.embed_tokens.weight": embedding_table(model, V)}

    def take(key):
        if key not in sd:
            raise ExportError(f"the model has no weight {key} (its layout is not the one export_hf knows)")
        used.add(key)
        return sd[key].float()

    for i in range(L):
        src, dst = f"{i + 1}.layer.", f"model.layers.{i}."
        qkv = take(src + "self_attention.linear_qkv.weight")
        per = heads // groups  # query heads per group; rows per group: [per * hn query; hn key; hn value]
        qkv = qkv.view(groups, per + 2, hn, -1)
        out[dst + "self_attn.q_proj.weight"] = qkv[:, :per].reshape(heads * hn, -1)
        out[dst + "self_attn.k_proj.weight"] = qkv[:, per].reshape(groups * hn, -1)
        out[dst + "self_attn.v_proj.weight"] = qkv[:, per + 1].reshape(groups * hn, -1)
        out[dst + "self_attn.o_proj.weight"] = take(src + "self_attention.linear_proj.weight")
        fc1 = take(src + "mlp.linear_fc1.weight")
        if fc1.shape[0] != 2 * ffn:
            raise ExportError(f"{src}mlp.linear_fc1.weight: {tuple(fc1.shape)} is not [gate; up] of {ffn} rows each")
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = fc1[:ffn], fc1[ffn:]
        out[dst + "mlp.down_proj.weight"] = take(src + "mlp.linear_fc2.weight")
        out[dst + "input_layernorm.weight"] = take(src + "input_layernorm.weight")
        out[dst + "post_attention_layernorm.weight"] = take(src + "pre_mlp_layernorm.weight")
    out["model.norm.weight"] = take(f"{L + 1}.final_layernorm.weight")
    if m.variant != "tied":
        out["lm_head.weight"] = take(f"{L + 2}.output_layer.weight")[:V]
    left = sorted(set(sd) - used)
    if left:
        raise ExportError(f"weights with no Llama counterpart: {', '.join(left[:5])} (cannot export as Llama)")
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in out.items()}


def check_llama_layout(config, state: dict) -> None:
    """Names and shapes of ``state`` against a ``LlamaForCausalLM(config)`` built on the meta device."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in LlamaForCausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:
        want.pop("lm_head.weight", None)
    have = {k: tuple(v.shape) for k, v in state.items()}
    if have != want:
        diff = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
        raise ExportError(f"the converted weights do not fit LlamaForCausalLM: {', '.join(diff[:5])}")
