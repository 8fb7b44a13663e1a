"""``model.loss_impl: liger`` (model/loss_liger.py): the training mean through Liger-Kernel's Triton cross entropy,
on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py before anything imports
triton), against the ``fused`` path (model/loss.py) and plain ``F.cross_entropy``.

- The loss alone: fp32 loss and both gradients, masks with zeros, chunks that do and do not divide the tokens, an
  incoming gradient != 1; bf16 against an fp64 reference next to ``fused``'s error.
- Whole small models (TIED, LEV's untied head) at TP = 1 in this process (a world of one): loss and every
  parameter's gradient, ``liger`` against ``fused``.
- Resolution and refusals: ``auto`` per device without touching CUDA, ``liger`` at TP = 2 (config load), without
  liger-kernel, on the CPU without the interpreter (model build); the first-launch fallback of ``auto``.
"""

import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from leviathan_pretrain.config import ConfigError, load_config
from leviathan_pretrain.model import loss as fused
from leviathan_pretrain.model import loss_liger, sizes
from leviathan_pretrain.model.assembly import build_model
from leviathan_pretrain.model.head import HeadInput, HeadOptions, mean_loss
from leviathan_pretrain.model.settings import BuildSettings, ModelConfigError
from tests.multiproc import no_cuda_touch, one_rank_world
from tests.small_model import small_model_overrides
from tests.test_fused_loss import _problem  # the same small problem as the fused loss's tests


def _rel(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _grads(fn, h, w):
    """``(loss, h.grad, w.grad)`` of ``3 * fn(h, w)`` (an incoming gradient of 3)."""
    h.grad = w.grad = None
    loss = fn(h, w)
    (3.0 * loss).backward()
    return loss.detach(), h.grad.clone(), w.grad.clone()


def test_the_kernel_runs_under_the_interpreter():
    """conftest.py set TRITON_INTERPRET=1 before anything imported liger_kernel: its kernel is interpreted."""
    assert type(loss_liger.kernel()).__name__ == "InterpretedFunction"


@pytest.mark.parametrize("chunk", [7, 16, 45, 1000])
def test_liger_mean_equals_fused_and_cross_entropy(chunk):
    h, w, y = _problem()
    mask = (torch.arange(45) % 4 != 0).float()
    mask[10:14] = 0.0
    wt = mask / mask.sum()
    ref, gh_ref, gw_ref = _grads(
        lambda h, w: (F.cross_entropy(h @ w.t(), y, reduction="none") * mask).sum() / mask.sum(), h, w
    )
    fl, gh_f, gw_f = _grads(lambda h, w: fused.mean_loss(h, w, y, wt, chunk=chunk), h, w)
    lg, gh_l, gw_l = _grads(lambda h, w: loss_liger.mean_loss(h, w, y, wt, chunk), h, w)
    assert lg.dtype == torch.float32 and lg.shape == ()
    for other, gh, gw in ((ref, gh_ref, gw_ref), (fl, gh_f, gw_f)):
        assert abs(float(lg) - float(other)) <= 1e-6 * abs(float(other))
        assert _rel(gh_l, gh) < 1e-5 and _rel(gw_l, gw) < 1e-5
    assert bool((gh_l[mask == 0] == 0).all())  # masked positions: exactly no gradient


def test_liger_mean_without_grad_and_with_nothing_to_count():
    h, w, y = _problem()
    wt = torch.full((45,), 1 / 45)
    with torch.no_grad():
        a = loss_liger.mean_loss(h, w, y, wt, 8)
    assert not a.requires_grad
    assert abs(float(a) - float(F.cross_entropy(h.detach() @ w.detach().t(), y))) < 1e-5
    zero, gh, gw = _grads(lambda h, w: loss_liger.mean_loss(h, w, y, torch.zeros(45), 8), h, w)
    assert float(zero) == 0.0 and not gh.any() and not gw.any()  # a batch without a counted token


def test_bf16_liger_error_is_bf16_noise_like_fused():
    """bf16 operands, both paths against an fp64 reference of the same bf16 numbers; printed with ``-s``."""
    h, w, y = _problem(torch.bfloat16, T=64, D=32, V=257, seed=1)
    mask = (torch.arange(64) % 5 != 0).float()
    wt = mask / mask.sum()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref, gh_ref, gw_ref = _grads(
        lambda h, w: (F.cross_entropy(h @ w.t(), y, reduction="none") * mask.double()).sum() / mask.sum(), h64, w64
    )
    out = {
        "fused": _grads(lambda h, w: fused.mean_loss(h, w, y, wt, chunk=24), h, w),
        "liger": _grads(lambda h, w: loss_liger.mean_loss(h, w, y, wt, 24), h, w),
    }
    err = {
        k: (abs(float(v[0]) - float(ref)) / abs(float(ref)), _rel(v[1], gh_ref), _rel(v[2], gw_ref))
        for k, v in out.items()
    }
    print(f"\nbf16 vs fp64 (loss, hidden grad, head grad), relative to the largest element: {err}")
    assert all(out[k][1].dtype == out[k][2].dtype == torch.bfloat16 for k in out)
    for i, floor in enumerate((1e-6, 4e-3, 4e-3)):  # bf16's unit roundoff: 2**-8 = 3.9e-3
        assert err["liger"][i] <= 2 * err["fused"][i] + floor, err


@pytest.fixture(scope="module")
def world():
    with one_rank_world(load_config(None, ["parallel.device=cpu"]).parallel) as env:
        yield env


def _model_grads(variant, impl, group):
    V, S, B = 500, 16, 3
    over = [*small_model_overrides(variant, V, S), "parallel.precision=fp32", "model.loss_chunk_tokens=13"]
    cfg = load_config(None, [*over, f"model.loss_impl={impl}"])
    model = build_model(cfg.model, BuildSettings.from_parallel(cfg.parallel, tp_group=group), seed=1234)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, V, (B, S + 1), generator=g)
    mask = (torch.rand(B, S, generator=g) > 0.25).float()
    loss = model(ids[:, :-1], torch.arange(S)[None].expand(B, S), None, labels=ids[:, 1:], loss_mask=mask)
    (2.0 * loss).backward()
    opts = next(m.head_options for m in model.modules() if hasattr(m, "head_options"))
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}, opts


@pytest.mark.parametrize("variant", ["tied", "lev"])
def test_whole_model_liger_equals_fused(world, variant):
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    lf, gf, of = _model_grads(variant, "fused", group)
    ll, gl, ol = _model_grads(variant, "liger", group)
    assert (of.impl, ol.impl, ol.requested) == ("fused", "liger", "liger")
    assert ol.chunk == ol.fused_chunk == 13  # model.loss_chunk_tokens holds for both paths
    assert abs(ll - lf) <= 1e-5 * abs(lf)
    assert len(gl) == len(gf) >= 14 and all(gf[n].abs().max() > 0 for n in gf)
    worst = max((_rel(gl[n], gf[n]), n) for n in gf)
    assert worst[0] < 1e-5, worst


# ---------------------------------------------------------------- resolution and refusals
V_PAD = 200_064


def _opts(*over, device="cpu", precision="bf16", tp=1):
    cfg = load_config(None, [f"model.vocab_size={V_PAD}", *over])
    return HeadOptions.of(cfg.model, BuildSettings(device=device, precision=precision, tensor_parallel=tp), V_PAD)


def test_auto_resolves_per_device_without_touching_cuda(monkeypatch):
    no_cuda_touch(monkeypatch)
    assert load_config(None, []).model.loss_impl == "auto"  # the default
    gpu = _opts(device="cuda")
    assert (gpu.impl, gpu.requested) == ("liger", "auto")
    assert gpu.chunk == 5366 and gpu.fused_chunk == 2683  # 2 GiB of bf16 logits (liger) / of fp32 (per token)
    assert sizes.balanced_chunk(8192, gpu.chunk) == 4096  # an 8,192-token micro-batch: two chunks
    assert _opts(device="cuda", precision="fp32").chunk == 2683
    assert _opts("model.loss_chunk_tokens=96", device="cuda").chunk == 96
    assert _opts(device="cpu").impl == "fused"
    assert _opts("model.loss_impl=fused", device="cuda").impl == "fused"
    assert _opts("model.loss_impl=megatron", device="cuda").impl == "megatron"
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.cross_entropy", None)  # not importable: auto -> fused
    assert _opts(device="cuda").impl == "fused"


def test_liger_at_tp2_is_refused_at_load():
    with pytest.raises(ConfigError, match=r"model\.loss_impl.*tensor_parallel=1.*use fused"):
        load_config(None, ["model.loss_impl=liger", "parallel.tensor_parallel=2"])
    assert load_config(None, ["parallel.tensor_parallel=2"]).model.loss_impl == "auto"  # auto: fused at TP 2


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_liger_without_liger_kernel_is_refused_at_build(monkeypatch, device):
    no_cuda_touch(monkeypatch)
    monkeypatch.setitem(sys.modules, "liger_kernel.ops.cross_entropy", None)  # import raises ImportError
    with pytest.raises(ModelConfigError, match=r"model\.loss_impl=liger.*pip install liger-kernel==0\.8\.5"):
        _opts("model.loss_impl=liger", device=device)


def test_liger_on_the_cpu_needs_the_interpreter(monkeypatch):
    assert _opts("model.loss_impl=liger").impl == "liger"  # under the interpreter: the tests' way
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ModelConfigError, match=r"model\.loss_impl=liger needs CUDA.*TRITON_INTERPRET=1"):
        _opts("model.loss_impl=liger")


class _Broken:
    """A kernel whose launch raises, as a Triton compile failure does."""

    def __getitem__(self, grid):
        def launch(**kw):
            raise RuntimeError("PassManager::run failed")

        return launch


def _head_input(impl_requested):
    h, w, y = _problem()
    s, b = 9, 5
    opts = HeadOptions("liger", 7, 7, impl_requested)
    return HeadInput(h.view(s, b, -1), w, None, 7, opts), y.view(s, b).t(), torch.ones(b, s)


@pytest.fixture
def broken_kernel(monkeypatch):
    """Liger's kernel fails at its first launch, in a process that has not launched it yet."""
    monkeypatch.setattr(loss_liger, "kernel", lambda: _Broken())
    monkeypatch.setitem(loss_liger._STATE, "verified", False)
    monkeypatch.setitem(loss_liger._STATE, "failed", None)


def test_auto_falls_back_to_fused_once_when_the_kernel_fails(broken_kernel):
    out, y, mask = _head_input("auto")
    with pytest.warns(RuntimeWarning, match=r"PassManager::run failed.*model\.loss_impl=fused"):
        got = mean_loss(out, y, mask)
    m = mask.t().reshape(-1)
    ref = fused.mean_loss(out.hidden.reshape(45, -1), out.weight, y.t().reshape(-1), m / m.sum(), chunk=7)
    assert float(got.detach()) == float(ref.detach()) and "PassManager" in loss_liger.failed()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning: the next calls go to fused quietly
        assert float(mean_loss(out, y, mask).detach()) == float(ref.detach())


def test_explicit_liger_raises_when_the_kernel_fails(broken_kernel):
    out, y, mask = _head_input("liger")
    with pytest.raises(RuntimeError, match=r"model\.loss_impl=liger.*PassManager::run failed.*model\.loss_impl=fused"):
        mean_loss(out, y, mask)
    assert loss_liger.failed() is None
