"""The LEV layer on its own (TP = 1, no process group): basis, spline product, equality with the readable
reference (tests/lev_reference.py), gradients, materialize / lookup, health, id checks."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leviathan_pretrain.config import load_config
from leviathan_pretrain.model.gpt import build_transformer_config
from leviathan_pretrain.model.inputs import TokenIdError
from leviathan_pretrain.model.lev import LEVInput, lev_health
from leviathan_pretrain.model.settings import BuildSettings
from leviathan_pretrain.model.spline import dense_basis, spline_product
from tests.lev_reference import lev_reference_from_layer, quadratic_bspline_basis

KNOTS = st.integers(min_value=3, max_value=24)


def lev_input(cfg):
    """The LEV layer alone: no process group (TP = 1), on the CPU."""
    return LEVInput(
        build_transformer_config(cfg.model, BuildSettings.from_parallel(cfg.parallel, device="cpu")), cfg.model
    )


def make_layer(vocab=1000, hidden=48, seed=0, **lev):
    over = [
        f"model.vocab_size={vocab}",
        f"model.hidden_size={hidden}",
        "model.num_attention_heads=4",
        "model.lev.seed_dim=16",
        "model.lev.heads=4",
        "model.lev.knots=7",
        "model.lev.rank=8",
    ]
    over += [f"model.lev.{k}={v}" for k, v in lev.items()]
    cfg = load_config(None, over)
    torch.manual_seed(seed)
    return lev_input(cfg)


# -- the quadratic B-spline basis -----------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(u=st.floats(0.0, 1.0), knots=KNOTS)
def test_basis_sums_to_one_has_three_nonzeros_and_matches_reference(u, knots):
    t = torch.tensor([u], dtype=torch.float64)
    B = dense_basis(t, knots)
    assert B.sum().item() == pytest.approx(1.0, abs=1e-12)
    assert (B >= 0).all() and int((B > 0).sum()) <= 3
    assert torch.allclose(B, quadratic_bspline_basis(t, knots), atol=1e-12)


@settings(max_examples=200, deadline=None)
@given(knots=KNOTS, data=st.data())
def test_basis_is_c1_continuous(knots, data):
    # The pieces meet at the midpoints between knots (and the renormalisation acts next to the ends):
    # test there and at arbitrary points. One-sided difference quotients must agree to O(h).
    q = data.draw(st.integers(0, knots - 2))
    u0 = data.draw(st.one_of(st.just((q + 0.5) / (knots - 1)), st.floats(0.01, 0.99)))
    h = 1e-6
    u = torch.tensor([u0 - h, u0, u0 + h], dtype=torch.float64).clamp(0, 1)
    B = dense_basis(u, knots)
    left, right = (B[1] - B[0]) / (u[1] - u[0]), (B[2] - B[1]) / (u[2] - u[1])
    assert (B[2] - B[0]).abs().max() < 10 * knots * h  # C0
    assert (left - right).abs().max() < 50 * knots**2 * h  # C1 (second derivative bounded)


def test_basis_derivative_jumps_are_absent_but_would_be_caught():
    # Sanity of the C1 test itself: a linear (hat) basis has a derivative jump of ~2 (K-1) at each knot.
    knots, h = 9, 1e-6
    g = torch.arange(knots, dtype=torch.float64) / (knots - 1)
    hat = lambda u: (1 - (u[:, None] - g).abs() * (knots - 1)).clamp(min=0)  # noqa: E731
    u = torch.tensor([0.5 - h, 0.5, 0.5 + h], dtype=torch.float64)
    H = hat(u)
    jump = ((H[1] - H[0]) / h - (H[2] - H[1]) / h).abs().max()
    assert jump > 50 * knots**2 * h


# -- the spline product ------------------------------------------------------------------------------
@pytest.mark.parametrize("recompute", [True, False])
def test_spline_product_matches_dense_autograd_in_float64(recompute):
    g = torch.Generator().manual_seed(0)
    u = torch.rand(23, 3, 5, generator=g, dtype=torch.float64)
    u[0, 0, :3] = torch.tensor([0.0, 1.0, 0.5])  # ends and a knot midpoint
    S = 1 + 0.3 * torch.randn(3, 5, 6, 4, generator=g, dtype=torch.float64)
    u1, S1 = u.clone().requires_grad_(), S.clone().requires_grad_()
    M = spline_product(u1, S1, 1e-9, chunk=4, recompute=recompute)
    u2, S2 = u.clone().requires_grad_(), S.clone().requires_grad_()
    phi = torch.einsum("nhdq,hdqr->nhdr", quadratic_bspline_basis(u2, 6), S2)
    M2 = torch.sign(phi).prod(2) * torch.log(phi.abs() + 1e-9).sum(2).exp()
    w = torch.randn(M.shape, generator=g, dtype=torch.float64)
    (M * w).sum().backward()
    (M2 * w).sum().backward()
    assert torch.allclose(M, M2, atol=1e-12, rtol=1e-10)
    assert torch.allclose(u1.grad, u2.grad, atol=1e-10, rtol=1e-8)
    assert torch.allclose(S1.grad, S2.grad, atol=1e-10, rtol=1e-8)


def test_spline_product_gradcheck():
    g = torch.Generator().manual_seed(1)
    u = (0.05 + 0.9 * torch.rand(5, 2, 3, generator=g, dtype=torch.float64)).requires_grad_()
    S = (1 + 0.2 * torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: spline_product(a, b, 1e-9, 2, True), (u, S))


# -- the LEV layer against the readable reference -------------------------------------------------------
@pytest.mark.parametrize("recompute, center", [(True, False), (False, False), (True, True), (False, True)])
def test_lev_layer_equals_reference_forward_and_backward(recompute, center):
    layer = make_layer(token_chunk=5, recompute=recompute, center=center)
    ids = torch.tensor([[3, 999, 3, 0, 512, 77, 77, 640], [1, 2, 3, 4, 5, 6, 7, 999]])
    out = layer(ids)  # [s, b, D]
    ref = lev_reference_from_layer(layer, ids.t().reshape(-1)).view(out.shape)
    assert out.shape == (8, 2, 48)
    assert (out - ref).abs().max() < 1e-5
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    params = [layer.codebooks.weight, layer.proj, layer.ln_weight, layer.ln_bias, layer.spline_delta, layer.out_proj]
    g1 = torch.autograd.grad((out * w).sum(), params)
    g2 = torch.autograd.grad((ref * w).sum(), params)
    for a, b in zip(g1, g2):
        assert (a - b).abs().max() < 1e-5 * max(1.0, b.abs().max().item())


def test_lev_default_hyperparameters_match_reference():
    cfg = load_config(None, ["model.vocab_size=50257", "model.hidden_size=256", "model.num_attention_heads=4"])
    torch.manual_seed(0)
    layer = lev_input(cfg)
    assert (layer.base, layer.lev.seed_dim, layer.lev.heads, layer.lev.knots, layer.lev.rank) == (37, 128, 8, 16, 64)
    ids = torch.randint(0, 50257, (1, 40))
    out = layer(ids)
    ref = lev_reference_from_layer(layer, ids.reshape(-1)).view(out.shape)
    assert (out - ref).abs().max() < 1e-5


def test_every_codebook_row_used_by_the_batch_gets_gradient_and_no_other():
    layer = make_layer()
    ids = torch.tensor([[5, 17, 999, 123, 5]])
    layer(ids).pow(2).sum().backward()
    grad = layer.codebooks.weight.grad  # [k, b, d]
    used = torch.zeros(grad.shape[:2], dtype=torch.bool)
    digits = layer.codebooks.digits_of(ids.reshape(-1))
    for j in range(layer.codebooks.digits):
        used[j, digits[:, j]] = True
    nonzero = grad.abs().sum(-1) > 0
    assert torch.equal(nonzero, used)
    for p in (layer.proj, layer.ln_weight, layer.ln_bias, layer.spline_delta, layer.out_proj):
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_digits_are_base_b_most_significant_first():
    layer = make_layer(vocab=1000)  # b = 10, k = 3
    assert layer.base == 10
    digits = layer.codebooks.digits_of(torch.tensor([0, 7, 42, 999])).tolist()
    assert digits == [[0, 0, 0], [0, 0, 7], [0, 4, 2], [9, 9, 9]]


def test_materialize_equals_per_token_path_and_lookup_mode():
    layer = make_layer(vocab=300)
    table = layer.materialize(chunk=64)
    assert table.shape == (300, 48)
    ids = torch.tensor([[0, 299, 5, 5, 150], [1, 2, 3, 4, 298]])
    out = layer(ids)
    assert (table[ids.t()] - out).abs().max() < 1e-6
    layer.enable_lookup(table)
    assert torch.equal(layer(ids), table[ids.t()])
    layer.disable_lookup()
    assert (layer(ids) - out).abs().max() == 0


@pytest.mark.parametrize("bad", [-1, 1000, 10**6])
def test_out_of_range_ids_raise(bad):
    layer = make_layer(vocab=1000)
    with pytest.raises(TokenIdError, match=rf"token id {bad} is outside \[0, 1000\)"):
        layer(torch.tensor([[1, bad, 2]]))
    layer.enable_lookup()
    with pytest.raises(TokenIdError):
        layer(torch.tensor([[bad]]))


def test_float_ids_are_refused():
    with pytest.raises(TypeError, match="integer"):
        make_layer()(torch.tensor([[1.0, 2.0]]))


def test_health_statistics():
    layer = make_layer()
    assert lev_health(layer) == {}
    layer(torch.tensor([[1, 2, 3, 3]]))
    stats = lev_health(layer)
    assert stats["lev/unique_ids"] == 3 and stats["lev/unique_ratio"] == 0.75
    assert 0.0 <= stats["lev/u_edge_frac"] <= 1.0
    norms = [stats[f"lev/head{i}/out_norm"] for i in range(4)]
    assert all(n > 0 and math.isfinite(n) for n in norms)
    # saturate head 2's spline coordinates: push its LayerNorm bias far out
    with torch.no_grad():
        layer.ln_bias[2].fill_(100.0)
    layer(torch.tensor([[1, 2, 3]]))
    stats = lev_health(layer)
    assert stats["lev/head2/u_edge_frac"] == 1.0 and stats["lev/head0/u_edge_frac"] < 1.0


def test_init_follows_the_spec():
    layer = make_layer(vocab=50000, hidden=64)
    with torch.no_grad():
        S = layer.splines
        assert abs(S.mean().item() - 1.0) < 0.01 and abs(S.std().item() - 0.1) < 0.01
        assert abs(layer.codebooks.weight.std().item() - 0.02) < 0.002
        assert abs(layer.proj.std().item() - 0.02) < 0.002
        assert abs(layer.out_proj.std().item() - 0.02 / math.sqrt(4)) < 0.001
        assert torch.equal(layer.ln_weight, torch.ones_like(layer.ln_weight))
    assert getattr(layer.codebooks.weight, "lev_codebook", False)
    assert not hasattr(layer.codebooks.weight, "tensor_model_parallel")
    assert all(getattr(p, "tensor_model_parallel", False) for p in (layer.proj, layer.spline_delta, layer.out_proj))


def test_unique_ids_are_computed_once():
    layer = make_layer()
    seen = []
    orig = layer.compute_rows
    layer.compute_rows = lambda ids, record=False: seen.append(ids.clone()) or orig(ids, record)
    layer(torch.tensor(np.array([[4, 4, 4, 9], [9, 4, 1, 1]])))
    assert len(seen) == 1 and seen[0].tolist() == [1, 4, 9]
    assert layer.last_unique_ratio == pytest.approx(3 / 8)


def test_bf16_parameters_keep_lev_accurate():
    """DeepSpeed casts the module to bf16: storing S - 1 (not S) keeps G within 1% of fp32
    (rounding S itself to bf16 costs ~2% through the 128-way product)."""
    outs = {}
    ids = torch.randint(0, 50257, (1, 64), generator=torch.Generator().manual_seed(1))
    for prec in ("fp32", "bf16"):
        cfg = load_config(
            None,
            [
                "model.vocab_size=50257",
                "model.hidden_size=256",
                "model.num_attention_heads=4",
                f"parallel.precision={prec}",
            ],
        )
        torch.manual_seed(0)
        layer = lev_input(cfg)
        outs[prec] = layer(ids)
    assert layer.spline_delta.dtype == torch.bfloat16 and outs["bf16"].dtype == torch.bfloat16
    ref = outs["fp32"]
    assert (outs["bf16"].float() - ref).abs().max() / ref.abs().max() < 0.01


# -- options that remove LEV's common mode at init (ours, not the paper's: docs/lev.md) -----------------------
def geometry_at_init(layer, n=1000):
    """(RMS, mean pairwise cosine of rows, ||mean row|| / mean row norm) of G over ``n`` ids."""
    with torch.no_grad():
        G = layer.compute_rows(torch.randperm(layer.vocab_size, generator=torch.Generator().manual_seed(5))[:n])
    unit = G / G.norm(dim=1, keepdim=True)
    cos = ((unit.sum(0).pow(2).sum() - n) / (n * (n - 1))).item()
    return G.pow(2).mean().sqrt().item(), cos, (G.mean(0).norm() / G.norm(dim=1).mean()).item()


SPEC = {"seed_dim": 128, "heads": 8, "knots": 16, "rank": 64}


@pytest.mark.parametrize(
    "sizes",
    [{}, pytest.param(SPEC, marks=pytest.mark.integration)],
    ids=["small", "spec"],  # spec: ~20 s on CPU
)
def test_center_removes_the_constant_mode_and_match_sets_the_rms(sizes):
    """At init the paper's LEV rows share one direction. Measured here (V 16,000, D 256; RMS, mean pairwise cosine,
    share of the mean row): small sizes 0.057 / 0.981 / 0.991, centred 0.015 / 0.699 / 0.835; the spec's sizes
    0.222 / 0.620 / 0.786, centred 0.160 / 0.259 / 0.510. Centring removes the constant 1 of every ``M_l``, not all
    of the common direction: the spline inputs ``u`` of all ids sit near the middle of [0, 1], so every id reads
    nearly the same spline values. ``match`` brings G's RMS to model.init_method_std (0.02) and keeps the
    directions; neither option changes a parameter's shape."""
    base = make_layer(vocab=16000, hidden=256, **sizes)
    rms, cos, share = geometry_at_init(base)
    assert cos > 0.5 and share > 0.7, (rms, cos, share)
    centered = make_layer(vocab=16000, hidden=256, center=True, **sizes)
    c_rms, c_cos, c_share = geometry_at_init(centered)
    assert c_cos < cos - 0.2 and c_share < share - 0.1 and c_rms < rms, (c_rms, c_cos, c_share)
    for center in (False, True):
        matched = make_layer(vocab=16000, hidden=256, center=center, out_init_std="match", **sizes)
        m_rms, m_cos, _ = geometry_at_init(matched)
        assert abs(m_rms - 0.02) < 0.002, (center, m_rms)  # the heads' independent draws: within 10%
        assert m_cos == pytest.approx(c_cos if center else cos, abs=0.02)  # a per-head scale keeps the directions
        assert {n: p.shape for n, p in matched.named_parameters()} == {n: p.shape for n, p in base.named_parameters()}


def test_out_init_std_refuses_other_strings():
    from leviathan_pretrain.config import ConfigError

    with pytest.raises(ConfigError, match=r"model.lev.out_init_std: .*\"match\""):
        load_config(None, ["model.lev.out_init_std=matched"])
    assert load_config(None, ["model.lev.out_init_std=0.01"]).model.lev.out_init_std == 0.01
