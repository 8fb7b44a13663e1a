"""Leviathan models: a LLaMA-style GPT on megatron-core layers with a swappable input representation.

Public API (imported lazily, so ``leviathan_pretrain.model.sizes`` stays free of torch/megatron imports):

- ``BuildSettings`` (TP size/group, precision, device: what the builders take besides ``ModelConfig``),
  ``ModelConfigError``
- ``model_pieces(model, build) -> [Piece]``: THE assembly (input, transformer layers, final norm, head);
  ``build_model(model, build, seed=None) -> GPT`` runs it at PP = 1 (trainer/pipe.py makes it a pipeline);
  ``token_loss``, ``mean_loss`` (either head output, model/head.py), ``masked_mean``, ``seed_piece``
- ``build_transformer_config``, ``build_layer_spec``, ``build_input_layer``, ``build_rotary`` (model, build)
- ``lev_layer(module)``, ``lev_health(layer_or_model, gather=False) -> dict``
- ``model_flops_per_token(cfg, unique_ratio=1.0) -> float``
- ``weight_decay_groups(model, weight_decay, decay_lev_codebooks=False) -> list[dict]``, ``no_weight_decay(name, p)``
- ``LEVInput``, ``TableInput``, ``AlbertInput``, ``FlatMLPInput``, ``FactoredMLPInput``, ``TokenIdError``
"""

_EXPORTS = {
    "BuildSettings": "settings",
    "ModelConfigError": "settings",
    "model_pieces": "assembly",
    "build_model": "assembly",
    "GPT": "assembly",
    "Piece": "assembly",
    "masked_mean": "head",
    "seed_piece": "assembly",
    "LAYOUT_VERSION": "assembly",
    "build_transformer_config": "gpt",
    "build_input_layer": "gpt",
    "build_layer_spec": "gpt",
    "build_rotary": "gpt",
    "padded_vocab_size": "gpt",
    "attention_backend": "gpt",
    "token_loss": "head",
    "mean_loss": "head",
    "HeadInput": "head",
    "LossRequest": "head",
    "lev_health": "lev",
    "lev_layer": "lev",
    "LEVInput": "lev",
    "TableInput": "inputs",
    "AlbertInput": "inputs",
    "FlatMLPInput": "inputs",
    "FactoredMLPInput": "inputs",
    "UniqueIdInput": "inputs",
    "TokenIdError": "inputs",
    "check_token_ids": "inputs",
    "model_flops_per_token": "accounting",
    "weight_decay_groups": "accounting",
    "no_weight_decay": "accounting",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
