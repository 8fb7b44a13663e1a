"""Each one-line error ends with what to type (fast tier: the functions that raise, in process)."""

from __future__ import annotations

import base64
from pathlib import Path
from types import SimpleNamespace

import pytest
import sentencepiece as spm

from common.cli import UserError
from data_prep.outputs import plain_text_hint
from data_prep.tokenizer import open_tokenizer
from leviathan_pretrain.config import Config
from leviathan_pretrain.config.loader import ConfigError
from leviathan_pretrain.data.datasets import ShardError, check_data, check_suffixes
from leviathan_pretrain.data.tokenizer import config_spelling, open_data_tokenizer
from leviathan_pretrain.evaluation.load import EvalError, checkpoint_location


def _touch_shard(prefix: Path) -> None:
    for ext in (".bin", ".idx"):
        Path(str(prefix) + ext).write_bytes(b"")


def test_shard_prefix_with_suffix_names_the_prefix(tmp_path):
    _touch_shard(tmp_path / "train")
    _touch_shard(tmp_path / "val")
    cfg = Config()
    cfg.data.prefixes = [f"{tmp_path}/train.bin", f"{tmp_path}/val"]
    with pytest.raises(ShardError) as e:
        check_data(cfg, tok_fp="x")
    assert str(e.value).endswith(
        f"data.prefixes takes the prefix without .bin/.idx: data.prefixes=[{tmp_path}/train,{tmp_path}/val]"
    )
    with pytest.raises(ShardError, match=r"data.valid_prefixes=\[.*/val\]$"):
        check_suffixes("data.valid_prefixes", [f"{tmp_path}/val.idx"])
    check_suffixes("data.prefixes", [f"{tmp_path}/nope.bin", f"{tmp_path}/train"])  # no shard "nope": no hint here


def _ranks_file(path: Path) -> str:
    path.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    return str(path)


def test_tiktoken_pattern_is_spelled_for_the_command(tmp_path):
    ranks = _ranks_file(tmp_path / "mine.tiktoken")
    with pytest.raises(UserError) as e:  # data_prep's CLI: the flag
        open_tokenizer(ranks)
    assert str(e.value).endswith("pass --tiktoken-pattern r50k|p50k|cl100k|o200k")
    with pytest.raises(ConfigError) as e:  # the trainer: the config key
        open_data_tokenizer(SimpleNamespace(tokenizer=ranks, tiktoken_pattern=None))
    assert str(e.value).endswith("pass data.tiktoken_pattern=r50k|p50k|cl100k|o200k")
    assert "--tiktoken-pattern" not in str(e.value)
    with pytest.raises(ConfigError) as e:  # a missing tokenizer
        open_data_tokenizer(SimpleNamespace(tokenizer=str(tmp_path / "missing.model"), tiktoken_pattern=None))
    assert "tokenizer not found" in str(e.value) and "with data.tiktoken_pattern)" in str(e.value)
    assert "--tiktoken-pattern" not in str(e.value)
    assert config_spelling("--tiktoken-pattern 'gpt5': unknown") == "data.tiktoken_pattern='gpt5': unknown"


def test_plain_text_hint_only_when_most_records_are_invalid_json():
    assert plain_text_hint({"invalid_json": 50}, 53) == "the input looks like plain text: add --format text"
    assert plain_text_hint({"invalid_json": 1, "empty_text": 2}, 3) == ""
    assert plain_text_hint({}, 0) == ""


def test_plain_text_named_jsonl_error_ends_with_format_text(tmp_path):
    from data_prep.tokenize_cli import main

    text = tmp_path / "t.txt"
    text.write_text("some words to learn a tiny model from\n" * 50)
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(tmp_path / "tok"), vocab_size=40, model_type="bpe", minloglevel=2
    )
    src = tmp_path / "plain.jsonl"
    src.write_text("".join(f"plain text line {i}\n" for i in range(20)))
    out = tmp_path / "out" / "plain"
    argv = ["--input", str(src), "--tokenizer", str(tmp_path / "tok.model"), "--out", str(out), "--workers", "1"]
    with pytest.raises(UserError) as e:
        main(argv)
    msg = str(e.value)
    assert "\n" not in msg and "{'invalid_json': 20}" in msg
    assert f"kept the work dir {out}.work/ for a resume" in msg
    assert msg.endswith("; the input looks like plain text: add --format text")


def test_evaluate_run_parent_suggests_the_run(tmp_path):
    (tmp_path / "demo" / "train" / "checkpoints").mkdir(parents=True)
    (tmp_path / "demo" / "notes").mkdir()
    with pytest.raises(EvalError) as e:
        checkpoint_location(tmp_path / "demo")
    assert str(e.value).endswith(f"; did you mean --run {tmp_path}/demo/train?")
    (tmp_path / "demo" / "b").mkdir()
    (tmp_path / "demo" / "b" / "train_log.jsonl").write_text("")
    with pytest.raises(EvalError, match=r"did you mean --run .*/demo/b or --run .*/demo/train\?$"):
        checkpoint_location(tmp_path / "demo")
    with pytest.raises(EvalError, match=r"checkpoint.dir\)$"):  # no run below: no guess
        checkpoint_location(tmp_path / "demo" / "notes")
