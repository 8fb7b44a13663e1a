"""The LEV input layer (docs/lev.md), tensor-parallel over its heads.

For the unique token ids ``i`` of a micro-batch::

    z      = sum_j C[j, digit_j(i)]                                   C: [k, b, d_seed], replicated
    u_l    = clamp(sigmoid(s * LayerNorm_l(W_l z)), 0, 1)              W_l: [d_seed, d_seed], LN affine
    phi_l  = sum_q B_q(u_l) S_l[:, q, :]   (quadratic B-spline, kappa uniform knots, 3 non-zeros)
    M_l    = prod_d phi_l[d, :]            (log space)                 S_l: [d_seed, kappa, r]
    G(i)   = sum_l M_l @ W_out_l                                       W_out_l: [r, D]
             (model.lev.center: sum_l (M_l - 1) @ W_out_l, ours)

TP: ``z`` is computed on every rank and passed through ``copy_to_tensor_model_parallel_region`` (identity
forward, all-reduce of its gradient: the replicated codebooks receive the full gradient); each rank runs
``heads / tp`` heads (``proj``, ``ln_weight``, ``ln_bias``, ``spline_delta``, ``out_proj`` are sharded along
dim 0 and carry megatron-core's TP attributes) and the partial ``G`` is summed by
:class:`~.inputs.UniqueIdInput` (``reduce_from_tensor_model_parallel_region``, or a reduce-scatter along the
sequence with sequence parallelism).

The spline math runs in fp32 whatever the parameter dtype (a product over 128 coordinates in bf16 is
meaningless); the output is cast to the model's dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from leviathan_pretrain.model import sizes
from leviathan_pretrain.model.inputs import DigitCodebooks, UniqueIdInput
from leviathan_pretrain.model.settings import ModelConfigError, group_rank, group_size
from leviathan_pretrain.model.spline import spline_product
from leviathan_pretrain.model.tp import all_gather_dim0, const_init, copy_to_tp, normal_init, sharded_param

HEALTH_SAMPLE = 256  # unique ids kept from the last forward for lev_health()
MATCH_SAMPLE, MATCH_SEED = 1024, 1234  # the ids model.lev.out_init_std=match measures G's RMS on
EDGE = 0.01  # a spline coordinate u within EDGE of 0 or 1 counts as saturated


class LEVInput(UniqueIdInput):
    """LEV: ``G(i)`` from digit codebooks, per-head spline products and projections (see module doc).

    Parameters (this rank): ``codebooks.weight [k, b, d_seed]`` (replicated, ``lev_codebook`` attribute),
    ``proj [h/tp, d_seed, d_seed]``, ``ln_weight``/``ln_bias [h/tp, d_seed]``, ``spline_delta [h/tp,
    d_seed, kappa, r]``, ``out_proj [h/tp, r, D]``.

    The spline values are stored as their offset from 1: ``S = 1 + spline_delta`` (property ``splines``),
    ``spline_delta ~ N(0, 0.1^2)`` at init, i.e. the spec's ``S = 1 + N(0, 0.1^2)``. Same function and
    gradients, but bf16 storage (DeepSpeed casts the module) keeps ~2^-8 of 0.1 instead of 2^-8 of 1: with
    128 coordinates multiplied, rounding S itself to bf16 would perturb M by several percent.
    """

    @classmethod
    def from_model(cls, config, model_cfg, padded_vocab_size: int, tp_group=None):
        return cls(config, model_cfg, tp_group)

    def __init__(self, config, model_cfg, tp_group=None):
        super().__init__(config, model_cfg.vocab_size, model_cfg.hidden_size, tp_group)
        lev = self.lev = model_cfg.lev
        tp = group_size(tp_group)
        if lev.heads % tp:
            raise ModelConfigError(f"model.lev.heads={lev.heads} is not divisible by parallel.tensor_parallel={tp}")
        h, d, K, r, D = lev.heads, lev.seed_dim, lev.knots, lev.rank, model_cfg.hidden_size
        self.heads_local = h // tp
        self.head_offset = group_rank(tp_group) * self.heads_local
        dtype = config.params_dtype
        out_std = lev.init_std / math.sqrt(h) if lev.out_init_std in (None, "match") else lev.out_init_std
        self.codebooks = DigitCodebooks(model_cfg.vocab_size, lev, dtype)
        self.base = self.codebooks.base
        self.proj = sharded_param([h, d, d], 0, normal_init(lev.init_std), dtype, tp_group)
        self.ln_weight = sharded_param([h, d], 0, const_init(1.0), dtype, tp_group)
        self.ln_bias = sharded_param([h, d], 0, const_init(0.0), dtype, tp_group)
        self.spline_delta = sharded_param([h, d, K, r], 0, normal_init(lev.spline_init_std), dtype, tp_group)
        self.out_proj = sharded_param([h, r, D], 0, normal_init(out_std), dtype, tp_group)
        for p in (self.ln_weight, self.ln_bias, self.spline_delta):
            p.no_weight_decay = True  # LN affine and the spline values (not regularised by the spec)
        self._health = None
        if lev.out_init_std == "match":
            self.match_init_rms(config.init_method_std)

    def chunk_for(self, device) -> int:
        """Unique ids per chunk of the spline product on ``device`` (a ``torch.device`` or its type):
        :func:`~.sizes.lev_chunk_ids`, i.e. ``model.lev.token_chunk`` or the device's work-memory budget. Resolved
        where the work runs (a model built on the CPU and moved to a GPU, as evaluation does, gets the GPU's)."""
        kind = device.type if isinstance(device, torch.device) else str(device)
        return sizes.lev_chunk_ids(self.lev, self.heads_local, kind)

    # -- the function -----------------------------------------------------------------------------
    def spline_inputs(self, ids: torch.Tensor) -> torch.Tensor:
        """``u [n, h/tp, d_seed]`` in [0, 1] for this rank's heads (spec steps 1-3)."""
        lev = self.lev
        z = self.codebooks(ids).float()
        z = copy_to_tp(z, self.tp_group)
        y = torch.einsum("nd,hed->nhe", z, self.proj.float())
        y = F.layer_norm(y, (lev.seed_dim,), eps=lev.layernorm_eps)
        y = y * self.ln_weight.float() + self.ln_bias.float()
        return torch.sigmoid(lev.sigmoid_scale * y).clamp(0.0, 1.0)

    def head_values(self, ids: torch.Tensor, record: bool = False, recompute: bool | None = None) -> torch.Tensor:
        """``M [n, h/tp, r]`` for this rank's heads (``model.lev.center``: ``M - 1``, ours), fp32; ``record``
        keeps a sample of it and the spline inputs' saturation for :func:`lev_health`."""
        u = self.spline_inputs(ids)
        S = 1.0 + self.spline_delta.float()
        recompute = self.lev.recompute if recompute is None else recompute
        M = spline_product(u, S, self.lev.log_eps, self.chunk_for(u.device), recompute)
        if self.lev.center:
            M = M - 1.0  # each M_l's common value 1 removed
        if record:
            with torch.no_grad():
                edge = ((u < EDGE) | (u > 1 - EDGE)).float().mean(dim=(0, 2))
                self._health = {"m": M[:HEALTH_SAMPLE].detach().clone(), "edge": edge, "n": ids.numel()}
        return M

    def compute_rows(self, ids: torch.Tensor, record: bool = False) -> torch.Tensor:
        """This rank's partial ``G(ids)``: ``[n, D]`` in fp32 (summed over TP by the caller)."""
        M = self.head_values(ids, record)
        out = self.out_proj.float()
        return M.reshape(M.shape[0], -1) @ out.reshape(-1, out.shape[-1])

    @torch.no_grad()
    def match_init_rms(self, target: float) -> None:
        """``model.lev.out_init_std: match``: scale each head's ``W_out_l`` so that its contribution ``M_l @
        W_out_l`` has RMS ``target / sqrt(heads)`` over :data:`MATCH_SAMPLE` ids drawn with a fixed seed (the
        same on every TP rank), so that ``G``'s RMS is about ``target`` (the heads' draws are independent). Per
        head, hence the same at every TP size."""
        gen = torch.Generator().manual_seed(MATCH_SEED)
        n = min(MATCH_SAMPLE, self.vocab_size)
        ids = torch.randperm(self.vocab_size, generator=gen)[:n].to(self.out_proj.device)
        part = torch.einsum("nhr,hrd->nhd", self.head_values(ids, recompute=False), self.out_proj.float())
        rms = part.pow(2).mean(dim=(0, 2)).sqrt()  # [h/tp]
        scale = (target / math.sqrt(self.lev.heads)) / rms.clamp_min(1e-12)
        self.out_proj.mul_(scale.to(self.out_proj.dtype)[:, None, None])

    # -- introspection ----------------------------------------------------------------------------
    @property
    def splines(self) -> torch.Tensor:
        """The spec's ``S [h/tp, d_seed, kappa, r]`` (= 1 + spline_delta; differentiable)."""
        return 1.0 + self.spline_delta

    def full_parameters(self) -> dict:
        """The spec's tensors at full (all-heads) size: ``codebooks``, ``proj``, ``ln_weight``, ``ln_bias``,
        ``splines`` (S), ``out_proj``; gathers the TP shards (a collective when TP > 1)."""
        out = {"codebooks": self.codebooks.weight.detach()}
        for name in ("proj", "ln_weight", "ln_bias", "splines", "out_proj"):
            out[name] = all_gather_dim0(getattr(self, name).detach(), self.tp_group)
        return out


@torch.no_grad()
def lev_health(layer, gather: bool = False) -> dict:
    """LEV health statistics from the layer's last training forward (``{}`` before the first one).

    Keys: ``lev/unique_ids`` (unique ids in the last micro-batch), ``lev/unique_ratio`` (unique ids / tokens,
    for :func:`~leviathan_pretrain.model.accounting.model_flops_per_token`), ``lev/u_edge_frac`` (fraction of spline
    coordinates u within 0.01 of 0 or 1, all local heads), ``lev/head{l}/out_norm`` (RMS over up to 256 of
    those ids of ``||M_l @ W_out_l||``, head l's contribution to G) and ``lev/head{l}/u_edge_frac``; ``l`` is
    the global head index. Without ``gather`` only this TP rank's heads are reported; ``gather=True``
    all-gathers every head over the TP group (a collective: call it on every TP rank)."""
    if not isinstance(layer, LEVInput):
        layer = lev_layer(layer)  # accept the whole model (or a pipeline stage)
    if layer is None or layer._health is None:
        return {}
    hs = layer._health
    m, out = hs["m"], layer.out_proj.float()
    norms = torch.einsum("nhr,hrd->nhd", m, out).norm(dim=-1).pow(2).mean(0).sqrt()  # [h_local]
    edge = hs["edge"]
    first = layer.head_offset
    if gather and group_size(layer.tp_group) > 1:
        both = all_gather_dim0(torch.stack((norms, edge)).t(), layer.tp_group).t()  # [2, heads]
        norms, edge, first = both[0], both[1], 0
    stats = {
        "lev/unique_ids": float(hs["n"]),
        "lev/unique_ratio": float(layer.last_unique_ratio),
        "lev/u_edge_frac": float(edge.mean()),
    }
    for i in range(norms.numel()):
        stats[f"lev/head{first + i}/out_norm"] = float(norms[i])
        stats[f"lev/head{first + i}/u_edge_frac"] = float(edge[i])
    return stats


def lev_layer(module: torch.nn.Module) -> LEVInput | None:
    """The :class:`LEVInput` inside ``module`` (a model, a DeepSpeed engine's module or pipeline stage, or
    the layer itself); ``None`` when there is none (another variant, or a pipeline stage without it)."""
    return next((m for m in module.modules() if isinstance(m, LEVInput)), None)
