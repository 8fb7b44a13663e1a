"""LEV's spline core: the quadratic B-spline basis and the rank-r separable product (spec steps 4-6).

Shapes: ``u`` is ``[n, h, d]`` (n token ids, h heads on this rank, d = d_seed coordinates in [0, 1]),
``S`` is ``[h, d, kappa, r]``; the product ``M`` is ``[n, h, r]``::

    phi[n, h, d, :] = sum_q B_q(u[n, h, d]) * S[h, d, q, :]      (univariate splines)
    M[n, h, :]      = prod_d phi[n, h, d, :]                       (log space: sign * exp(sum log(|phi| + eps)))

Efficiency (the ``[n, h, d, r]`` intermediate is the memory hot spot):

- **3 non-zeros.** On kappa uniform knots a quadratic B-spline has at most 3 non-zero basis values, at the
  nearest knot ``c = round(u * (kappa - 1))`` and its two neighbours, so ``phi`` is 3 gathered rows of
  ``S`` (``index_select``) instead of a dense kappa contraction.
- **Chunks + recompute.** :class:`SplineProduct` walks the ids in chunks and keeps only ``u``, ``S`` and
  the small output ``M`` for backward; backward recomputes each chunk's ``phi``. Peak extra memory is a
  few ``[chunk, h, d, r]`` blocks whatever n is.

:func:`spline_product` picks the recomputing function or plain chunked autograd (``recompute=False``).
"""
from __future__ import annotations

import torch

__all__ = ["basis_weights", "dense_basis", "spline_product", "SplineProduct", "auto_chunk"]


def basis_weights(u: torch.Tensor, knots: int):
    """The 3 non-zero basis values of every coordinate, renormalised to sum to 1.

    Returns ``(c, w, parts)``: ``c`` (long, same shape as ``u``) is the nearest knot index; ``w`` is
    ``[..., 3]``, the weights of knots ``c - 1, c, c + 1`` (zero where that knot does not exist);
    ``parts`` = ``(f, a, z)`` (offset from the nearest knot, unnormalised weights, their sum) for backward.
    """
    x = u * (knots - 1)
    c = torch.round(x).clamp_(0, knots - 1)
    f = x - c                                     # in [-0.5, 0.5]
    c = c.long()
    a_m = 0.5 * (0.5 - f) ** 2 * (c >= 1)          # t = 1 + f in [0.5, 1.5]
    a_0 = 0.75 - f * f                            # t = |f| < 0.5
    a_p = 0.5 * (0.5 + f) ** 2 * (c <= knots - 2)  # t = 1 - f
    a = torch.stack((a_m, a_0, a_p), dim=-1)
    z = a.sum(-1, keepdim=True)                   # 1 in the interior; < 1 next to the end knots
    return c, a / z, (f, a, z)


def dense_basis(u: torch.Tensor, knots: int) -> torch.Tensor:
    """The full ``[..., kappa]`` basis matrix (3 non-zeros per row); for tests, health checks and plots."""
    c, w, _ = basis_weights(u, knots)
    out = torch.zeros(*u.shape, knots + 2, dtype=w.dtype, device=u.device)
    idx = torch.stack((c, c + 1, c + 2), dim=-1)  # shifted by one so c - 1 = -1 lands in a spare column
    out.scatter_(-1, idx, w)
    return out[..., 1:-1]


def auto_chunk(heads: int, seed_dim: int, rank: int, chunk_elements: int) -> int:
    """Token ids per chunk so one ``[chunk, heads, seed_dim, rank]`` block holds <= chunk_elements."""
    return max(1, chunk_elements // max(1, heads * seed_dim * rank))


def _gather_rows(S_flat: torch.Tensor, row0: torch.Tensor, c: torch.Tensor, shift: int, knots: int, out=None):
    """``S[h, d, clamp(c + shift), :]`` for every ``[n, h, d]`` -> ``[n, h, d, r]``."""
    idx = (row0 + (c + shift).clamp_(0, knots - 1)).reshape(-1)
    r = S_flat.shape[-1]
    if out is None:
        return torch.index_select(S_flat, 0, idx).view(*c.shape, r), idx
    torch.index_select(S_flat, 0, idx, out=out.view(-1, r))
    return out, idx


def _phi(u, S, row0):
    knots = S.shape[2]
    S_flat = S.reshape(-1, S.shape[-1])
    c, w, parts = basis_weights(u, knots)
    phi, _ = _gather_rows(S_flat, row0, c, 0, knots)
    phi = phi * w[..., 1, None]
    tmp = torch.empty_like(phi)
    for k, shift in ((0, -1), (2, 1)):
        _gather_rows(S_flat, row0, c, shift, knots, out=tmp)
        phi.addcmul_(tmp, w[..., k, None])
    return phi, c, w, parts


def _log_product(phi: torch.Tensor, eps: float) -> torch.Tensor:
    """sign(prod phi) * exp(sum log(|phi| + eps)) over dim 2 (the seed coordinates)."""
    negative = (phi < 0).sum(2)
    zero = (phi == 0).any(2)
    sign = (1 - 2 * (negative % 2)).to(phi.dtype).masked_fill_(zero, 0.0)
    return sign * torch.log(phi.abs() + eps).sum(2).exp()


def _row0(h: int, d: int, knots: int, device) -> torch.Tensor:
    """Flat row of ``S[h, d, 0]`` in ``S.reshape(h * d * kappa, r)``, shape [1, h, d]."""
    return (torch.arange(h * d, device=device).view(1, h, d) * knots)


class SplineProduct(torch.autograd.Function):
    """``M = prod_d (B(u) . S)`` chunked over ids, recomputing each chunk's ``phi`` in backward.

    Saves only ``u``, ``S`` and ``M``; gradients are exact (the same formulas autograd would use on the
    readable form: d log(|phi| + eps) / d phi = sign(phi) / (|phi| + eps), and the basis derivative through
    the renormalised quadratic pieces)."""

    @staticmethod
    def forward(ctx, u, S, eps: float, chunk: int):
        n, h, d = u.shape
        row0 = _row0(h, d, S.shape[2], u.device)
        out = u.new_empty(n, h, S.shape[-1])
        with torch.no_grad():
            for s in range(0, n, chunk):
                phi, *_ = _phi(u[s:s + chunk], S, row0)
                out[s:s + chunk] = _log_product(phi, eps)
                del phi
        ctx.save_for_backward(u, S, out)
        ctx.eps, ctx.chunk = eps, chunk
        return out

    @staticmethod
    def backward(ctx, grad_m):
        u, S, M = ctx.saved_tensors
        eps, chunk = ctx.eps, ctx.chunk
        n, h, d = u.shape
        knots, r = S.shape[2], S.shape[3]
        row0 = _row0(h, d, knots, u.device)
        S_flat = S.reshape(-1, r)
        grad_u = torch.empty_like(u) if ctx.needs_input_grad[0] else None
        grad_S = torch.zeros_like(S_flat) if ctx.needs_input_grad[1] else None
        grad_l = grad_m * M                              # d M / d (sum log) = M
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            uc = u[s:e]
            c, w, (f, a, z) = basis_weights(uc, knots)
            rows = [_gather_rows(S_flat, row0, c, shift, knots) for shift in (-1, 0, 1)]
            phi = rows[1][0] * w[..., 1, None]
            phi.addcmul_(rows[0][0], w[..., 0, None]).addcmul_(rows[2][0], w[..., 2, None])
            g_phi = torch.sign(phi).div_(phi.abs_().add_(eps)).mul_(grad_l[s:e, :, None, :])
            del phi
            if grad_S is not None:
                for k in range(3):
                    grad_S.index_add_(0, rows[k][1], (g_phi * w[..., k, None]).view(-1, r))
            if grad_u is not None:
                g_w = torch.stack([(g_phi * rows[k][0]).sum(-1) for k in range(3)], dim=-1)   # [nc, h, d, 3]
                # a_m' = -(0.5 - f)[c >= 1], a_0' = -2f, a_p' = (0.5 + f)[c <= K - 2]  (d/df)
                da = torch.stack((-(0.5 - f) * (a[..., 0] > 0), -2 * f, (0.5 + f) * (a[..., 2] > 0)), dim=-1)
                z = z.squeeze(-1)
                g_f = (g_w * da).sum(-1) / z - (g_w * w).sum(-1) * da.sum(-1) / z
                grad_u[s:e] = g_f * (knots - 1)
            del g_phi, rows
        if grad_S is not None:
            grad_S = grad_S.view_as(S)
        return grad_u, grad_S, None, None


def _spline_product_autograd(u, S, eps: float, chunk: int):
    """The same computation traced by autograd chunk by chunk (stores every chunk's ``phi``)."""
    row0 = _row0(u.shape[1], u.shape[2], S.shape[2], u.device)
    outs = []
    for s in range(0, u.shape[0], chunk):
        uc = u[s:s + chunk]
        knots = S.shape[2]
        S_flat = S.reshape(-1, S.shape[-1])
        c, w, _ = basis_weights(uc, knots)
        phi = sum(_gather_rows(S_flat, row0, c, shift, knots)[0] * w[..., k, None]
                  for k, shift in enumerate((-1, 0, 1)))
        sign = torch.sign(phi).prod(2)
        outs.append(sign * torch.log(phi.abs() + eps).sum(2).exp())
    return torch.cat(outs) if len(outs) != 1 else outs[0]


def spline_product(u: torch.Tensor, S: torch.Tensor, eps: float, chunk: int, recompute: bool = True):
    """``M[n, h, r]`` from ``u[n, h, d]`` in [0, 1] and spline values ``S[h, d, kappa, r]`` (fp32 math)."""
    if u.shape[0] == 0:
        return u.new_zeros(0, u.shape[1], S.shape[-1])
    if recompute:
        return SplineProduct.apply(u, S, eps, chunk)
    return _spline_product_autograd(u, S, eps, chunk)
