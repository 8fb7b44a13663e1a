"""``model.loss_impl: liger``: the training mean's cross entropy through Liger-Kernel's Triton kernel (CUDA, TP = 1).

The same chunked linear + cross entropy as :func:`.loss.mean_loss` (gradients formed in the forward pass, three
GEMMs), with the per-chunk fp32 passes of ``fused`` (the logits' ``.float()`` copy, max, ``sub_``, ``exp_``,
sum, the softmax ``mul_``, the one-hot subtraction, ``mul_(w)``, the cast back) replaced by one launch of
``liger_kernel.ops.cross_entropy.liger_cross_entropy_kernel``: it reads the model-dtype logits chunk, takes each
row's log-sum-exp in fp32 in registers, writes the per-token loss (fp32) and overwrites the logits in place with
their gradient ``softmax - onehot`` in the model dtype. Per chunk ``[lo, hi)`` of ``hidden [T, D]``, with ``d``
that gradient and ``w`` the per-token weights (loss mask / count, fp32), folded into the GEMM operands, which is
exact::

    gh[lo:hi] = (d @ W) * w[:, None]          gW += d^T @ (h * w[:, None])          loss = sum_t loss_t * w_t

Called with reduction ``sum`` (no division by a token count), no label smoothing, soft-cap or z-loss, and none of
the host reads Liger's own ``LigerFusedLinearCrossEntropyFunction`` makes (``.item()``, ``torch.equal``): nothing
here syncs with the host, and no shape depends on the data. Tokens whose weight is 0 (and labels outside
``[0, V)``) go to the kernel as its ignore index: it zeroes their row and skips it.

Precision: the head weight's gradient is summed over chunks in fp32 (on CUDA inside the GEMM: ``torch.addmm(...,
out_dtype=torch.float32)``, torch >= 2.8, what Liger does; elsewhere a model-dtype product added into the fp32 sum,
as ``fused`` does); the hidden states' gradient is kept in fp32 too (``[T, D]``: 16 MiB more than bf16 at 8,192 x
1,024). Backward scales both by the incoming 0-dim gradient in one pass each, rounding once to the model dtype.

Only the training mean runs here: per-token losses with autograd and evaluation scoring stay on model/loss.py.
The kernel is imported lazily (:func:`kernel`): a CPU install without Triton never loads it. On the CPU it runs only
under Triton's interpreter (``TRITON_INTERPRET=1`` set before ``liger_kernel`` is imported): the tests.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from leviathan_pretrain.model.settings import LIGER_INSTALL, ModelConfigError, resolved_loss_impl
from leviathan_pretrain.model.sizes import loss_spans

IGNORE = -100  # the kernel's ignore index: zero-weight tokens (no gradient, no loss)
KEY = "model.loss_impl"


def kernel():
    """``liger_cross_entropy_kernel`` (raises what its import raises: ``ImportError`` without liger-kernel/triton)."""
    from liger_kernel.ops.cross_entropy import liger_cross_entropy_kernel

    return liger_cross_entropy_kernel


def importable() -> bool:
    try:
        kernel()
    except Exception:  # noqa: BLE001 - ImportError, or whatever a broken triton raises at import
        return False
    return True


def check(device: torch.device, tensor_parallel: int) -> None:
    """Raise :class:`ModelConfigError` naming ``model.loss_impl`` unless the kernel can run here."""
    if tensor_parallel != 1:
        raise ModelConfigError(
            f"{KEY}=liger needs parallel.tensor_parallel=1, got {tensor_parallel} (the kernel normalises over the "
            "whole vocabulary row; a tensor-parallel rank holds a slice of it); use model.loss_impl=fused"
        )
    cpu = device.type != "cuda"
    if cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise ModelConfigError(
            f"{KEY}=liger needs CUDA (on the CPU the Triton kernel runs only under Triton's interpreter, "
            "TRITON_INTERPRET=1: tests only); use model.loss_impl=fused or auto on the CPU"
        )
    try:
        k = kernel()
    except Exception as e:  # noqa: BLE001
        raise ModelConfigError(
            f"{KEY}=liger: Liger-Kernel's cross entropy does not import ({type(e).__name__}: {e}); {LIGER_INSTALL}, "
            "or use model.loss_impl=fused"
        ) from None
    if cpu and type(k).__name__ != "InterpretedFunction":
        raise ModelConfigError(
            f"{KEY}=liger on the CPU: liger_kernel was imported before TRITON_INTERPRET=1 was set, so its kernel is "
            "compiled for a GPU; set TRITON_INTERPRET=1 before anything imports liger_kernel, or use "
            "model.loss_impl=fused"
        )


def resolve(requested: str, build) -> str:
    """``model.loss_impl`` for this build (``fused`` | ``liger`` | ``megatron``): ``auto`` is ``liger`` on CUDA at
    TP = 1 when the kernel imports, else ``fused`` (the CPU never imports it); an explicit ``liger`` that cannot
    run here raises :class:`ModelConfigError`."""
    device = build.torch_device
    if requested == "liger":
        check(device, build.tensor_parallel)
        return "liger"
    if requested == "auto" and device.type == "cuda" and build.tensor_parallel == 1:
        return resolved_loss_impl(requested, "cuda", 1, importable())
    return resolved_loss_impl(requested, device.type, build.tensor_parallel, False)


# ---- the first launch: under ``auto`` a kernel that fails to compile falls back to ``fused`` (model/head.py)
class LaunchError(RuntimeError):
    """The kernel raised at a launch of the first call in this process (a Triton compile failure)."""


_STATE = {"verified": False, "failed": None}  # a first call went through; the error that made ``auto`` give up


def failed() -> str | None:
    """The error that made ``auto`` fall back to ``fused`` in this process, or None."""
    return _STATE["failed"]


def give_up(error: BaseException) -> None:
    """``auto``: use ``fused`` from now on, with one loud warning."""
    _STATE["failed"] = str(error) if isinstance(error, LaunchError) else f"{type(error).__name__}: {error}"
    warnings.warn(
        f"{KEY}=auto: Liger-Kernel's cross entropy failed at its first launch ({_STATE['failed']}); the training "
        "loss falls back to model.loss_impl=fused for this process (set model.loss_impl=fused to skip the try)",
        RuntimeWarning,
        stacklevel=3,
    )


@functools.cache
def _launch_options(device_type: str, element_size: int) -> dict:
    """The kernel's block and warps as Liger's own ``cross_entropy_forward`` picks them (one lookup per process)."""
    from liger_kernel.ops.cross_entropy import MAX_FUSED_SIZE
    from liger_kernel.ops.utils import is_hip
    from liger_kernel.utils import infer_device_arch

    if device_type != "cuda":
        warps = 32
    elif is_hip():
        warps = 16
    else:  # Blackwell, 2-byte logits: 8 (issue-bound); else 32 (bandwidth-bound): Liger 0.8.5's measurements
        warps = 8 if element_size == 2 and infer_device_arch().startswith("blackwell") else 32
    return {"max_block": MAX_FUSED_SIZE, "num_warps": warps}


def _cross_entropy(logits: torch.Tensor, y: torch.Tensor, loss: torch.Tensor, grads: bool) -> None:
    """One launch: ``loss[i] = lse_i - logits[i, y_i]`` (fp32) and, with ``grads``, ``logits[i] <- softmax - onehot``
    in place (a row with ``y_i = IGNORE``: zeros, loss untouched)."""
    import triton

    k = kernel()
    rows, V = logits.shape
    opts = _launch_options(logits.device.type, logits.element_size())
    args = dict(
        X_ptr=logits,
        X_stride=logits.stride(0),
        Y_ptr=y,
        Y_stride=1,
        weight_ptr=None,
        loss_ptr=loss,
        z_loss_ptr=None,
        loss_stride=1,
        token_accuracy_ptr=None,
        token_accuracy_stride=0,
        predicted_tokens_ptr=None,
        predicted_tokens_stride=0,
        n_cols=V,
        n_non_ignore=1,  # unused by reduction "sum"
        sum_non_ignore_weight=1,
        weight_sum=0.0,
        ignore_index=IGNORE,
        lse_square_scale=0.0,
        label_smoothing=0.0,
        reduction="sum",
        softcap=None,
        RETURN_Z_LOSS=False,
        RETURN_TOKEN_ACCURACY=False,
        RETURN_PREDICTED_TOKENS=False,
        BLOCK_SIZE=min(opts["max_block"], triton.next_power_of_2(V)),
        HAS_WEIGHT=False,
        HAS_SOFTCAPPING=False,
        HAS_GRADIENTS=grads,
        num_warps=opts["num_warps"],
    )
    if _STATE["verified"]:
        k[(rows,)](**args)
        return
    try:
        k[(rows,)](**args)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - a Triton compile/launch failure, of whatever type the backend raises
        raise LaunchError(f"{type(e).__name__}: {e}") from e


def _sum_grad_weight(gw: torch.Tensor, d: torch.Tensor, hw: torch.Tensor) -> None:
    """``gw += d^T @ hw``: in place when the dtypes agree; on CUDA summed in fp32 inside the GEMM; elsewhere the
    model-dtype product added into the fp32 sum (what model/loss.py does)."""
    if gw.dtype == d.dtype:
        gw.addmm_(d.t(), hw)
    elif gw.is_cuda:
        torch.addmm(gw, d.t(), hw, out_dtype=torch.float32, out=gw)
    else:
        gw += d.t() @ hw


class _LigerMean(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, w, chunk, want_h, want_w):
        T, V = hidden.shape[0], weight.shape[0]
        dtype, dev = weight.dtype, hidden.device
        grads = want_h or want_w
        gh = torch.empty(hidden.shape, dtype=torch.float32, device=dev) if want_h else None
        gw = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if want_w else None
        keep = (w != 0) & (labels >= 0) & (labels < V)
        y = torch.where(keep, labels, IGNORE).contiguous()
        loss = torch.zeros(T, dtype=torch.float32, device=dev)
        spans = loss_spans(T, chunk)
        rows = max((hi - lo for lo, hi in spans), default=0)
        buf = torch.empty((rows, V), dtype=dtype, device=dev)  # one chunk's logits, reused
        for lo, hi in spans:
            h = hidden[lo:hi]
            logits = torch.mm(h, weight.t(), out=buf[: hi - lo])
            _cross_entropy(logits, y[lo:hi], loss[lo:hi], grads)
            wc = w[lo:hi, None]
            if want_h:
                torch.mul(logits @ weight, wc, out=gh[lo:hi])  # the model-dtype GEMM, times w in fp32
            if want_w:
                _sum_grad_weight(gw, logits, torch.mul(h, wc, out=torch.empty_like(h)))
        _STATE["verified"] = True
        ctx.grads = (gh, gw, hidden.dtype, dtype)
        return (loss * w).sum()

    @staticmethod
    def backward(ctx, g):
        gh, gw, h_dtype, w_dtype = ctx.grads
        ctx.grads = None
        return _scaled(gh, g, h_dtype), _scaled(gw, g, w_dtype), None, None, None, None, None


def _scaled(grad: torch.Tensor | None, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``grad * g`` in ``dtype``, one pass (fp32 products rounded once)."""
    if grad is None:
        return None
    if grad.dtype == dtype:
        return grad.mul_(g)
    return torch.mul(grad, g, out=torch.empty(grad.shape, dtype=dtype, device=grad.device))


def mean_loss(hidden, weight, labels, w, chunk: int) -> torch.Tensor:
    """Scalar ``sum_t w[t] * CE(hidden[t] @ weight^T, labels[t])`` (fp32) of ``hidden [T, D]``, the whole head
    ``weight [V, D]`` (TP = 1), ``labels [T]`` and ``w [T]``; see the module doc. Raises :class:`LaunchError` when
    the kernel fails in the first call of the process."""
    grad = torch.is_grad_enabled()
    return _LigerMean.apply(
        hidden,
        weight,
        labels,
        w.float(),
        chunk,
        grad and hidden.requires_grad,
        grad and weight.requires_grad,
    )
