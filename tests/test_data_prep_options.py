"""tokenize options: set filters and the pile-uncopyrighted preset, --json-key, plain-text inputs."""

import json

import pytest
import sentencepiece as spm
from megatron.core.datasets.indexed_dataset import IndexedDataset

from data_prep.pile_sets import PILE_SET_NAMES, PRESETS

SETS = ["Books3", "Github", "OpenWebText2", "Pile-CC", "YoutubeSubtitles"]


@pytest.fixture()
def pile_like(tmp_path):
    """Pile-style jsonl: 3 documents per set, sets interleaved."""
    src = tmp_path / "pile.jsonl"
    with open(src, "w") as f:
        for i in range(3):
            for name in SETS:
                f.write(json.dumps({"text": f"{name} doc {i}: some text", "meta": {"pile_set_name": name}}) + "\n")
    return src


def _texts(prefix, tokenizer_model):
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_model))
    ds = IndexedDataset(str(prefix))
    return [sp.decode(ds[i][:-1].tolist()) for i in range(len(ds))]


def test_preset_pile_uncopyrighted(pile_like, tokenizer_model, tokenize, tmp_path):
    assert set(PRESETS["pile-uncopyrighted"]["exclude_sets"]) == {
        "Books3",
        "BookCorpus2",
        "OpenSubtitles",
        "YoutubeSubtitles",
        "OpenWebText2",
    }
    assert set(PRESETS["pile-uncopyrighted"]["exclude_sets"]) <= set(PILE_SET_NAMES)
    prefix = tmp_path / "unc"
    tokenize(pile_like, tokenizer_model, prefix, "--preset", "pile-uncopyrighted")
    m = json.load(open(f"{prefix}.manifest.json"))
    assert sorted(m["sets"]) == ["Github", "Pile-CC"]
    assert m["filtered_sets"] == {"Books3": 3, "OpenWebText2": 3, "YoutubeSubtitles": 3}
    assert m["options"]["preset"] == "pile-uncopyrighted"
    assert _texts(prefix, tokenizer_model) == [
        f"{n} doc {i}: some text" for i in range(3) for n in ("Github", "Pile-CC")
    ]


def test_include_and_exclude_sets(pile_like, tokenizer_model, tokenize, tmp_path):
    tokenize(pile_like, tokenizer_model, tmp_path / "inc", "--include-sets", "Github", "Books3")
    m = json.load(open(tmp_path / "inc.manifest.json"))
    assert sorted(m["sets"]) == ["Books3", "Github"] and m["documents"] == 6
    p = tokenize(pile_like, tokenizer_model, tmp_path / "exc", "--exclude-sets", "Github", "Wikipedia(en)")
    assert "'Wikipedia(en)' is not one of the Pile's 22 set names" in p.stderr  # typo warning
    m = json.load(open(tmp_path / "exc.manifest.json"))
    assert "Github" not in m["sets"] and m["filtered_sets"] == {"Github": 3} and m["documents"] == 12
    p = tokenize(
        pile_like,
        tokenizer_model,
        tmp_path / "both",
        "--include-sets",
        "Github",
        "--exclude-sets",
        "Github",
        check=False,
    )
    assert p.returncode == 2 and "both included and excluded" in p.stderr


def test_json_key(tokenizer_model, tokenize, tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text(
        json.dumps({"content": "from the content field", "text": "not this"})
        + "\n"
        + json.dumps({"text": "no content key"})
        + "\n"
    )
    tokenize(src, tokenizer_model, tmp_path / "o", "--json-key", "content")
    m = json.load(open(tmp_path / "o.manifest.json"))
    assert m["skipped"] == {"missing_text_key": 1} and m["sets"] == {
        "(none)": {"documents": 1, "tokens": m["tokens"], "text_bytes": 22}
    }
    assert _texts(tmp_path / "o", tokenizer_model) == ["from the content field"]


@pytest.mark.parametrize(
    "unit, expected",
    [
        ("file", ["first para\nline two\n\n\nsecond para\n   \nthird\n"]),
        ("line", ["first para", "line two", "second para", "third"]),
        ("paragraph", ["first para\nline two", "second para", "third"]),
    ],
)
def test_plain_text_inputs(unit, expected, tokenizer_model, tokenize, tmp_path):
    src = tmp_path / "notes.txt"
    src.write_text("first para\nline two\n\n\nsecond para\n   \nthird\n")
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9\n".encode("latin-1"))
    tokenize([src, bad], tokenizer_model, tmp_path / "o", "--text-unit", unit)
    assert _texts(tmp_path / "o", tokenizer_model) == expected
    m = json.load(open(tmp_path / "o.manifest.json"))
    assert m["skipped"].get("invalid_utf8") == 1
    if unit == "line":
        assert m["skipped"] == {"empty_text": 2, "invalid_utf8": 1, "whitespace_only": 1}


def test_documents_with_u2581_are_counted(tokenizer_model, tokenize, tmp_path):
    """U+2581 is SentencePiece's space marker and decodes as a space: the one text that cannot round-trip.
    It is kept (the model still sees sensible tokens) and counted in the manifest."""
    src = tmp_path / "u.jsonl"
    src.write_text(json.dumps({"text": "plain"}) + "\n" + json.dumps({"text": "a\u2581b"}) + "\n")
    tokenize(src, tokenizer_model, tmp_path / "o")
    m = json.load(open(tmp_path / "o.manifest.json"))
    assert m["documents"] == 2 and m["documents_with_u2581"] == 1
    assert _texts(tmp_path / "o", tokenizer_model) == ["plain", "a b"]


def test_split_by_set_names_and_unlabelled_records(tokenizer_model, tokenize, tmp_path):
    src = tmp_path / "m.jsonl"
    src.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {"text": "wiki text", "meta": {"pile_set_name": "Wikipedia (en)"}},
                {"text": "no meta at all"},
                {"text": "book text", "meta": {"pile_set_name": "Gutenberg (PG-19)"}},
                {"text": "more wiki", "meta": {"pile_set_name": "Wikipedia (en)"}},
            ]
        )
    )
    prefix = tmp_path / "s"
    tokenize(src, tokenizer_model, prefix, "--split-by-set")
    m = json.load(open(f"{prefix}.manifest.json"))
    assert {o["set"]: o["prefix"] for o in m["outputs"]} == {
        "(none)": f"{prefix}.no_set",
        "Gutenberg (PG-19)": f"{prefix}.Gutenberg_PG-19",
        "Wikipedia (en)": f"{prefix}.Wikipedia_en",
    }
    assert _texts(f"{prefix}.Wikipedia_en", tokenizer_model) == ["wiki text", "more wiki"]
    assert _texts(f"{prefix}.no_set", tokenizer_model) == ["no meta at all"]
