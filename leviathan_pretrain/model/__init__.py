"""Leviathan models: megatron-core GPT with a swappable input representation (LEV and the baselines).

Public API (imported lazily, so ``leviathan_pretrain.model.sizes`` stays free of torch/megatron imports):

- ``build_transformer_config(cfg, device=None) -> TransformerConfig``
- ``build_model(cfg, device=None) -> GPTModel``                     (pipeline_parallel == 1)
- ``build_input_layer(cfg, tconfig)``, ``build_layer_spec(cfg, device=None)``, ``build_rotary(cfg, tconfig)``,
  ``build_output_head(cfg, tconfig, tied=None)``                      (pipeline stages)
- ``lev_health(layer_or_model, gather=False) -> dict``
- ``model_flops_per_token(cfg, unique_ratio=1.0) -> float``
- ``weight_decay_groups(model, weight_decay, decay_lev_codebooks=False) -> list[dict]``, ``no_weight_decay(name, p)``
- ``LEVInput``, ``TableInput``, ``AlbertInput``, ``FlatMLPInput``, ``FactoredMLPInput``, ``TokenIdError``
"""
_EXPORTS = {
    "build_transformer_config": "gpt", "build_model": "gpt", "build_input_layer": "gpt",
    "build_layer_spec": "gpt", "build_rotary": "gpt", "build_output_head": "gpt", "OutputHead": "gpt",
    "padded_vocab_size": "gpt", "attention_backend": "gpt",
    "lev_health": "lev", "LEVInput": "lev",
    "TableInput": "inputs", "AlbertInput": "inputs", "FlatMLPInput": "inputs", "FactoredMLPInput": "inputs",
    "UniqueIdInput": "inputs", "TokenIdError": "inputs", "check_token_ids": "inputs",
    "model_flops_per_token": "accounting", "weight_decay_groups": "accounting", "no_weight_decay": "accounting",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
