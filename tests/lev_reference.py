"""A plain, readable LEV (docs/lev.md, steps 1-7), token by token, dense everywhere.

The efficient layer (:mod:`leviathan_pretrain.model.lev`) must match this to 1e-5; the tests and
``benchmarks/bench_lev.py`` both import it. No chunking, no unique ids, no 3-non-zero tricks.
"""

import torch
import torch.nn.functional as F


def quadratic_bspline_basis(u: torch.Tensor, knots: int) -> torch.Tensor:
    """Spec step 4: ``B_q(u)`` on kappa uniform knots g_q = q / (kappa - 1), renormalised; ``[..., kappa]``."""
    g = torch.arange(knots, dtype=u.dtype, device=u.device) / (knots - 1)
    t = (u[..., None] - g).abs() * (knots - 1)
    beta = torch.where(t < 0.5, 0.75 - t**2, torch.where(t < 1.5, 0.5 * (1.5 - t) ** 2, torch.zeros_like(t)))
    return beta / beta.sum(-1, keepdim=True)


def lev_reference(
    ids, C, W_in, ln_weight, ln_bias, S, W_out, *, base, sigmoid_scale=0.5, ln_eps=1e-5, log_eps=1e-9, center=False
):
    """G(ids) for the full set of heads: ``ids [N]`` -> ``[N, D]`` (``center``: ``model.lev.center``, ours: each
    head's ``M - 1`` is projected instead of ``M``).

    C [k, b, d_seed]; W_in [h, d_seed, d_seed] (u_l = sigmoid(s * LN_l(W_in[h] @ z))); ln_weight/ln_bias
    [h, d_seed]; S [h, d_seed, kappa, r]; W_out [h, r, D]."""
    k = C.shape[0]
    heads, d_seed, knots, _ = S.shape
    # 1-2. base-b digits, most significant first; z = sum of the digit codebook rows
    z = sum(C[j, (ids // base ** (k - 1 - j)) % base] for j in range(k))
    G = 0
    for h in range(heads):
        # 3. per-head projection, LayerNorm, squash to [0, 1]
        y = z @ W_in[h].T
        u = torch.sigmoid(sigmoid_scale * F.layer_norm(y, (d_seed,), ln_weight[h], ln_bias[h], ln_eps)).clamp(0, 1)
        # 4-5. univariate splines phi[n, d, rho] = sum_q B_q(u[n, d]) S[h, d, q, rho]
        B = quadratic_bspline_basis(u, knots)
        phi = torch.einsum("ndq,dqr->ndr", B, S[h])
        # 6. rank-r separable product over the seed dimensions, in log space
        sign = torch.sign(phi).prod(dim=1)
        M = sign * torch.exp(torch.log(phi.abs() + log_eps).sum(dim=1))
        # 7. project and sum heads
        G = G + ((M - 1) if center else M) @ W_out[h]
    return G


def lev_reference_from_layer(layer, ids):
    """Run the reference on an unsharded (TP = 1) :class:`LEVInput`'s own parameters (differentiable)."""
    cfg = layer.lev
    return lev_reference(
        ids,
        layer.codebooks.weight,
        layer.proj,
        layer.ln_weight,
        layer.ln_bias,
        layer.splines,
        layer.out_proj,
        base=layer.base,
        sigmoid_scale=cfg.sigmoid_scale,
        ln_eps=cfg.layernorm_eps,
        log_eps=cfg.log_eps,
        center=cfg.center,
    )
