"""Training data: megatron-core ``GPTDataset`` blends over ``.bin/.idx`` shards, checked before training.

- :func:`inspect_shard` reads a shard's ``.idx`` header and sizes (never the token data) and its vocabulary
  from ``PREFIX.counts.npy`` / ``PREFIX.manifest.json`` (written by ``data_prep``); a shard without them
  is scanned once for its largest token id, in 64 MiB slices of the memory map.
- :func:`check_data` fails before training, with a :class:`ShardError` naming the shard, for a missing,
  empty or truncated shard, a vocabulary that does not fit ``model.vocab_size``, or a train/valid split
  that leaves a requested split without tokens (megatron-core would loop forever on it).
- :func:`build_datasets` builds the train and validation splits with ``BlendedMegatronDatasetBuilder``
  (weights per prefix, seeded shuffling, index cache in ``data.cache_dir``; rank 0 builds the cache first).
  ``python -m leviathan_pretrain.build_data_cache`` builds the same cache ahead of training in one CPU
  process; it stamps the cache dir (:mod:`.index_cache`) and rank 0 says whether the trainer found it complete.
  Max-token-id scans of shards without ``counts.npy`` are remembered in ``leviathan_shard_scans.json``
  there (keyed by path, size and mtime), so a scan happens once per shard, not once per start.
- :class:`Batches` turns "samples consumed so far" into this rank's micro-batches. Sample ``i`` of the run is
  always ``train_ds[i]``: a global batch is ``[consumed, consumed + global_batch)``, micro-batch ``k`` of
  data-parallel rank ``r`` is its slice ``k * micro * dp + r * micro``. Every rank that needs data (all
  tensor-parallel ranks of the first and last pipeline stages) reads the same samples from the same memory
  map, so no broadcast is needed and a resumed run sees exactly the samples an uninterrupted run would.
  Given ``prepare`` (the PP = 1 engine's :meth:`ModelEngine.prepare` in trainer/engine.py, :mod:`.transfer`), each
  micro-batch is handed over prepared for the device: packed into one (pinned, on CUDA) host buffer, with its
  unique ids made here on the host.
- :mod:`.prefetch`'s ``Prefetcher`` builds the next global batch one ahead on one background thread while the
  current step runs (``data.prefetch``): the same batches, by position, raised errors and all, at the step that
  uses them.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from common.fileio import read_json
from data_prep.mmidx import IndexFormatError, read_index
from leviathan_pretrain.config import Config, ConfigError, split_weights
from leviathan_pretrain.config.parallel import accumulation_steps
from leviathan_pretrain.data.index_cache import (
    atomic_write_text,
    cache_dir,
    cache_status,
    command_for,
    file_key,
    index_files,
    write_stamp,
)

SCAN_BYTES = 64 << 20
SCANS = "leviathan_shard_scans.json"  # in the cache dir: max token ids of scanned shards


class ShardError(ValueError):
    """A data shard is missing, empty, malformed or does not fit the model; the message names it."""


@dataclass
class ShardInfo:
    prefix: str
    num_sequences: int
    num_documents: int
    num_tokens: int
    dtype: type
    vocab_size: int | None  # tokenizer vocabulary the shard was written with, when recorded
    max_token_id: int | None  # largest token id present, when known
    sequence_lengths: np.ndarray  # memory-mapped int32 [num_sequences]
    manifest: dict
    max_id_source: str | None = None  # "counts", "scan", "scan cache" or None (unknown)


def _scan_max_id(bin_path: Path, dtype) -> int:
    """Largest token id in a shard, read in 64 MiB blocks into one reused buffer (memory stays ~64 MiB even
    for a multi-hundred-GB shard: no memory map whose touched pages would count as resident)."""
    item = np.dtype(dtype).itemsize
    buf = np.empty(max(1, SCAN_BYTES // item), dtype=dtype)
    best = None
    with open(bin_path, "rb") as f:  # buffered: readinto fills the block unless at EOF
        while True:
            n = f.readinto(memoryview(buf).cast("B")) // item
            if n <= 0:
                break
            m = int(buf[:n].max())
            best = m if best is None else max(best, m)
    if best is None:
        raise ShardError(f"{bin_path}: no token data to scan")
    return best


def _warn(msg: str) -> None:
    print(f"[data] warning: {msg}", file=sys.stderr, flush=True)


def _scan_cached(bin_path: Path, dtype, cache: Path | None) -> tuple[int, str]:
    """The shard's largest token id from the scan record in ``cache`` (same path, size, mtime and dtype),
    else from a scan, which is then recorded there (atomically; an unwritable cache only warns)."""
    if cache is None:
        return _scan_max_id(bin_path, dtype), "scan"
    key, me = str(bin_path.resolve()), {**file_key(bin_path), "dtype": np.dtype(dtype).name}
    hit = read_json(cache / SCANS).get("shards", {}).get(key)
    if (
        isinstance(hit, dict)
        and isinstance(hit.get("max_token_id"), int)
        and all(hit.get(k) == v for k, v in me.items())
    ):
        return hit["max_token_id"], "scan cache"
    max_id = _scan_max_id(bin_path, dtype)
    table = read_json(cache / SCANS).get("shards", {})  # re-read: another process may have added one
    table = table if isinstance(table, dict) else {}
    table[key] = {**me, "max_token_id": max_id}
    try:
        atomic_write_text(cache / SCANS, json.dumps({"format": 1, "shards": table}, indent=1, sort_keys=True))
    except OSError as e:
        _warn(f"could not record the scan of {bin_path} in {cache / SCANS} ({e}); the next start scans again")
    return max_id, "scan"


def find_manifest(prefix: str) -> dict:
    """``PREFIX.manifest.json``, or for a per-set shard ``BASE.<set>`` the ``BASE.manifest.json`` listing it."""
    candidates = [Path(prefix + ".manifest.json")]
    if "." in Path(prefix).name:
        candidates.append(Path(prefix.rsplit(".", 1)[0] + ".manifest.json"))
    for i, mpath in enumerate(candidates):
        if not mpath.is_file():
            continue
        try:
            m = json.loads(mpath.read_text())
        except ValueError as e:
            raise ShardError(f"data shard {prefix}: {mpath} is not valid JSON ({e})") from None
        if i == 0 or any(
            o.get("prefix") == prefix or Path(str(o.get("prefix"))).name == Path(prefix).name
            for o in m.get("outputs", [])
        ):
            return m
    return {}


def inspect_shard(prefix: str, scan_if_unknown: bool = True, scan_cache: str | Path | None = None) -> ShardInfo:
    """Sizes, dtype and vocabulary of one shard; raises :class:`ShardError` naming what is wrong.

    Without ``PREFIX.counts.npy`` the ``.bin`` is scanned for its largest id (``scan_if_unknown``); with
    ``scan_cache`` (a directory) the scan result is looked up there first and recorded there after a scan."""
    for ext in (".idx", ".bin"):
        if not Path(prefix + ext).is_file():
            raise ShardError(f"data shard {prefix}: {prefix + ext} does not exist")
    try:
        index = read_index(Path(prefix + ".idx"))
    except IndexFormatError as e:
        raise ShardError(str(e)) from None
    dtype, lengths, pointers, n_doc = index.header.dtype, index.lengths, index.pointers, index.documents
    n_tok = int(lengths.sum(dtype=np.int64))
    if len(lengths) == 0 or n_tok == 0:
        raise ShardError(f"data shard {prefix}: empty (0 sequences or 0 tokens)")
    bin_path = Path(prefix + ".bin")
    need = int(pointers[-1]) + int(lengths[-1]) * np.dtype(dtype).itemsize
    if bin_path.stat().st_size < need:
        raise ShardError(
            f"data shard {prefix}: {bin_path} is truncated ({bin_path.stat().st_size} bytes, the index needs {need})"
        )
    manifest = find_manifest(prefix)
    vocab, max_id, source = manifest_tokenizer(manifest).get("vocab_size", manifest.get("vocab_size")), None, None
    cpath = Path(prefix + ".counts.npy")
    if cpath.is_file():
        counts = np.load(cpath, mmap_mode="r", allow_pickle=False)
        vocab = int(counts.shape[0])
        nz = np.flatnonzero(counts)
        max_id, source = (int(nz[-1]) if len(nz) else None), "counts"
    elif scan_if_unknown:
        max_id, source = _scan_cached(bin_path, dtype, None if scan_cache is None else Path(scan_cache))
    return ShardInfo(
        prefix,
        len(lengths),
        n_doc,
        n_tok,
        dtype,
        None if vocab is None else int(vocab),
        max_id,
        lengths,
        manifest,
        source,
    )


def manifest_tokenizer(manifest: dict) -> dict:
    """The ``tokenizer`` section of a data_prep manifest (``{}`` if there is none)."""
    tok = manifest.get("tokenizer")
    return tok if isinstance(tok, dict) else {}


def check_vocab(info: ShardInfo, model_vocab: int) -> None:
    if info.vocab_size is not None and info.vocab_size > model_vocab:
        raise ShardError(
            f"data shard {info.prefix}: written with a {info.vocab_size}-token vocabulary, larger "
            f"than model.vocab_size={model_vocab}; use the matching model.vocab_size or re-tokenize"
        )
    if info.max_token_id is not None and info.max_token_id >= model_vocab:
        raise ShardError(
            f"data shard {info.prefix}: contains token id {info.max_token_id}, outside model.vocab_size={model_vocab}"
        )


def split_bounds(split: str, n: int) -> list[tuple[int, int] | None]:
    """The [begin, end) sequence range of each split of an n-sequence shard, exactly as megatron-core cuts it."""
    from megatron.core.datasets.blended_megatron_dataset_config import convert_split_vector_to_split_matrix
    from megatron.core.datasets.utils import normalize

    out = []
    for b in convert_split_vector_to_split_matrix(normalize(split_weights(split))):
        out.append(None if b is None else (int(round(b[0] * float(n))), int(round(b[1] * float(n)))))
    return out


def sample_counts(cfg: Config) -> list[int]:
    """Samples drawn per split: the whole run; a fixed validation set of ``eval_iters`` global batches."""
    g = cfg.train.global_batch_size
    return [cfg.train.steps * g, cfg.train.eval_iters * g, cfg.train.eval_iters * g]


def tokenizer_identity(cfg: Config) -> dict:
    """``{"fingerprint", "sha256"}`` of ``data.tokenizer`` (both None if unset): the fingerprint (the file's sha256,
    plus the pattern and specials for tiktoken) is checked against the shards and recorded in checkpoints."""
    from leviathan_pretrain.data.tokenizer import open_data_tokenizer

    tok = open_data_tokenizer(cfg.data)
    if tok is None:
        return {"fingerprint": None, "sha256": None}
    return {"fingerprint": tok.fingerprint, "sha256": tok.file_sha256}


def manifest_fingerprint(manifest: dict) -> str | None:
    """The tokenizer fingerprint a shard's manifest records (older manifests: SentencePiece's file sha256, which is
    its fingerprint)."""
    t = manifest_tokenizer(manifest)
    return t.get("fingerprint") or t.get("sha256")


def _is_shard(prefix: str) -> bool:
    return all(Path(prefix + ext).is_file() for ext in (".idx", ".bin"))


def check_suffixes(key: str, prefixes: list[str]) -> None:
    """A ShardError ending with the corrected list when a prefix given as ``X.bin``/``X.idx`` names shard ``X``."""
    for p in prefixes:
        if p.endswith((".bin", ".idx")) and not _is_shard(p) and _is_shard(p[:-4]):
            fixed = [q[:-4] if q.endswith((".bin", ".idx")) and _is_shard(q[:-4]) else q for q in prefixes]
            raise ShardError(
                f"data shard {p}: {p}.idx does not exist; {key} takes the prefix without .bin/.idx: "
                f"{key}=[{','.join(fixed)}]"
            )


def check_data(cfg: Config, tok_fp: str | None = None) -> dict[str, ShardInfo]:
    """Every shard exists, is non-empty, fits the model's vocabulary, was written with ``data.tokenizer``
    (``tok_fp``: its fingerprint, computed here if not given), and every used split has tokens."""
    d = cfg.data
    if not d.prefixes:
        raise ConfigError("data.prefixes: no training shards given (a list of .bin/.idx prefixes)")
    for key, given in (("data.prefixes", d.prefixes), ("data.valid_prefixes", d.valid_prefixes or [])):
        check_suffixes(key, list(given))
    infos = {}
    tok_fp = tok_fp or tokenizer_identity(cfg)["fingerprint"]
    for p in list(d.prefixes) + list(d.valid_prefixes or []):
        if p not in infos:
            infos[p] = inspect_shard(p, scan_cache=cache_dir(cfg))
            check_vocab(infos[p], cfg.model.vocab_size)
            shard_fp = manifest_fingerprint(infos[p].manifest)
            if tok_fp and shard_fp and shard_fp != tok_fp:
                used = manifest_tokenizer(infos[p].manifest).get("path") or "another tokenizer"
                raise ShardError(
                    f"data shard {p}: tokenized with {used} (fingerprint {shard_fp[:12]}..., {p}.manifest.json), "
                    f"not with data.tokenizer={d.tokenizer} ({tok_fp[:12]}...): another or a changed tokenizer; "
                    "use the shards' tokenizer or re-tokenize"
                )
    want_valid = cfg.train.eval_interval > 0
    if d.valid_prefixes is None:
        names = ("train", "valid", "test")
        weights = split_weights(d.split)
        if want_valid and weights[1] == 0:
            raise ConfigError(
                f"data.split: {d.split!r} has no validation part; give it one, set "
                "data.valid_prefixes, or set train.eval_interval=0"
            )
        for p in d.prefixes:
            lengths = infos[p].sequence_lengths
            for name, bounds in zip(names, split_bounds(d.split, len(lengths))):
                if bounds is None:
                    continue
                if int(lengths[bounds[0] : bounds[1]].sum(dtype=np.int64)) == 0:
                    raise ShardError(
                        f"data shard {p}: its {name} split ({d.split!r}) gets no tokens "
                        f"(documents {bounds[0]}:{bounds[1]} of {len(lengths)}); use a larger "
                        f"shard or another data.split"
                    )
    return infos


class _TokenIds:
    """The few tokenizer facts GPTDataset needs (it never tokenizes: the shards are already ids)."""

    def __init__(self, vocab_size: int, eod: int):
        self.vocab_size, self.eod, self.pad = vocab_size, eod, -1  # -1: no id in the data is padding
        self.unique_identifiers = {"class": "leviathan_pretrain.TokenIds", "vocab_size": vocab_size, "eod": eod}


def eod_id(cfg: Config, infos: dict[str, ShardInfo]) -> int:
    if cfg.data.eod_id is not None:
        return cfg.data.eod_id
    for info in infos.values():
        for src in (info.manifest, manifest_tokenizer(info.manifest)):
            if isinstance(src.get("eod_id"), int):
                return src["eod_id"]
    return 0


def data_summary(cfg: Config) -> dict:
    """:func:`check_data`, reduced to what the other ranks need (small, picklable): eod id, the tokenizer's
    fingerprint and sha256, and shard sizes."""
    ident = tokenizer_identity(cfg)
    infos = check_data(cfg, ident["fingerprint"])
    return {
        "eod_id": eod_id(cfg, infos),
        "tokenizer_fingerprint": ident["fingerprint"],
        "tokenizer_sha256": ident["sha256"],
        "shards": {
            p: {
                "sequences": i.num_sequences,
                "documents": i.num_documents,
                "tokens": i.num_tokens,
                "vocab_size": i.vocab_size,
                "max_token_id": i.max_token_id,
                "max_id_source": i.max_id_source,
            }
            for p, i in infos.items()
        },
    }


def dataset_config(cfg: Config, eod: int, path_to_cache: str | None = None):
    """The ``GPTDatasetConfig`` of a run (its index file names depend on everything but ``path_to_cache``)."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    d = cfg.data
    blend = (list(d.prefixes), list(d.weights) if d.weights else None)
    kw = dict(blend=blend, split=d.split)
    if d.valid_prefixes is not None:
        kw = dict(blend_per_split=[blend, (list(d.valid_prefixes), None), None])
    return GPTDatasetConfig(
        random_seed=d.seed,
        sequence_length=cfg.model.seq_length,
        path_to_cache=path_to_cache or str(cache_dir(cfg)),
        tokenizer=_TokenIds(cfg.model.vocab_size, eod),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=d.eod_mask_loss,
        create_attention_mask=False,
        mmap_bin_files=True,
        **kw,
    )


def build_splits(cfg: Config, eod: int, needs_data: bool, path_to_cache: str | None = None) -> list:
    """[train, valid, test] from megatron-core's builder (collective when torch.distributed is initialised;
    megatron's blends need it to be). Used by the trainer and by ``build_data_cache``."""
    import logging

    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset

    logging.getLogger("megatron.core.datasets").setLevel(logging.WARNING)
    sizes = sample_counts(cfg)
    splits = BlendedMegatronDatasetBuilder(
        GPTDataset, sizes, lambda: needs_data, dataset_config(cfg, eod, path_to_cache)
    ).build()
    train = splits[0]
    if needs_data and train is not None and len(train) < sizes[0]:
        raise ShardError(
            f"data: the training blend yields {len(train)} samples, fewer than the {sizes[0]} the run needs"
        )
    return list(splits)


def build_datasets(cfg: Config, eod: int, needs_data: bool):
    """(train, valid) megatron-core datasets; collective over all ranks (rank 0 builds the index cache first,
    unless ``build_data_cache`` built it: then every rank only loads it).

    ``needs_data`` is False on middle pipeline stages, which get ``(None, None)``."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    cdir = cache_dir(cfg)
    complete, why = cache_status(cfg, eod)  # every rank: the same files, the same answer
    if not complete and cfg.data.require_prebuilt_cache:
        raise ConfigError(
            f"data.require_prebuilt_cache: no complete prebuilt data index cache in {cdir} ({why}); "
            f"build it first with: {command_for(cfg)}"
        )
    if rank == 0:
        if complete:
            print(f"[data] using the prebuilt data index cache {cdir}", flush=True)
        elif why.endswith("does not exist"):  # a run's first start: the usual case, nothing wrong
            print(
                f"[data] building the data index cache in {cdir} (first start; for Pile-scale data, where this "
                "takes minutes, build it beforehand: python -m leviathan_pretrain.build_data_cache with this "
                "command's --config and overrides)",
                flush=True,
            )
        else:
            print(
                f"[data] the data index cache in {cdir} is missing or incomplete ({why}); rank 0 builds it now, "
                "while the other ranks wait (up to parallel.init_timeout_minutes). For Pile-scale data build it "
                f"before training with: {command_for(cfg)}",
                flush=True,
            )
    t0 = time.perf_counter()
    train, valid, test = build_splits(cfg, eod, needs_data)
    if rank == 0 and not complete and train is not None:
        try:
            stamp = write_stamp(cfg, eod, index_files([train, valid, test]), "train")
            print(f"[data] built the data index cache in {time.perf_counter() - t0:.1f} s; stamped {stamp}", flush=True)
        except OSError as e:
            _warn(f"could not write the data cache stamp in {cdir} ({e})")
    return train, (valid if cfg.train.eval_interval > 0 else None)


class Batches:
    """This rank's micro-batches of a global batch, by sample position (see the module docstring)."""

    def __init__(
        self,
        dataset,
        micro_batch: int,
        dp_size: int,
        dp_rank: int,
        global_batch: int,
        vocab_size: int | None = None,
        prepare: Callable[[dict], dict] | None = None,
    ):
        self.ds, self.m, self.dp, self.r, self.g = dataset, micro_batch, dp_size, dp_rank, global_batch
        self.gas = accumulation_steps(global_batch, micro_batch, dp_size)
        self.vocab_size = vocab_size  # given: every micro-batch's ids are checked here, on the host
        self.prepare = prepare  # given: each micro-batch prepared for the device (data/transfer.py)

    def micro_batch(self, start: int) -> dict[str, torch.Tensor]:
        samples = [self.ds[i] for i in range(start, start + self.m)]
        mb = {
            k: torch.stack([torch.as_tensor(s[k]) for s in samples])
            for k in ("tokens", "labels", "loss_mask", "position_ids")
        }
        if self.vocab_size is not None:  # the readable TokenIdError before the ids reach a GPU (model/inputs.py)
            from leviathan_pretrain.model.inputs import check_token_ids

            check_token_ids(mb["tokens"], self.vocab_size)
            check_token_ids(mb["labels"], self.vocab_size)
        return mb if self.prepare is None else self.prepare(mb)

    def global_batch(self, consumed: int) -> list[dict[str, torch.Tensor]]:
        """The ``gas`` micro-batches of this rank for the global batch starting at sample ``consumed``."""
        return [self.micro_batch(consumed + k * self.m * self.dp + self.r * self.m) for k in range(self.gas)]
