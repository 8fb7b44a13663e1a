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
meaningless), by ``model.lev.kernel`` (:meth:`LEVInput.kernel_for`: the chunked torch path of model/spline.py or
the Triton kernels of model/spline_triton.py); the output GEMM ``M @ W_out`` runs in fp32 or in the model's dtype
(``model.lev.gemm_dtype``, :meth:`LEVInput.gemm_dtype_for`), and the rows are cast to the model's dtype.
"""

from __future__ import annotations

import math
import os
import warnings

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
PROBE_IDS = 2  # ids of the first micro-batch the Triton kernels are tried on under model.lev.kernel=auto
_TRITON: dict = {}  # "module" / "error": the import of model/spline_triton.py, tried once per process
_FALLBACK: dict = {}  # device type -> None (auto's Triton probe passed there) or the exception it raised


def _device_type(device) -> str:
    """``cuda`` / ``cpu`` of a ``torch.device`` or of its type given as a string."""
    return device.type if isinstance(device, torch.device) else str(device)


def triton_kernels():
    """``(module, None)``: model/spline_triton.py imported (its kernels are defined then, under the
    ``TRITON_INTERPRET`` of that moment); ``(None, error)`` when it does not import (no triton). Tried once."""
    if not _TRITON:
        try:
            from leviathan_pretrain.model import spline_triton

            _TRITON["module"], _TRITON["error"] = spline_triton, None
        except Exception as e:  # ImportError, or a triton that fails while importing
            _TRITON["module"], _TRITON["error"] = None, e
    return _TRITON["module"], _TRITON["error"]


def check_kernel(lev, cpu_build: bool) -> None:
    """Refuse ``model.lev.kernel=triton`` at model build (``ModelConfigError`` naming the key and the fix) when
    triton does not import, or when the layer would run on the CPU (``cpu_build``) without Triton's interpreter."""
    if lev.kernel != "triton":
        return
    mod, err = triton_kernels()
    if mod is None:
        raise ModelConfigError(
            f"model.lev.kernel=triton: triton does not import ({type(err).__name__}: {err}); install triton or set "
            "model.lev.kernel=torch (or auto)"
        )
    if cpu_build and not mod.interpreted():
        interp = os.environ.get("TRITON_INTERPRET")
        raise ModelConfigError(
            f"model.lev.kernel=triton on the CPU needs Triton's interpreter (TRITON_INTERPRET={interp!r} when "
            "model/spline_triton.py was imported): run on a GPU, set TRITON_INTERPRET=1 before leviathan_pretrain "
            "is imported, or set model.lev.kernel=torch (or auto)"
        )


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
        if lev.kernel == "triton":  # a CPU build: initialised on the CPU with no GPU to move to
            check_kernel(lev, cpu_build=config.use_cpu_initialization and not torch.cuda.is_available())
        if lev.out_init_std == "match":
            self.match_init_rms(config.init_method_std)

    def chunk_for(self, device) -> int:
        """Unique ids per chunk of the spline product on ``device`` (a ``torch.device`` or its type):
        :func:`~.sizes.lev_chunk_ids`, i.e. ``model.lev.token_chunk`` or the device's work-memory budget. Resolved
        where the work runs (a model built on the CPU and moved to a GPU, as evaluation does, gets the GPU's)."""
        kind = _device_type(device)
        return sizes.lev_chunk_ids(self.lev, self.heads_local, kind)

    def kernel_for(self, device) -> str:
        """``torch`` or ``triton``: the spline product's implementation on ``device`` (``model.lev.kernel``;
        ``auto`` is triton on CUDA when it imports and has not failed there, torch elsewhere)."""
        kind = _device_type(device)
        if self.lev.kernel != "auto":
            return self.lev.kernel
        failed = _FALLBACK.get(kind) is not None
        usable = kind == "cuda" and not failed and triton_kernels()[0] is not None
        return "triton" if usable else "torch"

    def gemm_dtype_for(self, device) -> torch.dtype:
        """The dtype of the output GEMM ``M @ W_out`` on ``device`` (``model.lev.gemm_dtype``; ``auto``: the
        model's dtype on CUDA, fp32 elsewhere). The model's dtype is ``params_dtype`` (bf16 in a bf16 run)."""
        kind = _device_type(device)
        want = self.lev.gemm_dtype
        if want == "auto":
            want = "model" if kind == "cuda" else "fp32"
        return self.config.params_dtype if want == "model" else torch.float32

    def spline(self, u: torch.Tensor, S: torch.Tensor, recompute: bool) -> torch.Tensor:
        """``M [n, h/tp, r]`` by the implementation :meth:`kernel_for` picks (``recompute=False``: plain chunked
        autograd, torch). Under ``auto`` the Triton kernels are first tried (forward + backward) on
        :data:`PROBE_IDS` ids: if that raises (e.g. a compile failure on this GPU), one warning names the error
        and the device falls back to the torch path for the rest of the process. Explicit ``triton`` raises."""
        eps = self.lev.log_eps
        if recompute and u.shape[0] and self.kernel_for(u.device) == "triton":
            mod = triton_kernels()[0]
            kind = u.device.type
            if self.lev.kernel == "auto" and kind not in _FALLBACK:
                try:
                    with torch.enable_grad():
                        a, b = u[:PROBE_IDS].detach().requires_grad_(), S.detach().requires_grad_()
                        mod.spline_product_triton(a, b, eps).sum().backward()
                    _FALLBACK[kind] = None  # worked: not tried again
                except Exception as e:
                    _FALLBACK[kind] = e
                    warnings.warn(
                        f"LEV's Triton spline kernel failed on {kind} ({type(e).__name__}: {e}); falling back to "
                        "the torch path (set model.lev.kernel=torch to silence this, or fix triton)",
                        RuntimeWarning,
                        stacklevel=2,
                    )
            if _FALLBACK.get(kind) is None or self.lev.kernel == "triton":
                return mod.spline_product_triton(u, S, eps)
        return spline_product(u, S, eps, self.chunk_for(u.device), recompute)

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
        M = self.spline(u, S, recompute)
        if self.lev.center:
            M = M - 1.0  # each M_l's common value 1 removed
        if record:
            with torch.no_grad():
                edge_rows = ((u < EDGE) | (u > 1 - EDGE)).float().mean(dim=2)  # [n, h/tp]
                self._health = {
                    "m": M[:HEALTH_SAMPLE].detach().clone(),
                    "edge": edge_rows.mean(dim=0),
                    "edge_rows": edge_rows,
                    "n": ids.numel(),
                }
        return M

    def trim_record(self, count: int) -> None:
        """The last ``record`` was over padded ids (the host's unique ids, ``UniqueIds``): keep the ``count`` true
        ones in :func:`lev_health`'s figures (ids, the row sample, the spline inputs' saturation)."""
        hs = self._health
        if hs is not None and count < hs["n"]:
            hs["n"], hs["m"] = count, hs["m"][:count]
            hs["edge"] = hs["edge_rows"][:count].mean(dim=0)

    def compute_rows(self, ids: torch.Tensor, record: bool = False) -> torch.Tensor:
        """This rank's partial ``G(ids)``: ``[n, D]`` (summed over TP by the caller), in the dtype of the output
        GEMM (:meth:`gemm_dtype_for`: fp32, or the model's dtype with the GEMM's fp32 accumulation)."""
        M = self.head_values(ids, record)
        dtype = self.gemm_dtype_for(M.device)
        out = self.out_proj.to(dtype)
        return M.reshape(M.shape[0], -1).to(dtype) @ out.reshape(-1, out.shape[-1])

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
    for :func:`~leviathan_pretrain.model.flops.model_flops_per_token`), ``lev/u_edge_frac`` (fraction of spline
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
