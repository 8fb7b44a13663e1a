"""The numpy-written shards are megatron-core's format to the byte, and feed its GPTDataset; data_prep.mmidx
reads and writes megatron's index format for every dtype it has."""

import filecmp
import gzip
import json
import struct

import numpy as np
import pytest
import sentencepiece as spm
import torch
import zstandard
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

from data_prep import mmidx


def _megatron_copy(prefix: str, out_prefix: str, dtype) -> list:
    """Write the documents of ``prefix`` again with megatron-core's IndexedDatasetBuilder."""
    ds = IndexedDataset(prefix)
    docs = [np.array(ds[i]) for i in range(len(ds))]
    b = IndexedDatasetBuilder(out_prefix + ".bin", dtype=dtype)
    for d in docs:
        b.add_document(torch.from_numpy(d.astype(np.int64)), [len(d)])
    b.finalize(out_prefix + ".idx")
    return docs


def _same_files(a: str, b: str) -> bool:
    return all(filecmp.cmp(a + ext, b + ext, shallow=False) for ext in (".bin", ".idx"))


def test_uint16_shard_is_byte_identical_to_megatron_builder(minipile_shards, tmp_path):
    ours = minipile_shards["val"]
    _megatron_copy(ours, str(tmp_path / "ref"), np.uint16)
    assert _same_files(ours, str(tmp_path / "ref"))
    with open(ours + ".idx", "rb") as f:
        assert f.read(18)[-1] == 8  # dtype code uint16


def test_int32_shard_is_byte_identical_and_holds_the_same_tokens(
    minipile_dir, tokenizer_model, minipile_shards, tokenize, tmp_path
):
    """Also: the same file gzipped (`.jsonl.gz`) gives the documents of the `.jsonl.zst` shard, token for token."""
    plain = zstandard.ZstdDecompressor().stream_reader(open(minipile_dir / "val.jsonl.zst", "rb")).read()
    gz = tmp_path / "val.jsonl.gz"
    gz.write_bytes(gzip.compress(plain, compresslevel=1))
    prefix = str(tmp_path / "val32")
    tokenize(gz, tokenizer_model, prefix, "--dtype", "int32", timeout=120)
    docs = _megatron_copy(prefix, str(tmp_path / "ref32"), np.int32)
    assert _same_files(prefix, str(tmp_path / "ref32"))
    ds16 = IndexedDataset(minipile_shards["val"])
    assert IndexedDataset(prefix).index.dtype == np.int32
    assert len(docs) == len(ds16) and all((d == ds16[i]).all() for i, d in enumerate(docs))
    assert json.load(open(prefix + ".manifest.json"))["dtype"] == "int32"


def test_200k_vocab_gives_int32_shards_that_round_trip(
    minipile_dir, tokenizer_model_200k, tokenize, tmp_path, read_corpus
):
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model_200k))
    assert sp.vocab_size() == 200000
    prefix = str(tmp_path / "val200k")
    tokenize(minipile_dir / "val.jsonl.zst", tokenizer_model_200k, prefix, timeout=120)
    ds = IndexedDataset(prefix)
    assert ds.index.dtype == np.int32
    texts = [r["text"] for r in read_corpus(minipile_dir / "val.jsonl.zst")]
    assert [sp.decode(ds[i][:-1].tolist()) for i in range(len(ds))] == texts
    counts = np.load(prefix + ".counts.npy")
    assert counts.shape == (200000,) and counts.sum() == sum(len(ds[i]) for i in range(len(ds)))
    docs = _megatron_copy(prefix, str(tmp_path / "ref"), np.int32)
    assert _same_files(prefix, str(tmp_path / "ref")) and max(int(d.max()) for d in docs) > 65535


@pytest.mark.parametrize("code", sorted(mmidx.CODE_DTYPES))
def test_mmidx_reads_and_writes_megatron_indices_of_every_dtype(code, tmp_path):
    dtype = mmidx.CODE_DTYPES[code]
    assert DType.dtype_from_code(code) is dtype and DType.code_from_dtype(dtype) == code
    assert [d.value for d in DType] == sorted(mmidx.CODE_DTYPES)  # megatron's whole table
    lengths = np.array([3, 1, 5], np.int32)
    b = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=dtype)
    for n in lengths:
        b.add_document(torch.arange(int(n)), [int(n)])
    b.finalize(str(tmp_path / "m.idx"))
    index = mmidx.read_index(tmp_path / "m.idx")
    item = np.dtype(dtype).itemsize
    assert index.header.dtype is dtype and index.header.sequences == 3 and index.documents == 3
    assert index.lengths.tolist() == [3, 1, 5] and index.pointers.tolist() == [0, 3 * item, 4 * item]
    lengths.tofile(tmp_path / "lens")
    mmidx.write_index(tmp_path / "ours.idx", dtype, [(str(tmp_path / "lens"), 0, 3)], 3)
    assert filecmp.cmp(tmp_path / "ours.idx", tmp_path / "m.idx", shallow=False)


def test_mmidx_format_errors_name_the_file(tmp_path):
    p = tmp_path / "x.idx"
    p.write_bytes(b"MMIDIDX")
    with pytest.raises(mmidx.IndexFormatError, match=rf"{p}: not a megatron-core MMIDIDX index \(bad header\)"):
        mmidx.read_header(p)
    p.write_bytes(mmidx.INDEX_HEADER + struct.pack("<QBQQ", 1, 9, 0, 1))
    with pytest.raises(mmidx.IndexFormatError, match=rf"{p}: unsupported index version 1 or dtype code 9"):
        mmidx.read_header(p)
    p.write_bytes(mmidx.INDEX_HEADER + struct.pack("<QBQQ", 1, 8, 5, 6))
    assert mmidx.read_header(p).sequences == 5  # the header alone is fine
    size = mmidx.HEADER_SIZE
    with pytest.raises(
        mmidx.IndexFormatError,
        match=rf"{p}: truncated index \({size} bytes, header promises "
        rf"{size + 5 * 12 + 6 * 8}\)",
    ):
        mmidx.read_index(p)


class _TokenIds:
    """What GPTDataset needs of a tokenizer: vocab size, EOD id, pad id."""

    def __init__(self, vocab_size: int, eod: int):
        self.vocab_size, self.eod, self.pad = vocab_size, eod, -1
        self.unique_identifiers = {"class": "test", "vocab_size": vocab_size, "eod": eod}


def _gpt_datasets(blend, sizes: list, manifest: dict, **options):
    """megatron-core's train/valid/test GPTDatasets over ``blend`` (prefixes, weights), with the shards'
    vocabulary and EOD id from ``manifest``; ``options``: the rest of the GPTDatasetConfig (seed, split, ...)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    cfg = GPTDatasetConfig(
        blend=blend,
        tokenizer=_TokenIds(manifest["tokenizer"]["vocab_size"], manifest["eod_id"]),
        reset_position_ids=False,
        reset_attention_mask=False,
        create_attention_mask=False,
        mmap_bin_files=True,
        **options,
    )
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, cfg).build()


def _runs_are_document_slices(tokens: np.ndarray, docs: list, eod: int) -> bool:
    """Every EOD-free run of a sample is a contiguous slice of one document."""
    blobs = [d[:-1].astype(np.int32).tobytes() for d in docs]
    cuts = np.flatnonzero(tokens == eod)
    for run in np.split(tokens, cuts):
        run = run[run != eod].astype(np.int32)
        if len(run) == 0:
            continue
        needle = run.tobytes()
        if not any(b.find(needle) % 4 == 0 for b in blobs if needle in b):
            return False
    return True


@pytest.mark.timeout(240)
def test_split_by_set_shards_feed_a_blended_gpt_dataset(minipile_dir, tokenizer_model, tokenize, tmp_path):
    prefix = str(tmp_path / "sets")
    inputs = [minipile_dir / "val.jsonl.zst", minipile_dir / "test.jsonl.zst"]
    tokenize(inputs, tokenizer_model, prefix, "--split-by-set", timeout=120)
    m = json.load(open(prefix + ".manifest.json"))
    outs = {o["set"]: o["prefix"] for o in m["outputs"]}
    assert sorted(outs) == ["Dictionary", "Github", "PythonDocs"]
    assert outs["Github"] == prefix + ".Github"
    for name, p in outs.items():  # each shard: that set's documents, none empty
        ds = IndexedDataset(p)
        assert len(ds) == m["sets"][name]["documents"] > 0
        assert ds.sequence_lengths.min() >= 2
    total = sum(np.load(outs[s] + ".counts.npy") for s in outs)
    assert (np.load(prefix + ".counts.npy") == total).all() and total.sum() == m["tokens"]

    eod, seq = m["eod_id"], 64
    # no index cache: megatron-core's BlendedDataset asks torch.distributed for the rank when caching
    train, valid, test = _gpt_datasets(
        ([outs["Github"], outs["Dictionary"], outs["PythonDocs"]], [0.5, 0.3, 0.2]),
        [400, 40, 0],
        m,
        random_seed=1234,
        sequence_length=seq,
        path_to_cache=None,
        split="90,10,0",
        eod_mask_loss=False,
    )
    assert len(train) >= 400 and len(valid) >= 40 and test is None
    all_docs = []
    for p in outs.values():
        ds = IndexedDataset(p)  # keep it alive while reading: its __del__ unmaps the file
        all_docs += [np.array(ds[i]) for i in range(len(ds))]
    for i in range(0, 400, 37):
        s = train[i]
        toks = np.asarray(s["tokens"])
        assert toks.shape == (seq,) and toks.max() < m["tokenizer"]["vocab_size"]
        assert (np.asarray(s["labels"])[:-1] == toks[1:]).all()
        assert _runs_are_document_slices(np.append(toks, s["labels"][-1]), all_docs, eod)


@pytest.mark.timeout(240)
def test_minipile_train_shard_feeds_gpt_dataset(minipile_shards, tokenizer_model, tmp_path):
    m = json.load(open(minipile_shards["train"] + ".manifest.json"))
    train, valid, _ = _gpt_datasets(
        ([minipile_shards["train"]], None),
        [2000, 100, 0],
        m,
        random_seed=7,
        sequence_length=256,
        path_to_cache=str(tmp_path / "cache"),
        split="98,2,0",
        eod_mask_loss=True,
    )
    assert len(train) >= 2000 and len(valid) >= 100
    s = train[1999]
    toks = np.asarray(s["tokens"])
    loss_mask = np.asarray(s["loss_mask"])
    assert toks.shape == (256,) and ((toks == m["eod_id"]) == (loss_mask == 0)).all()
