"""The Hugging Face tokenizer of an export, one writer per tokenizer kind (``data_prep.tokenizer``'s interface).

Every writer's output is loaded back with ``AutoTokenizer.from_pretrained`` (no custom code, nothing downloaded)
and must encode each of :data:`PROBES` to exactly the run's ids, and name the run's EOD as its ``eos_token``,
before the export is kept; a difference is an :class:`ExportError` naming the text.

- ``sentencepiece``: ``tokenizer.model`` copied, plus transformers' ``LlamaTokenizer`` files (no BOS / EOS added,
  the model's own dummy prefix, ``<s>`` in a text is text as in SentencePiece);
- ``huggingface``: the run's ``tokenizer.json`` copied byte for byte, and a ``tokenizer_config.json`` for
  ``PreTrainedTokenizerFast`` naming its EOD; where its post-processor adds special tokens (Llama 3's BOS: the
  training data has none, and transformers would add it by default), the copy is the same file without that
  post-processor (recorded in the marker). Special-token text in a document is matched as a special token, as
  the ``tokenizers`` library (and so data_prep) does;
- ``tiktoken``: converted to a fast byte-level BPE ``tokenizer.json`` with transformers' ``TikTokenConverter``
  (merges from the ranks, the encoding's split pattern, its special tokens at their own ids), special-token text
  split as ordinary text (``split_special_tokens``), as tiktoken's ordinary encoding that wrote the shards.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from leviathan_pretrain.evaluation.load import EvalError

# Texts every exported tokenizer must encode to the run's own ids before anything is written.
PROBES = (
    "Hello world. The quick brown fox jumps over the lazy dog.",
    " leading space,  two spaces,   three, trailing  ",
    "line one\nline two\n\n\tindented\r\nwindows line\n\n\n   \n",
    "unicode: café naïve Ωμέγα 日本語のテキスト 한국어 😀👍 emoji, math ≈ √2 «quotes» — dash",
    "numbers 12345 and 1913, 3.14159, 1,000,000, dates 2024-01-31, $9.99",
    "contractions: don't, I'M, they'll, we've, it's",
    "control pieces as text: <s> </s> <unk> <|endoftext|> <|endoftext|>x",
    " " * 40 + "x" + "\n" * 9,
    "",
    "x",
)


class ExportError(EvalError):
    """An export that cannot be done (output directory, tokenizer, dtype); the message names the file."""


def special_ids(tok) -> dict:
    """bos / eos / pad ids of the run's tokenizer for ``LlamaConfig`` (None where it has none); eos is the EOD
    data_prep appended after each document."""
    if tok.kind == "sentencepiece":
        pad = int(tok.sp.pad_id())
        return dict(bos=tok.bos_id, eos=tok.eod_id, pad=pad if pad >= 0 else None)
    return dict(bos=tok.bos_id, eos=tok.eod_id, pad=None)


def write_tokenizer(tok, out: Path) -> dict:
    """Write ``tok``'s Hugging Face tokenizer into ``out`` and check it; returns what the marker records."""
    writer = {"sentencepiece": _sentencepiece, "huggingface": _huggingface, "tiktoken": _tiktoken}.get(tok.kind)
    if writer is None:
        raise ExportError(f"{tok.path}: no Hugging Face export for a {tok.kind} tokenizer")
    record = writer(tok, Path(out))
    check_tokenizer(tok, Path(out))
    return record


def check_tokenizer(tok, out: Path) -> None:
    """``AutoTokenizer`` of ``out`` gives ``tok``'s ids on every probe and names its EOD as eos."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    if hf.eos_token_id != tok.eod_id:
        raise ExportError(f"{tok.path}: the exported tokenizer's eos id is {hf.eos_token_id}, not {tok.eod_id}")
    for text in PROBES:
        if hf.encode(text) != tok.encode_one(text):
            raise ExportError(f"{tok.path}: the exported Hugging Face tokenizer encodes {text!r} differently")


def _write_config(out: Path, tok, split_special_tokens: bool) -> None:
    bos = None if tok.bos_id is None else tok.id_to_piece(tok.bos_id)
    conf = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": tok.eod_token,
        "bos_token": bos,
        "add_bos_token": False,  # the training data has none
        "add_eos_token": False,
        "split_special_tokens": split_special_tokens,
        "clean_up_tokenization_spaces": False,  # decode gives the text back as it was
    }
    (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=2, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------- one writer per kind


def _sentencepiece(tok, out: Path) -> dict:
    """``tokenizer.model`` (copied), ``tokenizer.json`` and ``tokenizer_config.json`` of a ``LlamaTokenizer``
    that encodes as the SentencePiece model does (no added BOS / EOS)."""
    from sentencepiece import sentencepiece_model_pb2
    from transformers import LlamaTokenizer

    path = Path(tok.path)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(path.read_bytes())
    norm = proto.normalizer_spec
    if proto.trainer_spec.model_type != sentencepiece_model_pb2.TrainerSpec.BPE:
        raise ExportError(
            f"{path}: a {proto.trainer_spec.ModelType.Name(proto.trainer_spec.model_type)} model; "
            "the Llama tokenizer export needs a BPE SentencePiece model"
        )
    if norm.name != "identity" or norm.precompiled_charsmap or norm.remove_extra_whitespaces:
        raise ExportError(
            f"{path}: normalizer {norm.name!r} (remove_extra_whitespaces={norm.remove_extra_whitespaces}); "
            "the Llama tokenizer export needs the identity normalizer (as data_prep trains it)"
        )
    src = out / ".tokenizer-src"
    src.mkdir()
    shutil.copyfile(path, src / "tokenizer.model")
    hf = LlamaTokenizer.from_pretrained(
        str(src),
        add_prefix_space=bool(norm.add_dummy_prefix),
        add_bos_token=False,
        add_eos_token=False,
        legacy=False,
        local_files_only=True,
    )
    hf.save_pretrained(str(out))
    shutil.rmtree(src)
    shutil.copyfile(path, out / "tokenizer.model")
    conf_path = out / "tokenizer_config.json"
    conf = json.loads(conf_path.read_text())
    for junk in ("is_local", "local_files_only", "name_or_path"):
        conf.pop(junk, None)
    # split_special_tokens: "<s>" in a text is text, as SentencePiece (and so the training data) has it
    conf.update(
        add_bos_token=False,
        add_eos_token=False,
        legacy=False,
        split_special_tokens=True,
        tokenizer_class="LlamaTokenizer",
    )
    conf_path.write_text(json.dumps(conf, indent=2, ensure_ascii=False) + "\n")
    return {"tokenizer_files": ["tokenizer.model", "tokenizer.json", "tokenizer_config.json"]}


def _huggingface(tok, out: Path) -> dict:
    """The run's ``tokenizer.json`` as it is, and a ``tokenizer_config.json`` naming its EOD. Where its
    post-processor adds special tokens around a text (Llama 3's BOS), which data_prep never wrote and which
    transformers adds by default whatever the config says, that post-processor is taken out, and recorded."""
    adds = tok.default_special_ids()
    if not adds:
        shutil.copyfile(tok.path, out / "tokenizer.json")
    else:
        conf = json.loads(Path(tok.path).read_text(encoding="utf-8"))
        conf["post_processor"] = _without_added_tokens(conf.get("post_processor"))
        (out / "tokenizer.json").write_text(json.dumps(conf, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    _write_config(out, tok, split_special_tokens=False)
    return {"tokenizer_files": ["tokenizer.json", "tokenizer_config.json"], "post_processor_removed_ids": adds}


ADDING_PROCESSORS = ("TemplateProcessing", "BertProcessing", "RobertaProcessing")


def _without_added_tokens(proc: dict | None) -> dict | None:
    """A ``tokenizer.json`` post-processor without its parts that add special tokens (a ``Sequence`` keeps the
    others, e.g. ByteLevel's offset trimming, which changes no id)."""
    if not isinstance(proc, dict) or proc.get("type") in ADDING_PROCESSORS:
        return None
    if proc.get("type") == "Sequence":
        kept = [p for p in proc.get("processors", []) if p.get("type") not in ADDING_PROCESSORS]
        return {**proc, "processors": kept} if kept else None
    return proc


def onig_pattern(pat: str) -> str:
    """tiktoken's split pattern for the ``tokenizers`` library's regex engine (Oniguruma, Ruby syntax), where
    ``{m,n}+`` is not possessive but a repeat of the repeat (cl100k's ``\\p{N}{1,3}+`` would take any run of
    digits). At the end of an alternative a possessive and a greedy bounded repeat match the same (nothing after
    it can fail and backtrack into it), so there the ``+`` is dropped; anywhere else is refused."""
    fixed = re.sub(r"(\{\d+(?:,\d*)?\})\+(?=\||$)", r"\1", pat)
    if re.search(r"\{\d+(?:,\d*)?\}\+", fixed):
        raise ExportError(f"the split pattern {pat!r} has a possessive bounded repeat the export cannot convert")
    return fixed


def _tiktoken(tok, out: Path) -> dict:
    """A fast byte-level BPE ``tokenizer.json`` converted from the ranks with transformers' converter."""
    from tokenizers import Tokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from data_prep.tokenizer.tiktoken_file import read_ranks

    class Converter(TikTokenConverter):
        @staticmethod
        def load_tiktoken_bpe(path):  # ours: tiktoken's loader may fetch a URL and caches by hash
            return read_ranks(path)

    tk = Converter(vocab_file=tok.path, pattern=onig_pattern(tok.pat_str)).converted()
    conf = json.loads(tk.to_str())
    # special tokens at the encoding's ids (cl100k and o200k leave gaps): in the model's vocabulary, so the
    # added tokens take those ids instead of the next free ones
    conf["model"]["vocab"].update({s: int(i) for s, i in tok.special_tokens.items()})
    conf["added_tokens"] = [
        dict(id=int(i), content=s, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
        for s, i in sorted(tok.special_tokens.items(), key=lambda kv: kv[1])
    ]
    Tokenizer.from_str(json.dumps(conf)).save(str(out / "tokenizer.json"))
    _write_config(out, tok, split_special_tokens=True)
    return {"tokenizer_files": ["tokenizer.json", "tokenizer_config.json"], "tiktoken_pattern": tok.pattern}
