"""``data_prep.train_tokenizer --kind bpe``: a byte-level BPE (what GPT-2, GPT-NeoX and Llama 3 use) trained with
the Hugging Face ``tokenizers`` library on train_tokenizer's sample, written as ``tokenizer.json``.

GPT-2's layout: the ByteLevel pre-tokenizer (GPT-2's split regex, no prefix space) over the 256 byte symbols, so
any UTF-8 text encodes and decodes back exactly; ``<|endoftext|>`` the EOD (id 0: the trainer puts special tokens
first), then ``--user-defined-symbols``, as added tokens; no template (no BOS / EOS added by encoding). The
vocabulary is exactly ``--vocab-size`` or the command fails."""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")  # the trainer's own threads (RAYON_NUM_THREADS)

import tokenizers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

from common.cli import UserError
from data_prep.console import human_bytes  # noqa: E402

EOD = "<|endoftext|>"


def texts(sample_docs: list):
    for _, doc, _ in sample_docs:
        yield doc.decode("utf-8", errors="ignore")


def train_bpe(sample, opts) -> tuple[str, dict]:
    """(tokenizer.json text, settings) of a byte-level BPE with exactly ``opts.vocab_size`` ids."""
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, opts.threads)))
    extra = [s for s in opts.user_defined_symbols.split(",") if s]
    settings = {
        "library": "tokenizers",
        "tokenizers_version": tokenizers.__version__,
        "model": "BPE",
        "pre_tokenizer": "ByteLevel(add_prefix_space=False)",
        "vocab_size": opts.vocab_size,
        "special_tokens": [EOD, *extra],
        "initial_alphabet": "ByteLevel.alphabet() (256 byte symbols)",
    }
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=opts.vocab_size,
        special_tokens=[EOD, *extra],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=bool(opts.verbose),
    )
    tk.train_from_iterator(texts(sample.docs), trainer, length=len(sample.docs))
    n = tk.get_vocab_size(with_added_tokens=True)
    if n != opts.vocab_size:
        raise UserError(
            f"--vocab-size {opts.vocab_size} is too large for this sample: the BPE trainer found {n:,} ids in "
            f"{human_bytes(sample.reservoir.bytes)} of text; raise --sample-bytes (or lower --vocab-size)"
        )
    return tk.to_str(pretty=False), settings


def describe(tokenizer_json: str) -> dict:
    """The model facts tokenizer_meta.json records."""
    tk = Tokenizer.from_str(tokenizer_json)
    return {
        "vocab_size": tk.get_vocab_size(with_added_tokens=True),
        "eod_id": tk.token_to_id(EOD),
        "eod_piece": EOD,
        "tokenizers_version": tokenizers.__version__,
    }
