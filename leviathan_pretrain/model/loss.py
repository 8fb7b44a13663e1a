"""The output head's cross entropy without the ``[tokens, V]`` logits: a chunked, fused linear + loss.

``model.loss_impl: fused`` (what ``auto`` resolves to on the CPU and at TP > 1; ``liger``, model/loss_liger.py,
runs the training mean's chunks through a Triton kernel and leaves the rest here). The head's logits are computed
``chunk`` tokens at a time in the model's dtype (``hidden @ weight^T``, the head's own GEMM), cast to fp32 for the
log-sum-exp (what megatron's ``vocab_parallel_cross_entropy`` does to the whole ``[tokens, V_pad / tp]`` tensor)
and dropped; only per-token fp32 statistics outlive a chunk. Tensor parallel over the vocabulary as megatron's:
each rank holds ``V_pad / tp`` rows of the weight, and the per-token log-sum-exp and target logit are combined over
the TP group (one all-gather of ``[2, chunk]`` per chunk; megatron all-reduces the max, the target logit and the sum
of exponentials). The padded vocabulary rows take part, as in megatron's loss.

Three entry points, all on ``hidden [T, D]`` (already through ``copy_to_tp``: its backward all-reduces the
hidden-state gradient over TP), ``weight [V_pad / tp, D]`` and ``labels [T]``:

- :func:`mean_loss` (training): ``sum_t w_t * loss_t`` for per-token weights ``w`` (loss mask / count). The
  gradients are computed in the forward pass, chunk by chunk, since every token's weight is known there
  (Liger-Kernel's FusedLinearCrossEntropy); backward only scales them by the incoming scalar. Three GEMMs,
  as the unfused path.
- :func:`token_loss` (per-token losses with autograd): backward recomputes each chunk's logits from the saved
  fp32 log-sum-exp (Cut Cross-Entropy's scheme); four GEMMs.
- :func:`score_tokens` (no autograd, TP = 1): natural-log loss and greedy hit per token (evaluation).

The logits' gradient ``(softmax - onehot) * w`` is formed in fp32 and cast to the model dtype for the two
GEMMs (as autograd casts megatron's fp32 gradient of ``logits.float()``); the weight's gradient is summed over
chunks in fp32 and cast once at the end.
"""

from __future__ import annotations

import torch

from leviathan_pretrain.model.settings import group_rank, group_size
from leviathan_pretrain.model.sizes import loss_spans
from leviathan_pretrain.model.tp import all_gather_dim0

_spans = loss_spans  # [lo, hi) token spans of at most ``chunk``, as few as that allows, of near-equal length


def _targets(labels: torch.Tensor, start: int, width: int):
    """``(inside [c] bool, index [c])``: which labels fall in this rank's vocabulary slice, and where."""
    local = labels - start
    inside = (local >= 0) & (local < width)
    return inside, torch.where(inside, local, torch.zeros_like(local))


def _exp_stats(h, weight, labels, start, group):
    """One chunk: ``(e, m, lse, target_logit, inside, index)`` with ``e = exp(logits - m)`` (fp32, in place of the
    logits), ``m`` this rank's row max, ``lse`` the log-sum-exp over the whole vocabulary (all TP ranks)."""
    logits = (h @ weight.t()).float()
    inside, idx = _targets(labels, start, logits.shape[1])
    tgt = logits.gather(1, idx[:, None])[:, 0].masked_fill(~inside, 0.0)
    m = logits.max(dim=1).values
    e = logits.sub_(m[:, None]).exp_()
    lse = m + e.sum(dim=1).log()
    if group_size(group) > 1:
        both = all_gather_dim0(torch.stack([lse, tgt])[None], group)  # [tp, 2, c]
        lse, tgt = torch.logsumexp(both[:, 0], dim=0), both[:, 1].sum(dim=0)
    return e, m, lse, tgt, inside, idx


def _dlogits(p, inside, idx, w) -> torch.Tensor:
    """``(p - onehot) * w[:, None]`` in place of the fp32 softmax ``p``."""
    rows = torch.arange(p.shape[0], device=p.device)
    p[rows, idx] -= inside.to(p.dtype)
    return p.mul_(w[:, None])


def _grads(d, h, weight, gh, gw, lo, hi) -> None:
    """This chunk's share: ``gh[lo:hi] = d @ weight`` and ``gw += d^T @ h`` (``d`` in the model dtype)."""
    if gh is not None:
        gh[lo:hi] = d @ weight
    if gw is not None:
        if gw.dtype == d.dtype:
            gw.addmm_(d.t(), h)
        else:
            gw += d.t() @ h


def _grad_buffers(hidden, weight, want_h: bool, want_w: bool):
    gh = torch.empty_like(hidden) if want_h else None
    gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
    return gh, gw


class _MeanLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, w, start, group, chunk, want_h, want_w):
        gh, gw = _grad_buffers(hidden, weight, want_h, want_w)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for lo, hi in _spans(hidden.shape[0], chunk):
            h = hidden[lo:hi]
            e, m, lse, tgt, inside, idx = _exp_stats(h, weight, labels[lo:hi], start, group)
            total += ((lse - tgt) * w[lo:hi]).sum()
            if want_h or want_w:
                p = e.mul_(torch.exp(m - lse)[:, None])  # the softmax over the whole vocabulary
                _grads(_dlogits(p, inside, idx, w[lo:hi]).to(weight.dtype), h, weight, gh, gw, lo, hi)
            e = p = None  # this chunk's fp32 logits go before the next chunk's are made (one chunk at the peak)
        ctx.grads = (gh, gw, weight.dtype)
        return total

    @staticmethod
    def backward(ctx, g):
        gh, gw, dtype = ctx.grads
        ctx.grads = None
        gh = None if gh is None else gh * g  # a 0-dim fp32 factor: scaled in fp32, rounded once
        gw = None if gw is None else gw.mul_(g).to(dtype)
        return gh, gw, None, None, None, None, None, None, None


class _TokenLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, start, group, chunk):
        losses = []
        lses = []
        for lo, hi in _spans(hidden.shape[0], chunk):
            _, _, lse, tgt, _, _ = _exp_stats(hidden[lo:hi], weight, labels[lo:hi], start, group)
            losses.append(lse - tgt)
            lses.append(lse)
        ctx.save_for_backward(hidden, weight, labels, torch.cat(lses))
        ctx.start, ctx.chunk = start, chunk
        return torch.cat(losses)

    @staticmethod
    def backward(ctx, g):
        hidden, weight, labels, lse = ctx.saved_tensors
        gh, gw = _grad_buffers(hidden, weight, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        g = g.float()
        for lo, hi in _spans(hidden.shape[0], ctx.chunk):
            h = hidden[lo:hi]
            p = (h @ weight.t()).float().sub_(lse[lo:hi, None]).exp_()
            inside, idx = _targets(labels[lo:hi], ctx.start, p.shape[1])
            _grads(_dlogits(p, inside, idx, g[lo:hi]).to(weight.dtype), h, weight, gh, gw, lo, hi)
            p = None  # before the next chunk's logits (one chunk at the peak)
        return gh, None if gw is None else gw.to(weight.dtype), None, None, None, None


def vocab_start(weight: torch.Tensor, group) -> int:
    """The first vocabulary id of this rank's ``[V_pad / tp, D]`` slice."""
    return group_rank(group) * weight.shape[0]


def mean_loss(hidden, weight, labels, w, group=None, chunk: int = 1024) -> torch.Tensor:
    """Scalar ``sum_t w[t] * CE(hidden[t] @ weight^T, labels[t])`` (fp32); see the module doc."""
    grad = torch.is_grad_enabled()
    return _MeanLoss.apply(
        hidden,
        weight,
        labels,
        w.float(),
        vocab_start(weight, group),
        group,
        chunk,
        grad and hidden.requires_grad,
        grad and weight.requires_grad,
    )


def token_loss(hidden, weight, labels, group=None, chunk: int = 1024) -> torch.Tensor:
    """Per-token ``CE(hidden[t] @ weight^T, labels[t])`` ``[T]`` (fp32); see the module doc."""
    return _TokenLoss.apply(hidden, weight, labels, vocab_start(weight, group), group, chunk)


@torch.no_grad()
def score_tokens(hidden, weight, targets, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """``(nll [T] fp32, hit [T] bool)`` of ``targets`` under ``softmax(hidden @ weight^T)`` (TP = 1: ``weight``
    is the whole ``[V, D]`` head); ``hit``: the greedy argmax is the target."""
    nll, hit = [], []
    for lo, hi in _spans(hidden.shape[0], chunk):
        logits = (hidden[lo:hi] @ weight.t()).float()
        t = targets[lo:hi]
        m, best = logits.max(dim=1)  # one pass for the max and the greedy token (the first maximum, as argmax)
        tgt = logits.gather(1, t[:, None])[:, 0]
        lse = m + logits.sub_(m[:, None]).exp_().sum(dim=1).log()  # in place of the logits: no second [c, V]
        nll.append(lse - tgt)
        hit.append(best == t)
    return torch.cat(nll), torch.cat(hit)
