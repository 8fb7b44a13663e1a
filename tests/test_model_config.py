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
    with pytest.raises(ConfigError, match=r"model\.vocab_size.*60 pieces"):
        load_config(None, [f"data.tokenizer={spm_model}", "model.vocab_size=59"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(None, [f"data.tokenizer={spm_model}", "model.vocab_size=60"]).model.vocab_size == 60
    with pytest.warns(UserWarning, match="larger than data.tokenizer"):
        load_config(None, [f"data.tokenizer={spm_model}", "model.vocab_size=64"])


def test_missing_or_bogus_tokenizer_names_data_tokenizer(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.tokenizer.*does not exist"):
        load_config(None, [f"data.tokenizer={tmp_path / 'nope.model'}"])
    bogus = tmp_path / "bogus.model"
    bogus.write_bytes(b"not a model")
    with pytest.raises(ConfigError, match=r"data\.tokenizer.*not a SentencePiece model"):
        load_config(None, [f"data.tokenizer={bogus}"])
