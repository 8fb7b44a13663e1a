"""build_data_cache: it builds exactly the index cache the trainer uses (the trainer's build then only loads it
and yields the same samples), remembers max-id scans, reports a changed config as a miss, never overwrites or
deletes what it did not create. Real megatron-core, real shards, in-process (seconds each)."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from leviathan_pretrain import build_data_cache as B
from leviathan_pretrain.config import ConfigError, load_config
from leviathan_pretrain.data import datasets as D
from leviathan_pretrain.data import index_cache as C
from leviathan_pretrain.parallel import groups
from tests.workers.train_common import CONFIG, TINY, shard
from tests.workers.train_data import write_shard


def overrides(tmp_path, prefixes, *extra) -> list[str]:
    return TINY + [
        f"data.prefixes=[{','.join(prefixes)}]",
        f"train.out_dir={tmp_path / 'out'}",
        "train.steps=10",
        *extra,
    ]


def build(args, *flags) -> int:
    return B.main(["--config", CONFIG, *args, *flags])


def snapshot(d: Path) -> dict:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in d.iterdir()}


def trainer_build(cfg):
    """What every rank of the trainer does: rank 0's checks give the EOD id, then build_datasets."""
    eod = D.data_summary(cfg)["eod_id"]
    with groups.one_process_group():
        return D.build_datasets(cfg, eod, needs_data=True)


def test_prebuilt_cache_is_hit_by_the_trainer_and_gives_the_same_samples(tmp_path, capsys):
    b = write_shard(tmp_path / "b", docs=120, seed=7)
    args = overrides(tmp_path, [shard(), b], "data.weights=[1,3]")  # a blend: BlendedDataset indices too
    assert build(args, "--report", str(tmp_path / "report.json")) == 0
    out = capsys.readouterr().out
    cdir = tmp_path / "out" / "data_cache"
    rep = json.loads((tmp_path / "report.json").read_text())
    assert rep["cache_dir"] == str(cdir) and rep["files"] and all(f["built"] for f in rep["files"].values())
    assert {"import megatron-core", "shard checks (data_summary)", "index build or load (megatron-core)"} <= set(
        rep["steps_s"]
    ) and rep["peak_rss_mib"] > 0
    assert f"cache dir {cdir}" in out and "peak RSS" in out and "BlendedDataset" in out
    assert not [p for p in cdir.iterdir() if p.name.startswith(".")]  # no staging folder or temp file left
    before = snapshot(cdir)

    cfg = load_config(CONFIG, args)
    assert C.cache_status(cfg, 0) == (True, "")
    train, valid = trainer_build(cfg)
    out = capsys.readouterr().out
    assert f"[data] using the prebuilt data index cache {cdir}" in out and "missing" not in out
    assert snapshot(cdir) == before  # nothing new, nothing rewritten

    fresh = load_config(CONFIG, args + [f"data.cache_dir={tmp_path / 'fresh'}"])
    assert not C.cache_status(fresh, 0)[0]
    train2, valid2 = trainer_build(fresh)
    out = capsys.readouterr().out
    assert f"[data] building the data index cache in {tmp_path / 'fresh'} (first start;" in out
    assert "python -m leviathan_pretrain.build_data_cache with this command's" in out
    assert sorted(p.name for p in (tmp_path / "fresh").iterdir() if "Dataset-" in p.name) == sorted(
        n for n in before if "Dataset-" in n
    )  # the same index files, by name
    assert C.cache_status(fresh, 0) == (True, "")  # the trainer stamped its own build
    assert len(train) == len(train2) >= 80 and len(valid) == len(valid2)
    for a, z in ((train, train2), (valid, valid2)):
        for i in range(len(a)):
            assert np.array_equal(a[i]["tokens"], z[i]["tokens"]) and a[i]["dataset_id"] == z[i]["dataset_id"]


def test_max_id_scan_runs_once(tmp_path, monkeypatch, capsys):
    p = write_shard(tmp_path / "nocounts", docs=80, counts=False)  # no counts.npy, no manifest
    args = overrides(tmp_path, [p])
    real, calls = D._scan_max_id, []
    monkeypatch.setattr(D, "_scan_max_id", lambda *a: calls.append(a) or real(*a))
    assert build(args) == 0
    assert len(calls) == 1 and "(from scan)" in capsys.readouterr().out
    scans = json.loads((tmp_path / "out" / "data_cache" / D.SCANS).read_text())["shards"]
    assert list(scans) == [str(Path(p + ".bin").resolve())]
    max_id = next(iter(scans.values()))["max_token_id"]

    def rescan(*a):
        raise AssertionError("the shard was scanned again")

    monkeypatch.setattr(D, "_scan_max_id", rescan)
    assert build(args) == 0  # build_data_cache again
    assert "(from scan cache)" in capsys.readouterr().out
    summary = D.data_summary(load_config(CONFIG, args))  # the trainer's rank-0 check
    assert summary["shards"][p]["max_token_id"] == max_id and summary["shards"][p]["max_id_source"] == "scan cache"
    st = os.stat(p + ".bin")  # a rewritten shard is scanned again
    os.utime(p + ".bin", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    with pytest.raises(AssertionError, match="scanned again"):
        D.data_summary(load_config(CONFIG, args))


def test_changed_config_is_a_cache_miss(tmp_path, capsys):
    args = overrides(tmp_path, [shard()])
    assert build(args) == 0
    capsys.readouterr()
    cfg = load_config(CONFIG, args + ["train.steps=20"])
    complete, why = C.cache_status(cfg, 0)
    assert not complete and "built for another configuration" in why and "[80, 16] -> [160, 16]" in why
    with pytest.raises(
        ConfigError,
        match=r"data.require_prebuilt_cache: no complete prebuilt data index cache in "
        r".*data_cache .*build it first with: python -m "
        r"leviathan_pretrain.build_data_cache",
    ):
        D.build_datasets(load_config(CONFIG, args + ["train.steps=20", "data.require_prebuilt_cache=true"]), 0, True)
    trainer_build(cfg)
    out = capsys.readouterr().out
    assert "is missing or incomplete (it was built for another configuration (samples" in out
    assert C.cache_status(cfg, 0)[0] and C.cache_status(load_config(CONFIG, args), 0)[0]  # both stamped now
    # another sequence length or seed is a miss as well
    for extra in ("model.seq_length=32", "data.seed=7"):
        assert not C.cache_status(load_config(CONFIG, args + [extra]), 0)[0]


def test_foreign_and_damaged_files_are_left_alone(tmp_path, capsys):
    cdir = tmp_path / "out" / "data_cache"
    cdir.mkdir(parents=True)
    (cdir / "notes.txt").write_text("mine")
    args = overrides(tmp_path, [shard()])
    assert build(args) == 0
    assert (cdir / "notes.txt").read_text() == "mine"
    victim = next(p for p in cdir.iterdir() if p.name.endswith("-sample_index.npy"))
    with open(victim, "r+b") as f:  # an earlier build killed mid-write
        f.truncate(victim.stat().st_size // 2)
    damaged = snapshot(cdir)
    assert "missing or changed" in C.cache_status(load_config(CONFIG, args), 0)[1]
    assert build(args) == 2
    assert f"{victim} already exists but is damaged" in capsys.readouterr().err
    assert snapshot(cdir) == damaged  # nothing replaced, nothing deleted


def test_cli_errors_name_the_key_or_shard(tmp_path, capsys, run_cli):
    assert build(overrides(tmp_path, [shard()], "data.no_such_key=1")) == 2
    assert "data.no_such_key" in capsys.readouterr().err
    assert build(overrides(tmp_path, [str(tmp_path / "missing")])) == 2
    assert f"data shard {tmp_path / 'missing'}" in capsys.readouterr().err
    help_text = run_cli("leviathan_pretrain.build_data_cache", "--help", timeout=60).stdout
    assert "examples:" in help_text and "python -m leviathan_pretrain.build_data_cache --config" in help_text
