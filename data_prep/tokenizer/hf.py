"""A Hugging Face ``tokenizer.json`` (GPT-NeoX-20B, Llama 3, a ``train_tokenizer --kind bpe`` output), read with the
``tokenizers`` library (never transformers). ``encode_batch`` releases the GIL for the whole batch; the library's
own thread pool is switched off (``TOKENIZERS_PARALLELISM=false``) so that data_prep's ``--workers`` threads are the
parallelism, as for the other kinds.

End of document: ``eos_token`` of a ``tokenizer_config.json`` beside the file if there is one, else the first of
``EOD_CANDIDATES`` in the vocabulary, else ``--eod-token`` is required. Encoding adds no special tokens: where the
post-processor would add a BOS (Llama), data_prep writes none; ``describe()`` records what it would add."""

from __future__ import annotations

import json
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import tokenizers  # noqa: E402

from common.cli import UserError  # noqa: E402
from common.fileio import sha256_file  # noqa: E402
from data_prep.tokenizer.base import Tokenizer  # noqa: E402

EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<|startoftext|>", "<bos>")


def _config_token(cfg: dict, key: str) -> str | None:
    v = cfg.get(key)
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) and v else None


class HuggingFaceTokenizer(Tokenizer):
    kind = "huggingface"

    def __init__(self, path: str, eod_token: str | None = None):
        self.path = path
        try:
            self.tk = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the library raises its own Exception type for every parse error
            raise UserError(f"{path}: not a Hugging Face tokenizer.json ({str(e).splitlines()[0][:200]})") from None
        self.file_sha256 = sha256_file(path)
        self.fingerprint = self.file_sha256
        vocab = self.tk.get_vocab(with_added_tokens=True)
        if not vocab:
            raise UserError(f"{path}: the tokenizer has an empty vocabulary")
        self.vocab_size = max(vocab.values()) + 1
        cfg = self._config()
        eod = eod_token or _config_token(cfg, "eos_token") or next((t for t in EOD_CANDIDATES if t in vocab), None)
        if eod is None:
            raise UserError(
                f"{path}: no end-of-text token found (none of {', '.join(EOD_CANDIDATES)}); name the one data_prep "
                "appends after each document with --eod-token"
            )
        if eod not in vocab:
            raise UserError(f"{path}: the EOD token {eod!r} is not in the vocabulary (check --eod-token)")
        self.eod_token, self.eod_id = eod, int(vocab[eod])
        bos = _config_token(cfg, "bos_token") or next((t for t in BOS_CANDIDATES if t in vocab), None)
        self.bos_id = int(vocab[bos]) if bos in vocab else None
        self._fast = getattr(self.tk, "encode_batch_fast", None) or self.tk.encode_batch

    def _config(self) -> dict:
        p = os.path.join(os.path.dirname(os.path.abspath(self.path)), "tokenizer_config.json")
        try:
            with open(p) as f:
                cfg = json.load(f)
        except (OSError, ValueError):
            return {}
        return cfg if isinstance(cfg, dict) else {}

    def default_special_ids(self) -> list[int]:
        """The ids the post-processor adds around a text when asked to (``add_special_tokens=True``, what
        transformers and Megatron-LM's HuggingFaceTokenizer do by default): e.g. Llama's BOS. data_prep adds none."""
        with_sp = self.tk.encode("a", add_special_tokens=True).ids
        plain = set(self.tk.encode("a", add_special_tokens=False).ids)
        return [i for i in with_sp if i not in plain]

    def extra_description(self) -> dict:
        return {"post_processor_adds": self.default_special_ids()}

    def encode(self, units) -> list[np.ndarray]:
        texts = [u if isinstance(u, str) else u.decode("utf-8") for u in units]
        encs = self._fast(texts, add_special_tokens=False)
        return [np.array(e.ids, dtype=np.int32) for e in encs]

    def encode_one(self, text: str) -> list[int]:
        return self.tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tk.decode([int(i) for i in ids], skip_special_tokens=False)

    def id_to_piece(self, i: int) -> str:
        return self.tk.id_to_token(int(i)) or ""
