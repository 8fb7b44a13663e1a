"""LEV's spline product as two Triton kernels (``model.lev.kernel: triton``; the math of model/spline.py).

Shapes as in :mod:`~.spline`: ``u [n, h, d]`` fp32 in [0, 1], ``S [h, d, kappa, r]`` fp32, ``M [n, h, r]`` fp32::

    phi[n, h, d, :] = sum_q B_q(u[n, h, d]) * S[h, d, q, :]     (3 non-zero B_q: knots c - 1, c, c + 1)
    M[n, h, :]      = prod_d sign(phi) * exp(sum_d log(|phi| + eps))

- **Forward** (:func:`_forward_kernel`), one program per (block of ``BLOCK_N`` ids, head, block of ``BLOCK_R``
  ranks): a loop over the d coordinates; per coordinate the nearest knot ``c = round(u (kappa - 1))`` (round half
  to even, as ``torch.round``), the 3 renormalised weights (:func:`~.spline.basis_weights`' formulas, end knots
  included), the 3 rows ``S[h, d, c-1..c+1, r-block]`` gathered (weight 0, nothing loaded, where a knot does not
  exist) and ``phi`` as their weighted sum; ``sum log(|phi| + eps)``, the count of negative ``phi`` and a
  ``phi == 0`` flag stay in registers. Only ``M`` is written: nothing of size ``[n, h, d, r]`` exists.
- **Backward** (:func:`_backward_kernel`) recomputes. ``grad_l = grad_M * M`` (``[n, h, r]``, in torch), then one
  program per ((head, coordinate) pair, block of ranks) walks ALL ids in blocks: it recomputes ``phi`` for its
  pair, ``G = grad_l * sign(phi) / (|phi| + eps)`` (``[BLOCK_N, BLOCK_R]``), accumulates ``dS[h, d] += B^T G``
  with ``tl.dot`` (the ``[BLOCK_N, kappa]`` basis block from ``c`` and the 3 weights; kappa padded to >= 16,
  ``input_precision="ieee"``: fp32, no TF32) and writes each id's ``d L / d u[n, h, d]`` from ``g_w_k = sum_r G
  S[h, d, c+k-1, :]`` and the derivative of the renormalised weights (:class:`~.spline.SplineProduct`'s
  formulas). With several rank blocks (r > ``BLOCK_R``) each writes its partial ``d L / d u`` to its own slice and
  torch sums the slices. Every output element is written by exactly one program, in a fixed order: no atomics,
  bitwise reproducible.

Memory: the forward saves ``u``, ``S`` and ``M`` (as :class:`~.spline.SplineProduct`); the backward allocates
``grad_l``, ``dS`` and ``grad_u`` (times the rank blocks) and no chunk work buffers.

Cost per id at the spec's shape (h 8, d 128, kappa 16, r 64), estimated, not measured on a GPU: the forward
gathers 3 rows of ``S`` (768 B, from L1/L2: ``S`` is 4 MiB) per (head, coordinate), 0.8 MB per id, and takes
``h d r`` = 65k logs; the backward the same gathers plus ``grad_l``'s 256 B per (head, coordinate) and
``kappa r`` fp32 FMAs for ``dS`` (1M per id). DRAM traffic is only ``u``, ``M``, ``grad_l`` and ``grad_u``
(~12 KB per id). For a 400M micro-batch (4.3k unique ids) on an H200 that is ~3.4 GB of L2 gathers each way:
~0.4 ms at an assumed ~8 TB/s of L2 bandwidth; counting latency instead (128 dependent gather steps per forward
program, ~1,100 programs in about one wave; 135 steps per backward program, 1,024 programs in ~3 waves at ~150
registers a thread) gives ~0.2-0.5 ms forward and ~0.5-1 ms backward, against the torch path's ~14 ms for the
whole layer (``benchmarks/profile_lev_gpu.py`` section (1b) measures it).

Defined with ``TRITON_INTERPRET`` as it is when this module is first imported: ``1`` runs the kernels on the CPU
under Triton's interpreter (tests), slowly. Uses only Triton APIs present in 3.6 and 3.9.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from leviathan_pretrain.model.settings import ModelConfigError

__all__ = ["TritonSplineProduct", "spline_product_triton", "interpreted", "Blocks", "BLOCKS"]


class Blocks:
    """Tile sizes (powers of 2): ``fwd_n`` ids x ``fwd_r`` ranks per forward program, ``bwd_n`` ids (>= 16, a
    ``tl.dot`` side) x ``bwd_r`` ranks per backward step; ``warps`` per program. Defaults chosen for the spec's
    shape (r 64: one rank block; a ``[32, 64]`` fp32 tile is 16 registers a thread at 4 warps), not tuned on a GPU."""

    def __init__(self, fwd_n: int = 32, fwd_r: int = 64, bwd_n: int = 32, bwd_r: int = 128, warps: int = 4):
        self.fwd_n, self.fwd_r, self.bwd_n, self.bwd_r, self.warps = fwd_n, fwd_r, bwd_n, bwd_r, warps


BLOCKS = Blocks()


@triton.jit
def _basis(u, K: tl.constexpr):
    """Nearest knot ``c`` (float), offset ``f``, the 3 renormalised weights and the parts backward needs."""
    x = u * (K - 1)
    fl = tl.floor(x)
    frac = x - fl
    odd = (fl - 2.0 * tl.floor(fl * 0.5)) == 1.0
    c = tl.where((frac > 0.5) | ((frac == 0.5) & odd), fl + 1.0, fl)  # round half to even (torch.round)
    c = tl.minimum(tl.maximum(c, 0.0), K - 1.0)
    f = x - c
    a_m = tl.where(c < 1.0, 0.0, (0.5 - f) * (0.5 - f) * 0.5)  # no knot c - 1 at c = 0
    a_0 = 0.75 - f * f
    a_p = tl.where(c > K - 2.0, 0.0, (0.5 + f) * (0.5 + f) * 0.5)  # no knot c + 1 at c = kappa - 1
    iz = 1.0 / (a_m + a_0 + a_p)
    return c, f, a_m, a_0, a_p, iz


@triton.jit
def _phi(s_ptr, pair, c, w0, w1, w2, cols, m2, K: tl.constexpr, R: tl.constexpr):
    """``phi [BLOCK_N, BLOCK_R]`` of one (head, coordinate) pair and the 3 gathered rows of ``S``."""
    ci = c.to(tl.int32)
    row = s_ptr + (pair * K + ci) * R  # [BLOCK_N]: row c of S[h, d]
    ptr = row[:, None] + cols[None, :]
    s0 = tl.load(ptr - R, mask=m2 & (ci >= 1)[:, None], other=0.0)
    s1 = tl.load(ptr, mask=m2, other=0.0)
    s2 = tl.load(ptr + R, mask=m2 & (ci <= K - 2)[:, None], other=0.0)
    phi = w0[:, None] * s0 + w1[:, None] * s1 + w2[:, None] * s2
    return phi, s0, s1, s2


@triton.jit(do_not_specialize=["n"])
def _forward_kernel(
    u_ptr,
    s_ptr,
    m_ptr,
    n,
    H,
    D,
    su_n,
    su_h,
    su_d,
    eps,
    K: tl.constexpr,
    R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    hh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n
    m2 = rmask[:, None] & (cols < R)[None, :]
    logsum = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.float32)
    negs = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.int32)
    zero = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.int32)
    u_row = u_ptr + rows.to(tl.int64) * su_n + hh * su_h
    for dd in range(0, D):
        u = tl.load(u_row + dd * su_d, mask=rmask, other=0.5)
        c, f, a_m, a_0, a_p, iz = _basis(u, K)
        phi, s0, s1, s2 = _phi(s_ptr, hh * D + dd, c, a_m * iz, a_0 * iz, a_p * iz, cols, m2, K, R)
        logsum += tl.log(tl.abs(phi) + eps)
        negs += (phi < 0.0).to(tl.int32)
        zero = tl.maximum(zero, (phi == 0.0).to(tl.int32))
    sign = tl.where(zero > 0, 0.0, tl.where((negs % 2) == 1, -1.0, 1.0))
    out = m_ptr + (rows.to(tl.int64) * H + hh)[:, None] * R + cols[None, :]
    tl.store(out, sign * tl.exp(logsum), mask=m2)


@triton.jit(do_not_specialize=["n"])
def _backward_kernel(
    u_ptr,
    s_ptr,
    gl_ptr,
    ds_ptr,
    gf_ptr,
    n,
    H,
    D,
    su_n,
    su_h,
    su_d,
    eps,
    K: tl.constexpr,
    KP: tl.constexpr,
    R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    WANT_DS: tl.constexpr,
    WANT_DU: tl.constexpr,
):
    pair = tl.program_id(0)  # head * D + coordinate
    pid_r = tl.program_id(1)
    hh = pair // D
    dd = pair % D
    cols = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cmask = cols < R
    ks = tl.arange(0, KP)
    acc = tl.zeros([KP, BLOCK_R], dtype=tl.float32)
    for start in range(0, n, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        rmask = rows < n
        m2 = rmask[:, None] & cmask[None, :]
        r64 = rows.to(tl.int64)
        u = tl.load(u_ptr + r64 * su_n + hh * su_h + dd * su_d, mask=rmask, other=0.5)
        c, f, a_m, a_0, a_p, iz = _basis(u, K)
        w0 = tl.where(rmask, a_m * iz, 0.0)
        w1 = tl.where(rmask, a_0 * iz, 0.0)
        w2 = tl.where(rmask, a_p * iz, 0.0)
        phi, s0, s1, s2 = _phi(s_ptr, pair, c, w0, w1, w2, cols, m2, K, R)
        g = tl.load(gl_ptr + (r64 * H + hh)[:, None] * R + cols[None, :], mask=m2, other=0.0)
        sgn = tl.where(phi > 0.0, 1.0, tl.where(phi < 0.0, -1.0, 0.0))
        G = sgn / (tl.abs(phi) + eps) * g  # d L / d phi
        if WANT_DS:
            ci = c.to(tl.int32)[None, :]
            bt = tl.where(ks[:, None] == ci - 1, w0[None, :], 0.0)  # B^T: [KP, BLOCK_N]
            bt += tl.where(ks[:, None] == ci, w1[None, :], 0.0)
            bt += tl.where(ks[:, None] == ci + 1, w2[None, :], 0.0)
            acc = tl.dot(bt, G, acc, input_precision="ieee")
        if WANT_DU:
            g_w0 = tl.sum(G * s0, axis=1)
            g_w1 = tl.sum(G * s1, axis=1)
            g_w2 = tl.sum(G * s2, axis=1)
            # d/df of the unnormalised pieces: a_m' = f - 0.5 [c >= 1], a_0' = -2f, a_p' = f + 0.5 [c <= K-2]
            da_m = tl.where(a_m == 0.0, 0.0, f - 0.5)
            da_0 = -2.0 * f
            da_p = tl.where(a_p == 0.0, 0.0, f + 0.5)
            dz = da_m + da_0 + da_p
            g_f = (g_w0 * (da_m - w0 * dz) + g_w1 * (da_0 - w1 * dz) + g_w2 * (da_p - w2 * dz)) * iz
            tl.store(gf_ptr + (pid_r * n + r64) * H * D + pair, g_f * (K - 1), mask=rmask)
    if WANT_DS:
        out = ds_ptr + (pair * K + ks[:, None]) * R + cols[None, :]
        tl.store(out, acc, mask=(ks < K)[:, None] & cmask[None, :])


def interpreted() -> bool:
    """Whether the kernels were defined under Triton's interpreter (``TRITON_INTERPRET=1`` at this module's import):
    then they run on CPU tensors; otherwise only on a GPU."""
    return type(_forward_kernel).__name__ == "InterpretedFunction"


def _check(u: torch.Tensor, S: torch.Tensor) -> None:
    if u.dtype != torch.float32 or S.dtype != torch.float32:
        raise TypeError(f"the Triton spline product is fp32 only, got u {u.dtype}, S {S.dtype}")
    if u.device.type == "cpu" and not interpreted():
        raise ModelConfigError(
            "model.lev.kernel=triton on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 in the "
            "environment before leviathan_pretrain.model.spline_triton is imported, or set model.lev.kernel=torch"
        )


def _pow2(x: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(x))


def forward(u: torch.Tensor, S: torch.Tensor, eps: float, blocks: Blocks = BLOCKS) -> torch.Tensor:
    """``M [n, h, r]`` (no autograd)."""
    _check(u, S)
    n, h, d = u.shape
    K, r = S.shape[2], S.shape[3]
    S = S.contiguous()
    M = u.new_empty(n, h, r)
    if n == 0:
        return M
    bn, br = blocks.fwd_n, min(blocks.fwd_r, _pow2(r))
    grid = (triton.cdiv(n, bn), h, triton.cdiv(r, br))
    _forward_kernel[grid](
        u, S, M, n, h, d, *u.stride(), float(eps), K=K, R=r, BLOCK_N=bn, BLOCK_R=br, num_warps=blocks.warps
    )
    return M


def backward(u, S, grad_l, eps: float, want_u: bool = True, want_S: bool = True, blocks: Blocks = BLOCKS):
    """``(grad_u [n, h, d] or None, grad_S [h, d, kappa, r] or None)`` from ``grad_l = grad_M * M [n, h, r]``."""
    _check(u, S)
    n, h, d = u.shape
    K, r = S.shape[2], S.shape[3]
    S, grad_l = S.contiguous(), grad_l.contiguous()
    br = min(_pow2(blocks.bwd_r, 16), _pow2(r, 16))
    n_rb = triton.cdiv(r, br)
    grad_S = torch.zeros_like(S) if want_S else None
    parts = u.new_zeros(n_rb, n, h, d) if want_u else None
    if n > 0 and (want_u or want_S):
        _backward_kernel[(h * d, n_rb)](
            u,
            S,
            grad_l,
            grad_S if want_S else S,  # a placeholder pointer when not written
            parts if want_u else u,
            n,
            h,
            d,
            *u.stride(),
            float(eps),
            K=K,
            KP=_pow2(K, 16),
            R=r,
            BLOCK_N=max(16, blocks.bwd_n),
            BLOCK_R=br,
            WANT_DS=want_S,
            WANT_DU=want_u,
            num_warps=blocks.warps,
        )
    grad_u = None if parts is None else (parts[0] if n_rb == 1 else parts.sum(0))
    return grad_u, grad_S


class TritonSplineProduct(torch.autograd.Function):
    """``M = prod_d (B(u) . S)`` in two Triton kernels (module doc); the signature of
    :class:`~.spline.SplineProduct` (``chunk`` is accepted and unused: the kernels never materialise a chunk).
    Saves ``u``, ``S`` and ``M``; backward recomputes ``phi``. fp32 only."""

    @staticmethod
    def forward(ctx, u, S, eps: float, chunk: int | None = None):
        M = forward(u, S, eps)
        ctx.save_for_backward(u, S, M)
        ctx.eps = eps
        return M

    @staticmethod
    def backward(ctx, grad_m):
        u, S, M = ctx.saved_tensors
        grad_l = grad_m * M  # d M / d (sum log) = M
        grad_u, grad_S = backward(u, S, grad_l, ctx.eps, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return grad_u, grad_S, None, None


def spline_product_triton(u: torch.Tensor, S: torch.Tensor, eps: float) -> torch.Tensor:
    """``M[n, h, r]`` from ``u[n, h, d]`` and ``S[h, d, kappa, r]`` by the Triton kernels (fp32)."""
    if u.shape[0] == 0:
        return u.new_zeros(0, u.shape[1], S.shape[-1])
    return TritonSplineProduct.apply(u, S, eps, None)
