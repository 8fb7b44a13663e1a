"""A toy input variant, added the way the README's Contributing section says: one module (its layer) and one
registry entry (:data:`TOY`). Rows are a replicated ``V x 4`` table times a ``4 x D`` projection (ALBERT-like,
nothing sharded over TP). tests/test_model.py registers it and checks the config, the closed forms and the
model use it without any other change."""

import torch

from leviathan_pretrain.model.inputs import UniqueIdInput
from leviathan_pretrain.model.tp import normal_init, replicated_param
from leviathan_pretrain.model.variants import InputParams, Variant

WIDTH = 4


class ToyInput(UniqueIdInput):
    partial_over_tp = False  # replicated rows: nothing to sum over TP

    def __init__(self, config, model_cfg, tp_group=None):
        super().__init__(config, model_cfg.vocab_size, model_cfg.hidden_size, tp_group)
        self.table = replicated_param([model_cfg.vocab_size, WIDTH], normal_init(1.0), config.params_dtype)
        self.proj = replicated_param([WIDTH, model_cfg.hidden_size], normal_init(0.5), config.params_dtype)

    @classmethod
    def from_model(cls, config, model_cfg, padded_vocab_size: int, tp_group=None):
        return cls(config, model_cfg, tp_group)

    def compute_rows(self, ids: torch.Tensor, record: bool = False) -> torch.Tensor:
        return self.table[ids] @ self.proj


TOY = Variant(
    name="toy",
    layer="tests.toy_variant:ToyInput",
    params=lambda m, v_pad: InputParams(m.vocab_size * WIDTH + WIDTH * m.hidden_size),
    largest_tensor=lambda m, tp, v_pad: m.vocab_size * WIDTH,
    activation_bytes=lambda m, n, tp, e: float(n * WIDTH * e),
    forward_flops_per_id=lambda m: 2.0 * WIDTH * m.hidden_size,
    describe=lambda m: f"{m.vocab_size} x {WIDTH} table, {WIDTH} x {m.hidden_size} projection",
)
