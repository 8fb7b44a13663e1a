"""Data safety: the commands delete only what they created and marked as theirs - never a user's file.

The work directory is ours only with our marker; --overwrite deletes only this prefix's own files; a
failing in-kernel copy does not duplicate bytes; make_corpus and the demo replace only their own output."""

import errno
import json
import os

import pytest

from common.cli import UserError
from data_prep import shards

MARKER = ".data_prep-work.json"


def _jsonl(path, texts, set_name=None):
    with open(path, "w") as f:
        for t in texts:
            rec = {"text": t} if set_name is None else {"text": t, "meta": {"pile_set_name": set_name}}
            f.write(json.dumps(rec) + "\n")
    return path


@pytest.fixture()
def small_input(tmp_path):
    return _jsonl(tmp_path / "in.jsonl", [f"document number {i}: some text\n" for i in range(20)])


def _tokenize(tokenize, inputs, tokenizer, prefix, *extra, check=True):
    return tokenize(inputs, tokenizer, prefix, "--no-progress", *extra, check=check)


def _one_line_error(p, *needles):
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), p.stderr
    for n in needles:
        assert str(n) in last, (n, last)


def _outputs(prefix):
    return [e for e in (".bin", ".idx", ".counts.npy", ".manifest.json") if os.path.exists(str(prefix) + e)]


# -- 1. the work directory ---------------------------------------------------------------------


def test_work_dir_option_uses_a_marked_subdirectory_and_keeps_the_users_files(
    small_input, tokenizer_model, tokenize, tmp_path
):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "user.txt").write_text("precious")
    prefix = tmp_path / "out" / "train"
    inputs = [small_input, _jsonl(tmp_path / "b.jsonl", ["another document", "and one more"])]
    _tokenize(tokenize, inputs, tokenizer_model, prefix, "--work-dir", scratch, "--keep-work")
    work = scratch / "train.data_prep-work"
    marker = json.loads((work / MARKER).read_text())
    assert marker["output_prefix"] == os.path.realpath(prefix)
    assert (work / "part-00001" / "part.json").is_file()
    # a re-run resumes from the marked work dir, then removes it - and only it
    p = _tokenize(tokenize, inputs, tokenizer_model, prefix, "--work-dir", scratch, "--overwrite")
    assert f"reusing {work / 'part-00000'}" in p.stderr and f"reusing {work / 'part-00001'}" in p.stderr
    assert not work.exists()
    assert sorted(os.listdir(scratch)) == ["user.txt"] and (scratch / "user.txt").read_text() == "precious"


def test_a_work_dir_without_our_marker_is_refused(small_input, tokenizer_model, tokenize, tmp_path):
    prefix = tmp_path / "out"
    work = tmp_path / "out.work"  # the default work dir, but the user's
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    p = _tokenize(tokenize, [small_input], tokenizer_model, prefix, check=False)
    _one_line_error(p, work, "--work-dir")
    assert (work / "notes.txt").read_text() == "mine" and sorted(os.listdir(work)) == ["notes.txt"]
    assert _outputs(prefix) == []
    scratch = tmp_path / "scratch"  # the same under --work-dir
    (scratch / "out.data_prep-work").mkdir(parents=True)
    (scratch / "out.data_prep-work" / "x").write_text("x")
    p = _tokenize(tokenize, [small_input], tokenizer_model, prefix, "--work-dir", scratch, check=False)
    _one_line_error(p, scratch / "out.data_prep-work")
    assert (scratch / "out.data_prep-work" / "x").read_text() == "x"
    # an empty directory is used, and left as it was found (empty, not deleted)
    empty = tmp_path / "e.work"
    empty.mkdir()
    _tokenize(tokenize, [small_input], tokenizer_model, tmp_path / "e")
    assert empty.is_dir() and os.listdir(empty) == [] and _outputs(tmp_path / "e")


def test_only_what_we_wrote_is_removed_from_our_work_dir(small_input, tokenizer_model, tokenize, tmp_path):
    prefix = tmp_path / "out"
    work = tmp_path / "out.work"
    _tokenize(tokenize, [small_input], tokenizer_model, prefix, "--keep-work")
    assert (work / MARKER).is_file()
    (work / "mine.txt").write_text("mine")
    (work / "part-00007").mkdir()  # a part of an earlier run with more inputs: ours
    _tokenize(tokenize, [small_input], tokenizer_model, prefix, "--overwrite")
    assert sorted(os.listdir(work)) == sorted([MARKER, "mine.txt"])
    # another prefix's work dir (same name under --work-dir) is refused, not reused
    other = json.loads((work / MARKER).read_text())
    other["output_prefix"] = str(tmp_path / "elsewhere" / "out")
    (work / MARKER).write_text(json.dumps(other))
    p = _tokenize(tokenize, [small_input], tokenizer_model, prefix, "--overwrite", check=False)
    _one_line_error(p, work, "elsewhere")


# -- 2. --overwrite ----------------------------------------------------------------------------


def test_overwrite_deletes_only_this_prefixs_own_files(tokenizer_model, tokenize, tmp_path):
    src = tmp_path / "in.jsonl"
    with open(src, "w") as f:
        for i in range(6):
            f.write(json.dumps({"text": f"text {i}", "meta": {"pile_set_name": "Github" if i % 2 else "ArXiv"}}) + "\n")
    data = tmp_path / "data"
    prefix = data / "out"
    _tokenize(tokenize, [src], tokenizer_model, prefix, "--split-by-set")
    assert os.path.exists(f"{prefix}.Github.bin") and os.path.exists(f"{prefix}.ArXiv.idx")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    users = []
    (data / "out.v2.manifest.json").write_text("{}")  # out.v2 is a prefix of its own
    bases = (elsewhere / "keep", data / "other", data / "other.Github", elsewhere / "out.Github", data / "out.v2")
    for base in bases:
        for ext in (".bin", ".idx", ".counts.npy"):
            p = f"{base}{ext}"
            open(p, "w").write("user data")
            users.append(p)
    m = json.loads(open(f"{prefix}.manifest.json").read())
    for base in bases:
        m["outputs"].append(
            {
                "set": "Github",
                "prefix": str(base),
                "bin": f"{base}.bin",
                "idx": f"{base}.idx",
                "counts": f"{base}.counts.npy",
            }
        )
    open(f"{prefix}.manifest.json", "w").write(json.dumps(m))
    _tokenize(tokenize, [src], tokenizer_model, prefix, "--overwrite")  # no longer split by set
    assert all(open(p).read() == "user data" for p in users)
    # this prefix's own stale set shards are still removed
    assert not [
        p
        for p in os.listdir(data)
        if p.startswith("out.")
        and not p.startswith("out.v2.")
        and p not in ("out.bin", "out.idx", "out.counts.npy", "out.manifest.json")
    ]


# -- 3. merging: a failing in-kernel copy ------------------------------------------------------


def test_append_file_resumes_after_copy_file_range_fails_part_way(tmp_path, monkeypatch):
    real = os.copy_file_range
    calls = []

    def flaky(src, dst, count, *args):  # copies up to 1000 bytes, then fails on the next call
        calls.append(count)
        if len(calls) % 2 == 0:
            raise OSError(errno.EIO, "injected copy_file_range failure")
        return real(src, dst, min(count, 1000), *args)

    monkeypatch.setattr(os, "copy_file_range", flaky)
    blobs = [os.urandom(n) for n in (5000, 3000, 777, 1000, 12345)]
    for i, b in enumerate(blobs):
        (tmp_path / f"p{i}.bin").write_bytes(b)
    with open(tmp_path / "out.bin", "wb") as out:
        for i in range(len(blobs)):
            shards._append_file(str(tmp_path / f"p{i}.bin"), out)
    assert (tmp_path / "out.bin").read_bytes() == b"".join(blobs)
    assert len(calls) >= 5

    def always_fails(*a):
        raise OSError(errno.EXDEV, "injected")

    monkeypatch.setattr(os, "copy_file_range", always_fails)
    with open(tmp_path / "out2.bin", "wb") as out:
        for i in range(len(blobs)):
            shards._append_file(str(tmp_path / f"p{i}.bin"), out)
    assert (tmp_path / "out2.bin").read_bytes() == b"".join(blobs)


# -- 5. make_corpus and the demo ---------------------------------------------------------------


def _corpus(run_cli, out, *extra, check=True):
    return run_cli(
        "data_prep.make_corpus", out, "--sources", "github", "--max-mb", 0.3, *extra, check=check, timeout=200
    )


def test_make_corpus_force_replaces_only_its_own_corpus(run_cli, tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    p = _corpus(run_cli, user, "--force", check=False)
    _one_line_error(p, user, "make_corpus")
    assert sorted(os.listdir(user)) == ["thesis.tex"]
    out = tmp_path / "corpus"
    _corpus(run_cli, out, "--train-shards", 2)
    assert (out / "train" / "01.jsonl.zst").is_file()
    (out / "notes.txt").write_text("mine")
    (out / "train" / "mine.jsonl.zst").write_text("mine")
    _corpus(run_cli, out, "--force")
    assert (out / "notes.txt").read_text() == "mine" and (out / "train" / "mine.jsonl.zst").read_text() == "mine"
    assert sorted(os.listdir(out / "train")) == ["00.jsonl.zst", "mine.jsonl.zst"]  # stale 01 removed
    assert (out / "val.jsonl.zst").is_file() and (out / "test.jsonl.zst").is_file()


def test_demo_never_deletes_a_corpus_directory_it_did_not_write(tmp_path):
    from data_prep.demo_steps import run_demo

    out = tmp_path / "demo"
    (out / "corpus").mkdir(parents=True)
    (out / "corpus" / "mine.txt").write_text("mine")
    with pytest.raises(UserError, match="corpus"):
        run_demo(out, vocab_size=300, sample_mb=0.2, max_mb=0.3)
    assert (out / "corpus" / "mine.txt").read_text() == "mine"
    (out / "corpus.tmp").mkdir()
    (out / "corpus.tmp" / "mine.txt").write_text("mine")
    (out / "corpus" / "mine.txt").unlink()
    with pytest.raises(UserError, match="corpus.tmp"):
        run_demo(out, vocab_size=300, sample_mb=0.2, max_mb=0.3)
    assert (out / "corpus.tmp" / "mine.txt").read_text() == "mine"
