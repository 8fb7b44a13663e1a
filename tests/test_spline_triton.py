"""LEV's spline product as Triton kernels (model/spline_triton.py), run on the CPU under Triton's interpreter:
output and gradients equal the torch path's (``SplineProduct`` and plain autograd) in fp32, exact zeros where it
has them, bitwise reproducible; the whole LEV layer with ``model.lev.kernel=triton`` equals ``torch``; the output
GEMM in the model dtype (``model.lev.gemm_dtype``); the keys' validation, build refusals and ``auto``."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined (tests/conftest.py may set it too)

import pytest  # noqa: E402
import torch  # noqa: E402

from leviathan_pretrain.config import ConfigError, load_config  # noqa: E402
from leviathan_pretrain.model import lev  # noqa: E402
from leviathan_pretrain.model import spline_triton as kt  # noqa: E402
from leviathan_pretrain.model.gpt import build_transformer_config  # noqa: E402
from leviathan_pretrain.model.lev import LEVInput  # noqa: E402
from leviathan_pretrain.model.settings import (
    BuildSettings,
    ModelConfigError,  # noqa: E402
)
from leviathan_pretrain.model.spline import SplineProduct, _spline_product_autograd  # noqa: E402
from tests.multiproc import no_cuda_touch  # noqa: E402
from tests.test_lev import make_layer  # noqa: E402

EPS = 1e-9
TOL = 1e-5  # relative to the largest element (measured: M <= 2.6e-7, gradients <= 4.7e-7; the layer's <= 6.1e-7)


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def inputs(n, h, d, K, r, seed=0):
    """``u`` with coordinates on the knots, on knot midpoints (round half to even), at and next to the end knots;
    ``S`` with one rank whose rows are all 0 (``phi`` exactly 0: ``M`` 0) and one crossing zero across the knots."""
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, h, d, generator=g)
    special = [0.0, 1.0, 1e-7, 1 - 1e-7, 0.5 / (K - 1), 1.5 / (K - 1), 1 / (K - 1), (K - 1.5) / (K - 1)]
    flat = u.view(-1)
    flat[: len(special)] = torch.tensor(special)[: flat.numel()]
    S = 1 + 0.3 * torch.randn(h, d, K, r, generator=g)
    S[:, :, :, r - 1] = 0.0  # phi == 0 for every id: M[:, :, r-1] == 0
    S[:, 0, :, 0] = torch.linspace(-1.0, 1.0, K)  # phi changes sign with u
    return u, S, torch.randn(n, h, r, generator=g)


def run(fn, u, S, w):
    u, S = u.clone().requires_grad_(), S.clone().requires_grad_()
    M = fn(u, S)
    (M * w).sum().backward()
    return M.detach(), u.grad, S.grad


TRITON = lambda u, S: kt.TritonSplineProduct.apply(u, S, EPS, None)  # noqa: E731
TORCH = lambda u, S: SplineProduct.apply(u, S, EPS, 7)  # noqa: E731
AUTOGRAD = lambda u, S: _spline_product_autograd(u, S, EPS, 7)  # noqa: E731
SHAPES = [(5, 1, 3, 3, 4), (23, 2, 5, 5, 12), (40, 3, 9, 16, 20), (33, 2, 4, 16, 64)]  # n, h, d, kappa, r


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "n{}-h{}-d{}-k{}-r{}".format(*s))
def test_kernel_equals_the_torch_path(shape):
    u, S, w = inputs(*shape)
    got = run(TRITON, u, S, w)
    for ref_fn in (TORCH, AUTOGRAD):
        ref = run(ref_fn, u, S, w)
        for name, a, b in zip(("M", "grad_u", "grad_S"), got, ref):
            assert rel(a, b) <= TOL, (name, rel(a, b))
            assert torch.equal(a[b == 0], b[b == 0]), name  # exact zeros where the torch path has them
    assert (got[0][:, :, -1] == 0).all() and (got[0] != 0).sum() > 0


def test_several_blocks_of_ranks_and_ids():
    """r = 20 over rank blocks of 8 (forward) and 16 (backward: two partial grad_u slices summed), ids in blocks
    of 16 with a tail; without S's or u's gradient the kernel skips that part."""
    u, S, w = inputs(37, 2, 5, 5, 20, seed=1)
    ref = run(TORCH, u, S, w)
    small = kt.Blocks(fwd_n=16, fwd_r=8, bwd_n=16, bwd_r=16)
    M = kt.forward(u, S, EPS, small)
    gu, gS = kt.backward(u, S, w * M, EPS, blocks=small)
    for name, a, b in zip(("M", "grad_u", "grad_S"), (M, gu, gS), ref):
        assert rel(a, b) <= TOL, (name, rel(a, b))
    assert kt.backward(u, S, w * M, EPS, want_u=False, blocks=small)[0] is None
    only_u, no_S = kt.backward(u, S, w * M, EPS, want_S=False, blocks=small)
    assert no_S is None and torch.equal(only_u, gu)


def test_strided_u_and_no_ids():
    u, S, w = inputs(11, 3, 4, 6, 8, seed=2)
    ut = u.transpose(0, 1).contiguous().transpose(0, 1)  # [n, h, d] with other strides (as an einsum may return)
    assert not ut.is_contiguous()
    assert torch.equal(kt.forward(ut, S, EPS), kt.forward(u, S, EPS))
    assert kt.spline_product_triton(u[:0], S, EPS).shape == (0, 3, 8)
    with pytest.raises(TypeError, match="fp32 only"):
        kt.forward(u.double(), S.double(), EPS)


def test_bitwise_reproducible():
    u, S, w = inputs(40, 3, 9, 16, 20, seed=3)
    a, b = run(TRITON, u, S, w), run(TRITON, u, S, w)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# -- the LEV layer -----------------------------------------------------------------------------------------------
def layer_grads(layer, ids, w):
    rows = layer.compute_rows(ids)
    params = [p for _, p in sorted(layer.named_parameters())]
    return rows.detach(), torch.autograd.grad((rows * w).sum(), params)


@pytest.mark.parametrize("center", [False, True])
def test_lev_layer_triton_equals_torch(center):
    ids = torch.tensor([0, 3, 77, 512, 640, 998, 999, 1, 2, 5, 250, 401])
    w = torch.randn(ids.numel(), 48, generator=torch.Generator().manual_seed(4))
    runs = {}
    for kernel in ("torch", "triton"):
        layer = make_layer(token_chunk=5, kernel=kernel, center=center)
        assert layer.kernel_for(torch.device("cpu")) == kernel
        runs[kernel] = layer_grads(layer, ids, w)
    (rows_a, grads_a), (rows_b, grads_b) = runs["triton"], runs["torch"]
    assert rel(rows_a, rows_b) <= TOL
    assert len(grads_a) == 6
    for a, b in zip(grads_a, grads_b):
        assert b.abs().max() > 0 and rel(a, b) <= TOL


def test_lev_layer_materialize_and_health_with_the_kernel():
    layer = make_layer(vocab=120, kernel="triton")
    table = layer.materialize(chunk=50)
    ids = torch.tensor([[3, 119, 0, 64]])
    out = layer(ids)
    assert torch.allclose(table[ids[0]], out[:, 0], atol=1e-6)
    stats = lev.lev_health(layer)
    assert stats["lev/unique_ids"] == 4 and all(stats[f"lev/head{i}/out_norm"] > 0 for i in range(4))


# -- the output GEMM's dtype -------------------------------------------------------------------------------------
def test_gemm_fp32_is_unchanged_and_model_dtype_is_within_bf16_noise():
    ids = torch.arange(0, 1000, 37)
    w = torch.randn(ids.numel(), 48, generator=torch.Generator().manual_seed(6))
    layers = {g: make_layer(gemm_dtype=g, kernel="torch") for g in ("fp32", "auto")}
    for layer in layers.values():
        M = layer.head_values(ids)  # today's formula, written out
        today = M.reshape(M.shape[0], -1) @ layer.out_proj.float().reshape(-1, 48)
        assert torch.equal(layer.compute_rows(ids), today)  # fp32 (and auto on the CPU): bitwise as before
    bf16 = {}
    for g in ("fp32", "model"):
        cfg = load_config(None, [*BASE, "parallel.precision=bf16", f"model.lev.gemm_dtype={g}"])
        torch.manual_seed(0)
        layer = LEVInput(build_transformer_config(cfg.model, BuildSettings.from_parallel(cfg.parallel)), cfg.model)
        bf16[g] = layer_grads(layer, ids, w)
    (rows_m, grads_m), (rows_f, grads_f) = bf16["model"], bf16["fp32"]
    assert rows_m.dtype == torch.bfloat16 and rows_f.dtype == torch.float32
    assert 0 < rel(rows_m.float(), rows_f) <= 1e-2  # bf16 noise (measured 4.7e-3), not equal
    for a, b in zip(grads_m, grads_f):
        assert rel(a.float(), b.float()) <= 2e-2  # measured <= 7.4e-3


BASE = [
    "model.vocab_size=1000",
    "model.hidden_size=48",
    "model.num_attention_heads=4",
    "model.lev.seed_dim=16",
    "model.lev.heads=4",
    "model.lev.knots=7",
    "model.lev.rank=8",
]


# -- keys, refusals and auto -------------------------------------------------------------------------------------
@pytest.mark.parametrize("key, bad", [("kernel", "cuda"), ("gemm_dtype", "bf16")])
def test_bad_values_are_refused_naming_the_key(key, bad):
    with pytest.raises(ConfigError, match=rf"model\.lev\.{key}"):
        load_config(None, [f"model.lev.{key}={bad}"])


def build(*over, device="cpu", precision="fp32"):
    cfg = load_config(None, [*BASE, *over])
    return LEVInput(build_transformer_config(cfg.model, BuildSettings(device=device, precision=precision)), cfg.model)


def test_triton_is_refused_without_triton_or_on_the_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.setattr(lev, "_TRITON", {"module": None, "error": ImportError("No module named 'triton'")})
    with pytest.raises(ModelConfigError, match=r"model\.lev\.kernel=triton: triton does not import.*kernel=torch"):
        build("model.lev.kernel=triton")
    assert build("model.lev.kernel=auto").kernel_for("cuda") == "torch"  # auto: torch without triton
    monkeypatch.setattr(lev, "_TRITON", {"module": kt, "error": None})
    monkeypatch.setattr(kt, "interpreted", lambda: False)
    no_cuda_touch(monkeypatch)
    with pytest.raises(ModelConfigError, match=r"model\.lev\.kernel=triton on the CPU.*TRITON_INTERPRET.*kernel=torch"):
        build("model.lev.kernel=triton")
    assert build("model.lev.kernel=triton", device="cuda", precision="bf16").kernel_for("cuda") == "triton"
    layer = build("model.lev.kernel=triton", device="cuda")  # built for CUDA, run on CPU tensors
    with pytest.raises(ModelConfigError, match="TRITON_INTERPRET"):
        layer.compute_rows(torch.tensor([1, 2]))


def test_auto_resolution_without_touching_cuda(monkeypatch):
    no_cuda_touch(monkeypatch)
    monkeypatch.setattr(lev, "_FALLBACK", {})
    layer = build(device="cuda", precision="bf16")  # auto, auto
    assert layer.kernel_for(torch.device("cuda")) == "triton" and layer.kernel_for(torch.device("cpu")) == "torch"
    assert layer.gemm_dtype_for(torch.device("cuda")) == torch.bfloat16
    assert layer.gemm_dtype_for(torch.device("cpu")) == torch.float32
    assert build("model.lev.gemm_dtype=model", precision="bf16").gemm_dtype_for("cpu") == torch.bfloat16
    assert build("model.lev.gemm_dtype=fp32", precision="bf16").gemm_dtype_for("cuda") == torch.float32
    assert build("model.lev.kernel=torch").kernel_for("cuda") == "torch"


def test_auto_falls_back_to_torch_once_with_a_warning_and_explicit_triton_raises(monkeypatch):
    """A kernel that fails at its first launch (a compile failure on some GPU), simulated on the CPU."""
    monkeypatch.setattr(lev, "_FALLBACK", {})
    monkeypatch.setattr(LEVInput, "kernel_for", lambda self, device: "triton")  # as on CUDA under auto
    calls = []

    def broken(u, S, eps):
        calls.append(u.shape[0])
        raise RuntimeError("PTX compile failed")

    monkeypatch.setattr(kt, "spline_product_triton", broken)
    ids = torch.tensor([4, 8, 15, 16, 23, 42])
    layer = make_layer(kernel="auto")
    with pytest.warns(RuntimeWarning, match=r"PTX compile failed.*model\.lev\.kernel=torch"):
        rows = layer.compute_rows(ids)
    assert calls == [lev.PROBE_IDS]  # tried once, on a few ids
    assert isinstance(lev._FALLBACK["cpu"], RuntimeError)
    monkeypatch.undo()  # the real kernel_for: auto on the CPU, torch
    assert torch.equal(rows, make_layer(kernel="torch").compute_rows(ids))
    monkeypatch.setattr(lev, "_FALLBACK", {"cuda": RuntimeError("x")})
    assert make_layer(kernel="auto").kernel_for("cuda") == "torch"  # no second try on that device
    monkeypatch.setattr(kt, "spline_product_triton", broken)
    with pytest.raises(RuntimeError, match="PTX compile failed"):
        make_layer(kernel="triton").compute_rows(ids)


def test_the_new_keys_do_not_block_a_resume(tmp_path):
    """Speed/precision settings, not the weights: a checkpoint written before the keys existed, or with other
    values, resumes (trainer/checkpoint/store.py: RESUME_FREE)."""
    from leviathan_pretrain.config import to_dict
    from leviathan_pretrain.model.assembly import LAYOUT_VERSION
    from leviathan_pretrain.parallel.groups import ParallelDims
    from leviathan_pretrain.trainer.checkpoint import store as ckpt
    from leviathan_pretrain.trainer.checkpoint.record import CheckpointRecord

    cfg = load_config(None, ["model.lev.kernel=triton", "model.lev.gemm_dtype=model"])
    dims = ParallelDims(rank=0, world=1, tp=1, pp=1, dp=1, tp_rank=0, pp_rank=0, dp_rank=0, gas=1)
    model = to_dict(cfg.model)
    older = {**model, "lev": {k: v for k, v in model["lev"].items() if k not in ("kernel", "gemm_dtype")}}
    layout = {"tp": 1, "pp": 1, "dp": 1, "zero_stage": cfg.parallel.zero_stage}
    for m in (older, {**model, "lev": {**model["lev"], "kernel": "torch", "gemm_dtype": "fp32"}}):
        fields = {"step": 0, "consumed_samples": 0, "model_layout": LAYOUT_VERSION, "config": {"model": m}}
        ckpt.check_compatible(cfg, CheckpointRecord.from_json({**fields, "layout": layout}, "x"), None, tmp_path, dims)
