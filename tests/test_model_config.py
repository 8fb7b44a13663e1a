"""Invalid model configs fail at load with a message naming the field."""

import warnings

import pytest

from leviathan_pretrain.config import ConfigError, load_config


@pytest.mark.parametrize(
    "over, key",
    [
        (["model.vocab_size=200019", "model.lev.base=50"], "model.lev.base"),  # 50**3 < 200019
        (["model.variant=factored_mlp", "model.vocab_size=1001", "model.lev.base=10"], "model.lev.base"),
        (["model.lev.digits=2", "model.lev.base=100", "model.vocab_size=10001"], "model.lev.base"),
        (["model.lev.knots=2"], "model.lev.knots"),
        (["model.variant=dense"], "model.variant"),
        (
            ["model.lev.heads=6", "parallel.tensor_parallel=4", "model.num_attention_heads=8", "model.hidden_size=256"],
            "model.lev.heads",
        ),
        (
            [
                "model.variant=factored_mlp",
                "model.vocab_size=32000",
                "model.mlp_hidden=30",
                "parallel.tensor_parallel=4",
                "model.num_attention_heads=8",
                "model.hidden_size=256",
            ],
            "model.mlp_hidden",
        ),
        (["model.lev.token_chunk=0"], "model.lev.token_chunk"),
        (["model.attention_backend=flash"], "model.attention_backend"),
    ],
)
def test_bad_model_config_names_the_field(over, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, over)


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    import sentencepiece as spm

    d = tmp_path_factory.mktemp("spm")
    text = d / "corpus.txt"
    text.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog {i * 7}" for i in range(300)))
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(d / "tok"), vocab_size=60, model_type="bpe", minloglevel=2
    )
    return d / "tok.model"


def test_tokenizer_vocab_must_fit_the_model(spm_model):
    with pytest.raises(ConfigError, match=r"model\.vocab_size.*data\.tokenizer=.*tok\.model.*60 ids"):
        load_config(None, [f"data.tokenizer={spm_model}", "model.vocab_size=59"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(None, [f"data.tokenizer={spm_model}", "model.vocab_size=60"]).model.vocab_size == 60
    with pytest.warns(UserWarning, match="larger than data.tokenizer"):
        load_config(None, [f"data.tokenizer={spm_model}", "model.vocab_size=64"])


def test_missing_or_bogus_tokenizer_names_data_tokenizer(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.tokenizer.*tokenizer not found.*nope\.model"):
        load_config(None, [f"data.tokenizer={tmp_path / 'nope.model'}"])
    bogus = tmp_path / "bogus.model"
    bogus.write_bytes(b"not a model")
    with pytest.raises(ConfigError, match=r"data\.tokenizer.*not a tokenizer of a kind.*SentencePiece.*tiktoken"):
        load_config(None, [f"data.tokenizer={bogus}"])


def test_vocab_size_unset_is_the_tokenizers_of_any_kind(spm_model, gpt2_tiktoken, bpe_tokenizer_json, tmp_path):
    from tests.tokenizer_kinds import asset

    with pytest.raises(ConfigError, match=r"model\.vocab_size: not set, and there is no data\.tokenizer"):
        load_config(None, ["model.vocab_size=null"])
    cl100k = asset("cl100k_base.tiktoken")
    for tok, extra, n in (
        (spm_model, [], 60),
        (gpt2_tiktoken, [], 50257),
        (cl100k, [], 100277),  # cl100k_base: 100,256 ranks + specials up to <|endofprompt|> = 100,276
        (bpe_tokenizer_json.parent, [], 4000),
    ):
        cfg = load_config(None, [f"data.tokenizer={tok}", "model.vocab_size=null", *extra])
        assert cfg.model.vocab_size == n, tok
    # set: checked against the tokenizer, naming both
    with pytest.raises(ConfigError, match=r"model\.vocab_size: 50000 is smaller .*gpt2\.tiktoken \(tiktoken, 50,257"):
        load_config(None, [f"data.tokenizer={gpt2_tiktoken}", "model.vocab_size=50000"])
    # a ranks file that is no published encoding: the pattern is a config key
    custom = tmp_path / "custom.tiktoken"
    custom.write_bytes(gpt2_tiktoken.read_bytes()[: -len(gpt2_tiktoken.read_bytes().splitlines()[-1]) - 1])
    with pytest.raises(ConfigError, match=r"data\.tokenizer: .*custom\.tiktoken.*data\.tiktoken_pattern"):
        load_config(None, [f"data.tokenizer={custom}"])
    cfg = load_config(None, [f"data.tokenizer={custom}", "data.tiktoken_pattern=r50k", "model.vocab_size=null"])
    assert cfg.model.vocab_size == 50256  # one rank fewer, then <|endoftext|>
