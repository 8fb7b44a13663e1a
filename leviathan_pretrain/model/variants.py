"""The input-variant registry: everything that differs between LEV and the baselines, one entry each.

Torch-free (the config, ``params`` and the SLURM planner read it without importing torch). A :class:`Variant`
names its layer class by import path (the way megatron-core's ``ModuleSpec`` names a module) and holds the
closed forms the rest of the code needs: the input layer's parameters (split into replicated and TP-sharded
parts, so one formula gives both the whole-model count and one rank's share), its largest tensor, the bytes it
saves for backward, its forward FLOPs per unique id, the widths tensor parallelism must divide, a one-line
description of its shape, and whether the output head is its table (TIED).

Adding a variant: write its layer (a ``torch.nn.Module`` with ``from_model(config, model_cfg, padded_vocab_size,
tp_group)`` returning ``forward(input_ids [b, s], position_ids=None) -> [s, b, D]``; model/inputs.py has the
helpers) and :func:`register` one entry here. ``tests/test_model.py`` adds a toy variant
(``tests/toy_variant.py``) that way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from common.entry_points import resolve
from leviathan_pretrain.model import sizes


@dataclass(frozen=True)
class InputParams:
    """An input layer's parameters: ``replicated`` on every TP rank, and ``sharded`` tensors split over TP (each
    divided on its own, as the layers allocate them). Tables count their padded rows."""

    replicated: int
    sharded: tuple[int, ...] = ()

    @property
    def total(self) -> int:
        return self.replicated + sum(self.sharded)

    def per_rank(self, tp: int) -> int:
        return self.replicated + sum(s // tp for s in self.sharded)


@dataclass(frozen=True)
class Variant:
    """One input representation. Every callable takes the ``model`` config section first; ``v_pad`` is the padded
    vocabulary (:func:`~leviathan_pretrain.model.sizes.padded_vocab_size`), ``n`` the unique ids (or tokens) of a
    micro-batch, ``e`` the bytes of an element of the model dtype."""

    name: str
    layer: str  # "package.module:Class"
    params: Callable[..., InputParams]  # (model, v_pad)
    largest_tensor: Callable[..., int]  # (model, tp, v_pad): elements of its largest tensor on one TP rank
    activation_bytes: Callable[..., float]  # (model, n, tp, e): saved for backward, one micro-batch
    forward_flops_per_id: Callable[..., float]  # (model): 0 for a table lookup
    describe: Callable[..., str]  # (model): its sizes in one phrase
    tp_widths: Callable[..., dict] = lambda m: {}  # (model): {config key: width TP must divide}
    tied_head: bool = False  # the output head is the input table
    digits: bool = False  # indexes ids by base-b digits (model.lev.base / digits must cover the vocabulary)


REGISTRY: dict[str, Variant] = {}


def register(variant: Variant) -> Variant:
    REGISTRY[variant.name] = variant
    return variant


def get(name: str) -> Variant:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"model.variant: unknown variant {name!r}; choose one of {', '.join(REGISTRY)}") from None


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def layer_class(variant: Variant):
    """The layer class named by ``variant.layer`` (imported here: this module stays torch-free until then)."""
    return resolve(variant.layer)


def _codebooks(m) -> int:
    return sizes.lev_codebook_params(m.vocab_size, m.lev)


# ---------------------------------------------------------------- the paper's variants


def _table(name: str, tied: bool) -> Variant:
    return Variant(
        name=name,
        layer="leviathan_pretrain.model.inputs:TableInput",
        params=lambda m, v_pad: InputParams(0, (v_pad * m.hidden_size,)),
        largest_tensor=lambda m, tp, v_pad: v_pad * m.hidden_size // tp,
        activation_bytes=lambda m, n, tp, e: 0.0,  # the output is the first layer's input (counted there)
        forward_flops_per_id=lambda m: 0.0,
        describe=lambda m: f"{m.vocab_size} x {m.hidden_size} table",
        tied_head=tied,
    )


LEV = register(
    Variant(
        name="lev",
        layer="leviathan_pretrain.model.lev:LEVInput",
        # spec: k*b*d_seed (codebooks, replicated) + h*(d_seed^2 + 2*d_seed + d_seed*kappa*r + r*D) (heads, sharded)
        params=lambda m, v_pad: InputParams(_codebooks(m), (sizes.lev_head_params(m.hidden_size, m.lev),)),
        # no table: S (spline values) or W_out
        largest_tensor=lambda m, tp, v_pad: (
            m.lev.heads * m.lev.rank * max(m.lev.seed_dim * m.lev.knots, m.hidden_size) // tp
        ),
        activation_bytes=lambda m, n, tp, e: 4.0 * n * m.lev.heads / tp * (4 * m.lev.seed_dim + m.lev.rank),
        # 2*h*d^2 (W_l) + 7*h*d*r (the spline product) + 2*h*r*D (W_out); model/flops.py's doc
        forward_flops_per_id=lambda m: (
            2 * m.lev.heads * m.lev.seed_dim * m.lev.seed_dim
            + 7 * m.lev.heads * m.lev.seed_dim * m.lev.rank
            + 2 * m.lev.heads * m.lev.rank * m.hidden_size
        ),
        describe=lambda m: (
            f"d_seed {m.lev.seed_dim}, h {m.lev.heads}, K {m.lev.knots}, r {m.lev.rank}, {m.lev.digits} digits"
            + (", centred" if m.lev.center else "")
            + (f", W_out init {m.lev.out_init_std}" if m.lev.out_init_std is not None else "")
        ),
        tp_widths=lambda m: {"lev.heads": m.lev.heads},
        digits=True,
    )
)
TIED = register(_table("tied", tied=True))
UNTIED = register(_table("untied", tied=False))


def _albert_params(m, v_pad: int) -> InputParams:
    e = sizes.albert_dim(m)
    return InputParams(e * m.hidden_size, (v_pad * e,))


ALBERT = register(
    Variant(
        name="albert",
        layer="leviathan_pretrain.model.inputs:AlbertInput",
        params=_albert_params,
        largest_tensor=lambda m, tp, v_pad: v_pad * sizes.albert_dim(m) // tp,
        activation_bytes=lambda m, n, tp, e: float(n * sizes.albert_dim(m) * e),
        forward_flops_per_id=lambda m: 2 * sizes.albert_dim(m) * m.hidden_size,
        describe=lambda m: f"e {sizes.albert_dim(m)}",
    )
)


def _flat_params(m, v_pad: int) -> InputParams:
    e, hid = sizes.flat_mlp_dims(m)
    return InputParams(0, (v_pad * e, e * hid + hid * m.hidden_size))


def _flat_flops(m) -> float:
    e, hid = sizes.flat_mlp_dims(m)
    return 2 * (e * hid + hid * m.hidden_size)


def _flat_activations(m, n: int, tp: int, e: int) -> float:
    width, hid = sizes.flat_mlp_dims(m)
    return 4.0 * n * (width + 2 * hid / tp)  # the rows (fc1's input), fc1's output and GELU's


FLAT_MLP = register(
    Variant(
        name="flat_mlp",
        layer="leviathan_pretrain.model.inputs:FlatMLPInput",
        params=_flat_params,
        largest_tensor=lambda m, tp, v_pad: v_pad * sizes.flat_mlp_dims(m)[0] // tp,
        activation_bytes=_flat_activations,
        forward_flops_per_id=_flat_flops,
        describe=lambda m: "e {}, m {}".format(*sizes.flat_mlp_dims(m)),
        tp_widths=lambda m: {"mlp_hidden": sizes.flat_mlp_dims(m)[1]},
    )
)


def _factored_params(m, v_pad: int) -> InputParams:
    d, hid = m.lev.seed_dim, sizes.factored_mlp_hidden(m)
    return InputParams(_codebooks(m) + 2 * d, (d * hid + hid * m.hidden_size,))


FACTORED_MLP = register(
    Variant(
        name="factored_mlp",
        layer="leviathan_pretrain.model.inputs:FactoredMLPInput",
        params=_factored_params,
        largest_tensor=lambda m, tp, v_pad: sizes.factored_mlp_hidden(m) * max(m.lev.seed_dim, m.hidden_size) // tp,
        activation_bytes=lambda m, n, tp, e: 4.0 * n * (3 * m.lev.seed_dim + 2 * sizes.factored_mlp_hidden(m) / tp),
        forward_flops_per_id=lambda m: 2 * sizes.factored_mlp_hidden(m) * (m.lev.seed_dim + m.hidden_size),
        describe=lambda m: f"d_seed {m.lev.seed_dim}, m {sizes.factored_mlp_hidden(m)}",
        tp_widths=lambda m: {"mlp_hidden": sizes.factored_mlp_hidden(m)},
        digits=True,
    )
)
