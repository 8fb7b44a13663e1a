"""The 7B configs' plan on 8 nodes x 8 H100-80GB through ``launchers.slurm submit --dry-run`` (in this process), and the
layouts a refused geometry proposes (leviathan_pretrain/plan/layouts.py): each one, passed back, plans a fit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from launchers.slurm import main as slurm_main
from leviathan_pretrain.config import load_config
from leviathan_pretrain.plan.planner import GIB, fitting_layouts, format_plan, make_plan

REPO = Path(__file__).resolve().parents[1]
GRID = ["--nodes", "8", "--gpus-per-node", "8"]  # --gpu-mem-gb 80 (H100-80GB) is the default
TOO_SMALL = ["parallel.tensor_parallel=1", "parallel.sequence_parallel=false", "model.recompute=none"]


@pytest.fixture
def shards(tmp_path):
    prefix = tmp_path / "pile_train"
    for ext in (".bin", ".idx"):
        prefix.with_suffix(ext).write_bytes(b"")  # the dry run checks that they exist, nothing more
    return f"data.prefixes=[{prefix}]"


def dry_run(capsys, tmp_path, variant, shards, *overrides) -> tuple[int, str, str]:
    argv = ["submit", "--config", str(REPO / f"configs/7b-{variant}.yaml"), *GRID, "--run", str(tmp_path / "run")]
    rc = slurm_main([*argv, shards, "--dry-run", *overrides])
    out = capsys.readouterr()
    return rc, out.out, out.err


def total_gib(text: str) -> float:
    return float(re.search(r"^  total +([\d.]+) of 80 \(", text, re.M).group(1))


def suggested(text: str) -> list[list[str]]:
    """The overrides of each layout a refusal proposes (``    55.8 GiB: key=value ...``)."""
    return [line.split(": ", 1)[1].split() for line in text.splitlines() if re.match(r"^    [\d.]+ GiB: ", line)]


@pytest.mark.parametrize("variant", ["lev", "tied"])
def test_7b_dry_run_on_8x8_h100_plans_a_fit_with_sequence_parallelism(capsys, tmp_path, shards, variant):
    rc, out, err = dry_run(capsys, tmp_path, variant, shards)
    assert rc == 0, err
    plan = out[: out.index("#!/bin/bash")]
    assert "TP 2 x PP 1 x DP 32" in plan and "4,194,304 tokens/step" in plan
    assert "sequence parallel on; recompute none)" in plan and "problems: none" in plan
    assert 40 < total_gib(plan) < 80 * 0.9  # ~10% headroom for what the estimate does not count
    assert "#SBATCH --nodes=8" in out and "#SBATCH --gpus-per-node=8" in out


def test_a_geometry_that_does_not_fit_is_refused_naming_layouts_that_do(capsys, tmp_path, shards):
    rc, out, err = dry_run(capsys, tmp_path, "lev", shards, *TOO_SMALL)
    assert rc == 2 and out == ""
    assert "problem: --gpu-mem-gb: estimated 93.5 GiB per GPU" in err and "exceeds 80 GiB" in err
    assert "layouts that fit on 8 x 8 GPUs (ZeRO 1, micro batch 2, global batch 2048), cheapest first" in err
    layouts = suggested(err)
    assert 1 <= len(layouts) <= 3
    assert layouts[0] == [
        "parallel.tensor_parallel=2",
        "parallel.pipeline_parallel=1",
        "parallel.sequence_parallel=false",
        "model.recompute=none",
    ]
    for over in layouts:  # pasted after the refused command line, each one plans a fit
        rc, out, err = dry_run(capsys, tmp_path, "lev", shards, *TOO_SMALL, *over)
        assert rc == 0, err
        assert total_gib(out) < 80


def test_sequence_parallelism_is_proposed_where_only_it_fits():
    """A tighter GPU (52 GiB): TP 2 without SP (55.8 GiB) no longer fits, with SP (50.7) it does, and no recompute
    beats a larger TP x PP: SP first; then the cheapest layouts without recompute that fit."""
    cfg = load_config(REPO / "configs/7b-lev.yaml", ["parallel.sequence_parallel=false"])
    plan = make_plan(cfg, 8, 8, mem_limit_gb=52)
    (problem,) = plan.problems
    assert "parallel.sequence_parallel=true (divides the norms' and residuals' activations by TP)" in problem
    assert "model.recompute=selective model.recompute_modules=[mlp]" in problem  # the recompute hint
    first = suggested(problem)[0]
    assert first == [
        "parallel.tensor_parallel=2",
        "parallel.pipeline_parallel=1",
        "parallel.sequence_parallel=true",
        "model.recompute=none",
    ]
    fits = make_plan(load_config(REPO / "configs/7b-lev.yaml", first), 8, 8, mem_limit_gb=52)
    assert fits.problems == [] and fits.sequence_parallel and "sequence parallel on" in format_plan(fits)
    again = make_plan(cfg, 8, 8, mem_limit_gb=52)  # deterministic
    assert again.problems == plan.problems


def test_fitting_layouts_order_and_validity():
    cfg = load_config(REPO / "configs/7b-tied.yaml")
    fits, smallest = fitting_layouts(cfg, 8, 8, mem_limit_gb=40, count=10)
    assert fits and all(lay.total <= 40 * GIB for lay in fits)
    rank = {"none": 0, "selective": 1, "full": 2}
    keys = [(rank[lay.recompute], lay.tp * lay.pp, lay.pp, lay.sp) for lay in fits]
    assert keys == sorted(keys)
    assert len({(lay.tp, lay.pp, lay.recompute) for lay in fits}) == len(fits)  # one per (TP, PP, recompute)
    assert all(lay.tp in (2, 4, 8) or not lay.sp for lay in fits) and all(32 % lay.pp == 0 for lay in fits)
    assert smallest.total <= min(lay.total for lay in fits)
    for lay in fits:
        again = make_plan(load_config(REPO / "configs/7b-tied.yaml", list(lay.overrides)), 8, 8, mem_limit_gb=40)
        assert again.problems == [] and again.memory["total"] == lay.total
    # LEV's 8 heads: TP 16 is never tried (at most the 8 GPUs of a node), and 2 GPUs a node allow TP <= 2
    two = fitting_layouts(load_config(REPO / "configs/7b-lev.yaml"), 32, 2, count=10)[0]
    assert two and {lay.tp for lay in two} <= {1, 2}


def test_no_layout_fits_names_the_smallest():
    cfg = load_config(REPO / "configs/7b-lev.yaml", ["train.micro_batch_size=8", "train.global_batch_size=16"])
    plan = make_plan(cfg, 1, 2)  # one node of 2 GPUs cannot hold a 7B model with Adam states
    (problem,) = plan.problems
    assert "no layout (TP 1-8 x PP x sequence parallel x recompute none/selective/full) fits on 1 x 2 GPUs" in problem
    assert "the smallest" in problem and "use more nodes" in problem
