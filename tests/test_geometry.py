"""The token-vector geometry (leviathan_pretrain/model/geometry.py): its four numbers on rows whose answer is known,
and the rows it reads off every variant's model (TP = 1, one process)."""

from __future__ import annotations

import math

import pytest
import torch

from leviathan_pretrain.config import VARIANTS
from leviathan_pretrain.model import geometry as G
from leviathan_pretrain.parallel.groups import seed_everything
from tests.multiproc import one_rank_world
from tests.test_model import make, small


def test_isotropic_rows():
    x = torch.randn(2000, 256, generator=torch.Generator().manual_seed(0))
    g = G.row_geometry(x)
    assert g["rows"] == 2000 and g["width"] == 256
    assert g["rms"] == pytest.approx(1.0, abs=0.01)
    assert abs(g["cosine"]) < 0.002
    assert g["mean_share"] == pytest.approx(1 / math.sqrt(2000), rel=0.1)
    assert 200 < g["eff_rank"] <= 256


def test_one_shared_direction():
    gen = torch.Generator().manual_seed(1)
    v = torch.randn(256, generator=gen)
    x = v + 0.001 * torch.randn(500, 256, generator=gen)
    g = G.row_geometry(x)
    assert g["cosine"] > 0.99 and g["mean_share"] > 0.99 and g["eff_rank"] < 1.5


def test_orthonormal_rows_have_full_effective_rank_and_no_cosine():
    g = G.row_geometry(torch.eye(64))
    assert g["eff_rank"] == pytest.approx(64.0) and g["cosine"] == pytest.approx(0.0, abs=1e-12)
    assert g["mean_share"] == pytest.approx(1 / math.sqrt(64))
    assert G.row_geometry(torch.zeros(0, 8))["rms"] is None


def test_samples_are_seeded_sorted_and_from_the_pool():
    pool = torch.arange(10, 50000, 3)
    a, b = G.sample_ids(pool, 100), G.sample_ids(pool, 100)
    assert torch.equal(a, b) and torch.equal(a, a.sort().values) and a.numel() == 100
    assert set(a.tolist()) <= set(pool.tolist())
    assert not torch.equal(a, G.sample_ids(pool, 100, seed=G.SEED + 1))
    assert torch.equal(G.sample_ids(torch.tensor([5, 2, 9]), 100), torch.tensor([2, 5, 9]))


def test_bucket_ids_partition_the_vocabulary_by_training_frequency():
    counts = torch.tensor([0, 1, 10, 100, 1000, 0, 5, 8884])  # total 10,000
    specs = [("< 1e-3", 0.0, 1e-3), ("1e-3 - 1e-1", 1e-3, 1e-1), (">= 1e-1", 1e-1, 1.0)]
    got = {name: ids.tolist() for name, ids in G.bucket_ids(counts, specs)}
    assert got == {"unseen": [0, 5], "< 1e-3": [1, 6], "1e-3 - 1e-1": [2, 3], ">= 1e-1": [4, 7]}


@pytest.fixture(scope="module")
def world():
    with one_rank_world(small("lev").parallel) as env:
        yield env


@pytest.mark.parametrize("variant", VARIANTS)
def test_rows_of_every_variant(world, variant):
    seed_everything(3, world.device)
    model = make(small(variant))
    ids = torch.tensor([0, 7, 999])
    x, h = G.input_rows(model, ids), G.head_rows(model, ids)
    assert x.shape == h.shape == (3, 64) and x.dtype == h.dtype == torch.float32
    if variant == "tied":
        assert torch.equal(x, h)  # one table
    else:
        assert not torch.equal(x, h)
    hidden = model.input_layer(input_ids=ids[None], position_ids=torch.arange(3)[None])  # [s, b, D]
    assert torch.allclose(hidden[:, 0].float(), x, atol=1e-6)  # the rows are what the model's input computes
    g = G.geometry(model, 1000, [("some", torch.tensor([1, 2, 3, 4])), ("none", torch.tensor([], dtype=torch.long))])
    assert g["input"]["rows"] == g["head"]["rows"] == 1000  # the sample is capped by the vocabulary
    assert [b["name"] for b in g["input"]["buckets"]] == ["some", "none"]
    assert g["input"]["buckets"][0]["types"] == 4 and g["input"]["buckets"][1]["rms"] is None
    assert "effective rank" in G.summary(g)
