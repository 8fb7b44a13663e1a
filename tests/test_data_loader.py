"""Training data: shard checks (errors name the shard), megatron-core GPTDataset blends, micro-batch order."""

import json
import shutil

import numpy as np
import pytest

from leviathan_pretrain.config import ConfigError, load_config
from leviathan_pretrain.data.datasets import (
    Batches,
    ShardError,
    build_datasets,
    check_data,
    inspect_shard,
    split_bounds,
)
from tests.workers.train_common import CONFIG, TINY, shard
from tests.workers.train_data import write_shard


def cfg_for(tmp_path, prefixes, *extra):
    return load_config(
        CONFIG,
        TINY + [f"data.prefixes=[{','.join(prefixes)}]", f"train.out_dir={tmp_path / 'out'}", "train.steps=10", *extra],
    )


def copy_shard(tmp_path, name="s"):
    dst = str(tmp_path / name)
    for ext in (".bin", ".idx", ".counts.npy"):
        shutil.copy(shard() + ext, dst + ext)
    return dst


def test_inspect_reads_sizes_and_vocab_without_loading():
    info = inspect_shard(shard())
    assert info.num_sequences == 200 and info.num_tokens == int(info.sequence_lengths.sum())
    assert info.vocab_size == 512 and 0 < info.max_token_id < 512
    assert info.num_documents == 200 and not info.sequence_lengths.flags.owndata  # a view of the mapped .idx


@pytest.mark.parametrize("remove", [".bin", ".idx"])
def test_missing_file_is_named(tmp_path, remove):
    p = copy_shard(tmp_path)
    (tmp_path / f"s{remove}").unlink()
    with pytest.raises(ShardError, match=rf"data shard {p}: .*s\{remove} does not exist"):
        check_data(cfg_for(tmp_path, [p]))


def test_empty_and_truncated_shards_fail(tmp_path):
    empty = str(tmp_path / "empty")
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(empty + ".bin", dtype=np.uint16)
    b.finalize(empty + ".idx")
    with pytest.raises(ShardError, match=f"data shard {empty}: empty"):
        check_data(cfg_for(tmp_path, [shard(), empty]))
    p = copy_shard(tmp_path, "trunc")
    with open(p + ".bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ShardError, match=f"data shard {p}: .*truncated"):
        inspect_shard(p)


def test_vocabulary_must_fit_the_model(tmp_path):
    # counts.npy longer than the model vocabulary (shard written by a bigger tokenizer)
    p = write_shard(tmp_path / "big", vocab=1000, docs=20)
    with pytest.raises(
        ShardError, match=rf"data shard {p}: written with a 1000-token vocabulary.*model.vocab_size=512"
    ):
        check_data(cfg_for(tmp_path, [shard(), p]))
    # no counts/manifest: the shard is scanned for its largest id
    (tmp_path / "big.counts.npy").unlink()
    with pytest.raises(ShardError, match=rf"data shard {p}: contains token id \d+, outside model.vocab_size=512"):
        check_data(cfg_for(tmp_path, [p]))
    # a manifest naming the tokenizer's vocabulary is used when there are no counts
    (tmp_path / "big.manifest.json").write_text(json.dumps({"tokenizer": {"vocab_size": 4096}, "eod_id": 2}))
    assert inspect_shard(p, scan_if_unknown=False).vocab_size == 4096


def test_split_that_leaves_no_documents_fails_before_building(tmp_path):
    # 969,30,1 over 200 documents rounds the test split to zero documents (megatron-core would hang)
    assert split_bounds("969,30,1", 200)[2] == (200, 200)
    with pytest.raises(ShardError, match=rf"data shard {shard()}: its test split .* gets no tokens"):
        check_data(cfg_for(tmp_path, [shard()], "data.split=969,30,1"))
    with pytest.raises(ConfigError, match="data.split: .*no validation part"):
        check_data(cfg_for(tmp_path, [shard()], "data.split=100,0,0"))
    with pytest.raises(ConfigError, match="data.prefixes"):
        check_data(cfg_for(tmp_path, []))


@pytest.fixture
def one_rank_group():
    """megatron-core's blended datasets ask torch.distributed for the rank: a 1-process gloo group."""
    import torch.distributed as dist

    from leviathan_pretrain.parallel.ports import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_blend_batches_are_deterministic_and_partition_the_global_batch(tmp_path, one_rank_group):
    a = shard()
    b = write_shard(tmp_path / "b", docs=120, seed=7)
    cfg = cfg_for(tmp_path, [a, b], "data.weights=[1,3]", "train.steps=20")
    check_data(cfg)
    train, valid = build_datasets(cfg, eod=0, needs_data=True)
    assert len(train) >= 20 * 8 and valid is not None
    # the .bin data is memory-mapped, never read into memory
    assert all(ds.dataset.mmap and type(ds.dataset.bin_reader).__name__ == "_MMapBinReader" for ds in train.datasets)
    ids = np.asarray([train[i]["dataset_id"] for i in range(len(train))])
    assert 0.6 < (ids == 1).mean() < 0.9  # weights 1:3
    one = Batches(train, micro_batch=2, dp_size=1, dp_rank=0, global_batch=8)
    two = [Batches(train, micro_batch=2, dp_size=2, dp_rank=r, global_batch=8) for r in (0, 1)]
    assert (one.gas, two[0].gas) == (4, 2)
    for consumed in (0, 8, 64):
        whole = sorted(tuple(row.tolist()) for mb in one.global_batch(consumed) for row in mb["tokens"])
        parts = sorted(tuple(row.tolist()) for r in two for mb in r.global_batch(consumed) for row in mb["tokens"])
        assert whole == parts
    again = Batches(train, 2, 1, 0, 8).global_batch(8)
    assert all((x["tokens"] == y["tokens"]).all() for x, y in zip(one.global_batch(8), again))
    mb = one.global_batch(0)[0]
    assert mb["tokens"].shape == (2, 64) and (mb["labels"][:, :-1] == mb["tokens"][:, 1:]).all()


def test_shard_from_another_tokenizer_is_refused(tmp_path, tokenizer_model):
    p = copy_shard(tmp_path)
    (tmp_path / "s.manifest.json").write_text(
        json.dumps({"tokenizer": {"sha256": "0" * 64, "vocab_size": 512}, "eod_id": 0})
    )
    cfg = cfg_for(tmp_path, [p], f"data.tokenizer={tokenizer_model}", "model.vocab_size=8000")
    want = rf"data shard {p}: tokenized with another tokenizer \(fingerprint 000000000000\.\.\., {p}\.manifest\.json\)"
    with pytest.raises(ShardError, match=want + rf", not with data\.tokenizer={tokenizer_model}"):
        check_data(cfg)
