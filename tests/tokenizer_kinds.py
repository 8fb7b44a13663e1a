"""Tokenizers of every kind for the tests, made offline: a byte-level BPE ``tokenizer.json`` trained here with the
``tokenizers`` library, the GPT-2 ranks file a registry package ships (fetched by scripts/setup.sh into
``<venv>/test-assets``), and a test-made ranks file with more than 65,536 ids. Also independent reference encoders
(the libraries called directly, not through data_prep) to check shards against."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

from tiktoken_ext.openai_public import r50k_pat_str as R50K_PAT  # tiktoken's own GPT-2 pattern, not a copy

TEST_ASSETS = Path(sys.prefix) / "test-assets"


def asset(name: str) -> Path:
    p = TEST_ASSETS / name
    assert p.is_file(), f"{p} is missing: scripts/setup.sh (test mode) fetches it"
    return p


def train_bpe(texts, out_dir: Path, vocab: int = 4000) -> Path:
    """A GPT-2-style byte-level BPE (``<|endoftext|>`` its only special token) trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(texts, trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tk.save(str(out_dir / "tokenizer.json"))
    return out_dir / "tokenizer.json"


def read_ranks(path: Path) -> dict[bytes, int]:
    out = {}
    for line in Path(path).read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            out[base64.b64decode(tok)] = int(rank)
    return out


def write_big_ranks(gpt2: Path, texts, out: Path, extra: int = 20000) -> Path:
    """GPT-2's ranks plus ``extra`` tokens ranked after them: first the merges of the most frequent pairs of
    adjacent tokens inside one word of ``texts`` (so ids >= 50,256 occur in the shards), then filler byte strings;
    with ``<|endoftext|>`` after them, 70,257 ids, so shards are int32."""
    import collections

    import tiktoken

    ranks = read_ranks(gpt2)
    enc = tiktoken.Encoding("gpt2", pat_str=R50K_PAT, mergeable_ranks=ranks, special_tokens={})
    pairs = collections.Counter()
    for ids in enc.encode_ordinary_batch(list(texts), num_threads=2):
        toks = [enc.decode_single_token_bytes(i) for i in ids]
        pairs.update((a, b) for a, b in zip(toks, toks[1:]) if a[-1:].isalpha() and b.isalpha())
    nxt = max(ranks.values()) + 1
    new = [a + b for (a, b), _ in pairs.most_common()]
    new += [b"\xff\xfe" + str(i).encode() for i in range(extra)]
    for tok in new:
        if nxt - 50256 >= extra:
            break
        if tok not in ranks:
            ranks[tok] = nxt
            nxt += 1
    with open(out, "wb") as f:
        for tok, rank in sorted(ranks.items(), key=lambda x: x[1]):
            f.write(base64.b64encode(tok) + b" " + str(rank).encode() + b"\n")
    return out


def reference_encoder(kind: str, path: Path, pat_str: str = R50K_PAT):
    """``(encode(texts) -> list[list[int]], eod_id, vocab_size)`` from the library itself (tiktoken: ``path``'s
    ranks split with ``pat_str``, ordinary encoding)."""
    if kind == "sentencepiece":
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor(model_file=str(path))
        return (lambda texts: sp.encode(list(texts))), sp.eos_id(), sp.vocab_size()
    if kind == "huggingface":
        from tokenizers import Tokenizer

        tk = Tokenizer.from_file(str(path))
        return (
            lambda texts: [e.ids for e in tk.encode_batch(texts, add_special_tokens=False)],
            tk.token_to_id("<|endoftext|>"),
            tk.get_vocab_size(with_added_tokens=True),
        )
    import tiktoken

    ranks = read_ranks(path)
    eod = max(ranks.values()) + 1
    enc = tiktoken.Encoding("ref", pat_str=pat_str, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": eod})
    return (lambda texts: enc.encode_ordinary_batch(texts, num_threads=2)), eod, eod + 1
