"""benchmarks/lev_fit.py: LEV fitted to a trained table, its R^2 and the rank-k bound."""

from __future__ import annotations

import json

import pytest
import torch

from tests import benchmark_scripts


@pytest.fixture(scope="module")
def lev_fit():
    return benchmark_scripts.load("lev_fit")


def test_r2_is_one_for_the_table_and_zero_for_its_mean_row(lev_fit):
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(50, 8, generator=gen)
    ids = torch.arange(10, 50)
    weights = torch.rand(50, generator=gen)
    assert lev_fit.r2(table, table, ids) == pytest.approx(1.0)
    assert lev_fit.r2(table, table[ids].mean(0).expand(50, 8), ids) == pytest.approx(0.0, abs=1e-12)
    weighted_mean = (weights[ids, None] * table[ids]).sum(0) / weights[ids].sum()
    assert lev_fit.r2(table, weighted_mean.expand(50, 8), ids, weights) == pytest.approx(0.0, abs=1e-6)
    assert lev_fit.r2(table, torch.zeros(50, 8), ids) < 0.0  # no intercept for free: zero rows score below 0


def test_the_rank_bound_is_the_best_rank_k_fit_of_the_seen_rows(lev_fit):
    gen = torch.Generator().manual_seed(0)
    low = torch.randn(40, 3, generator=gen) @ torch.randn(3, 16, generator=gen)
    seen = torch.arange(0, 40, 2)
    bound = lev_fit.rank_bound(low, seen, 3)
    assert torch.allclose(bound[seen], low[seen], atol=1e-5)  # a rank-3 table is fitted exactly at k = 3
    assert not bound[1::2].any()  # unseen rows are not fitted
    noisy = low + 0.5 * torch.randn(40, 16, generator=gen)
    r2 = [lev_fit.r2(noisy, lev_fit.rank_bound(noisy, seen, k), seen) for k in (1, 3, 8, 16)]
    assert r2 == sorted(r2) and r2[-1] == pytest.approx(1.0)  # more rank, better; full rank, exact
    weights = torch.ones(40)
    weights[:4] = 1e6  # rank 4 spent on four rows that weigh most: those fitted exactly, the rest worse
    heavy = lev_fit.rank_bound(noisy, seen, 4, weights)
    assert torch.allclose(heavy[:4:2], noisy[:4:2], atol=1e-4)
    assert lev_fit.r2(noisy, heavy, seen) < lev_fit.r2(noisy, lev_fit.rank_bound(noisy, seen, 4), seen)


def test_a_form_without_a_name_is_refused(lev_fit, capsys):
    with pytest.raises(SystemExit):
        lev_fit.parse_args(["--run", "x", "--form", "model.lev.rank=4"])
    assert "--form 'model.lev.rank=4'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        lev_fit.parse_args(["--run", "x", "--lr", "3e-3", "0"])
    assert "learning rates must be > 0" in capsys.readouterr().err


def test_lev_fitted_to_a_trained_tied_table(lev_fit, trained_run, tmp_path, capsys):
    out = tmp_path / "fit.json"
    argv = ["--run", str(trained_run("tied-tp2")), "--steps", "40", "--batch", "256", "--json", str(out),
            "--form", "lev=", "--form", "full=model.lev.center=true,model.lev.rank=32"]  # fmt: skip
    assert lev_fit.main(argv) == 0
    res = json.loads(out.read_text())
    lev, full = res["forms"]["lev"], res["forms"]["full"]
    assert (lev["k"], full["k"]) == (32, 128)  # heads 4 x rank 8; 4 x 32 = the hidden size
    # LEV's rows have rank <= k, so the truncated SVD bounds its residual on the fitted objective
    assert lev["fit"]["overall"] <= lev["rank_bound"]["overall"] + 1e-6
    assert full["rank_bound"]["overall"] == pytest.approx(1.0) and full["fit"]["overall"] < 1.0
    assert 0.0 < lev["rank_bound"]["overall"] < 1.0
    assert set(lev["noise"]["buckets"]) == set(lev["fit"]["buckets"]) and lev["fit"]["buckets"]
    printed = capsys.readouterr().out
    assert "| lev | 32 | the table | 0.003 |" in printed and "| full | 128 | noise of its RMS | 0.003 |" in printed
    assert "| lev | 32 | the table, best rank k (SVD) |  |" in printed  # an SVD has no learning rate
    assert "One learning rate (0.003)" in printed and "lower bound" in printed
    # weighted by training counts: the bound is the weighted one, and bounds the weighted R^2
    argv = ["--run", str(trained_run("tied-tp2")), "--steps", "40", "--batch", "256", "--json", str(out),
            "--form", "lev=", "--weight", "frequency", "--no-noise"]  # fmt: skip
    assert lev_fit.main(argv) == 0
    weighted = json.loads(out.read_text())["forms"]["lev"]
    assert "noise" not in weighted and weighted["rank_bound"] != lev["rank_bound"]
    assert weighted["fit"]["frequency_weighted"] <= weighted["rank_bound"]["frequency_weighted"] + 1e-6
    assert weighted["rank_bound"]["frequency_weighted"] >= lev["rank_bound"]["frequency_weighted"] - 1e-6


def test_several_learning_rates_keep_the_fit_with_the_lowest_objective(lev_fit, trained_run, tmp_path, capsys):
    out = tmp_path / "fit.json"
    argv = ["--run", str(trained_run("tied-tp2")), "--steps", "30", "--batch", "256", "--json", str(out),
            "--form", "lev=", "--no-noise", "--lr", "1e-6", "3e-3"]  # fmt: skip
    assert lev_fit.main(argv) == 0
    lev = json.loads(out.read_text())["forms"]["lev"]
    tried = lev["lr"]["fit_objective"]
    assert set(tried) == {"1e-06", "0.003"} and tried["0.003"] < tried["1e-06"]  # 1e-6 barely moves from init
    assert lev["lr"]["fit"] == 3e-3
    printed = capsys.readouterr().out
    assert "| lev | 32 | the table | 0.003 |" in printed and "warning" not in printed
    # when the smallest rate wins, the output says a smaller one may do better
    notes = lev_fit.lr_notes({"forms": {"lev": {"lr": {"fit": 1e-3, "noise": 3e-3}}}}, [3e-3, 1e-3])
    assert notes == ["warning: lev (fit): the smallest learning rate tried (0.001) fitted best; "
                     "a smaller one may fit better still."]  # fmt: skip


def test_objective_is_the_weighted_mean_squared_row_error(lev_fit):
    target = torch.zeros(4, 2)
    rows = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [9.0, 9.0]])
    seen = torch.tensor([0, 1, 2])  # row 3 unseen: not counted
    assert lev_fit.objective(target, rows, seen, torch.ones(4)) == pytest.approx((1 + 4 + 9) / 3)
    assert lev_fit.objective(target, rows, seen, torch.tensor([1.0, 0.0, 1.0, 5.0])) == pytest.approx(5.0)


def test_a_lev_run_is_refused(lev_fit, trained_run):
    with pytest.raises(SystemExit, match="is a lev run; give a table run"):
        lev_fit.main(["--run", str(trained_run("lev-tp2")), "--steps", "1"])
