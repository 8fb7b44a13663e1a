"""Which checkpoint a start resumes from (trainer/checkpoint/resume.py), checked before loading: the rules of
``latest``, start_over, resume_from, verify() and fallback; the resume keys of the config. Pruning and the clean-up
of interrupted saves: tests/test_ckpt_prune.py."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from leviathan_pretrain.config import ConfigError, load_config, to_dict
from leviathan_pretrain.trainer.checkpoint.names import LATEST, META, SAVING, CheckpointError
from leviathan_pretrain.trainer.checkpoint.record import CheckpointRecord
from leviathan_pretrain.trainer.checkpoint.resume import APPLIED, Resume, choose, manifest, move_aside, verify

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny-cpu-lev.yaml"
CFG_DICT = to_dict(load_config(CONFIG))
PT_FILES = ("mp_rank_00_model_states.pt", "rng_rank00000.pt")
STAMP = r"\d{8}T\d{6}Z(-\d+)?"
WHEN = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ"


def cfg(*over: str):
    return load_config(CONFIG, list(over))


def make_ckpt(ckpt_dir: Path, step: int, files=PT_FILES) -> Path:
    """A complete checkpoint folder: small torch files, a script, and leviathan.json listing them."""
    d = ckpt_dir / f"global_step{step}"
    d.mkdir(parents=True)
    for name in files:
        torch.save({"w": torch.ones(3) * step}, d / name)
    (d / "zero_to_fp32.py").write_text("# DeepSpeed's script\n")
    record = CheckpointRecord(
        config=CFG_DICT, step=step, consumed_samples=8 * step, tag=f"global_step{step}", files=manifest(d)
    )
    (d / META).write_text(record.dumps())
    return d


def make_interrupted(ckpt_dir: Path, step: int, mark: dict | None = None) -> Path:
    d = ckpt_dir / f"global_step{step}"
    d.mkdir(parents=True)
    torch.save({"w": torch.zeros(2)}, d / PT_FILES[0])
    (d / SAVING).write_text(json.dumps(mark if mark is not None else {"step": step, "host": "elsewhere", "pid": 1}))
    return d


def run_dir(tmp_path: Path, steps=(10, 20, 30), latest: str | None = "last") -> Path:
    c = tmp_path / "checkpoints"
    c.mkdir(parents=True)
    for s in steps:
        make_ckpt(c, s)
    if latest == "last":
        latest = f"global_step{steps[-1]}"
    if latest is not None:
        (c / LATEST).write_text(latest)
    return c


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path below ``root`` with its bytes (None: a folder): to show what changed."""
    return {str(p.relative_to(root)): (None if p.is_dir() else p.read_bytes()) for p in sorted(Path(root).rglob("*"))}


def truncate(f: Path, keep: int = 40) -> None:
    f.write_bytes(f.read_bytes()[:keep])


def rerecord(d: Path) -> None:
    """leviathan.json listing the folder's files as they are now (the size check passes; the zip check decides)."""
    r = CheckpointRecord.read(d)
    r.files = manifest(d)
    (d / META).write_text(r.dumps())


def applied(c: Path) -> dict:
    """leviathan.applied.json as {key: value}, after checking each entry's time."""
    data = json.loads((c / APPLIED).read_text())
    assert all(re.fullmatch(WHEN, v["time"]) for v in data.values()), data
    return {k: v["value"] for k, v in data.items()}


def already(c: Path, key: str, value) -> str:
    """The note of a one-shot key this directory already applied (its time read from the marker)."""
    when = json.loads((c / APPLIED).read_text())[key]["time"]
    return f"checkpoint.{key}={value} was already applied here at {when} ({c / APPLIED}): resuming this run as usual"


def the(c: Path, prefix: str) -> Path:
    (d,) = [p for p in c.iterdir() if p.name.startswith(prefix)]
    return d


def put_back(c: Path, prefix: str) -> dict[str, bytes | None]:
    """tree(c) with what was moved into the folders ``prefix*`` put back where it was (to compare with before)."""
    out = {}
    for k, v in tree(c).items():
        top, _, rest = k.partition("/")
        if not top.startswith(prefix) or rest:
            out[rest if top.startswith(prefix) else k] = v
    return out


# ---- the rules of latest ----


def test_nothing_at_all_is_a_new_run(tmp_path):
    assert choose(cfg(), tmp_path / "absent") == Resume()
    (tmp_path / "empty").mkdir()
    assert choose(cfg(), tmp_path / "empty") == Resume()
    assert os.listdir(tmp_path / "empty") == []
    make_interrupted(tmp_path / "empty", 20)  # latest missing, only interrupted saves: a new run too
    assert choose(cfg(), tmp_path / "empty") == Resume()


@pytest.mark.parametrize(
    "over", ["checkpoint.resume=true", "checkpoint.fallback=true", "checkpoint.resume_from=global_step30"]
)
def test_latest_names_the_checkpoint_to_resume(tmp_path, over):
    c = run_dir(tmp_path)
    before = tree(c)
    r = choose(cfg(over), c)
    note = "resuming from global_step30 (checkpoint.resume_from)" if "resume_from" in over else None
    assert (r.tag, r.note) == ("global_step30", note)
    assert (r.record.step, r.record.consumed_samples, r.record.tag) == (30, 240, "global_step30")
    assert r.record.files == manifest(c / "global_step30") and r.record.files["zero_to_fp32.py"] == 21
    assert sorted(r.record.files) == sorted([*PT_FILES, "zero_to_fp32.py"])
    if note:  # resume_from the checkpoint latest names: nothing moved, latest as it was; the marker recorded
        assert applied(c) == {"resume_from": "global_step30"}
        before[APPLIED] = (c / APPLIED).read_bytes()
    assert tree(c) == before


@pytest.mark.parametrize(
    "latest, problem",
    [
        (None, "is missing"),
        ("", "is empty"),
        ("  \n", "is empty"),
        (b"\xff\xfe\x00", "is unreadable"),
        ("global_step40", "names 'global_step40', which is not a complete checkpoint"),
        ("global_step35", "names 'global_step35', which is not a complete checkpoint"),  # an interrupted save
        ("../elsewhere", "names '../elsewhere', which is not a complete checkpoint"),
    ],
)
def test_a_missing_or_wrong_latest_resumes_from_the_newest_complete(tmp_path, latest, problem):
    c = run_dir(tmp_path, steps=(9, 10, 20), latest=None)  # 9 < 10 < 20: by step, not by name
    make_interrupted(c, 35)
    if isinstance(latest, bytes):
        (c / LATEST).write_bytes(latest)
    elif latest is not None:
        (c / LATEST).write_text(latest)
    before = tree(c)
    r = choose(cfg(), c)
    assert r.tag == "global_step20" and r.record.step == 20
    assert r.note.startswith(f"{c / LATEST} {problem}")
    assert r.note.endswith("; resuming from the newest complete checkpoint global_step20")
    assert "\n" not in r.note
    assert tree(c) == {**before, LATEST: b"global_step20"}  # latest names it now; nothing else changed


@pytest.mark.parametrize("latest", ["", "global_step20", "junk"])
def test_latest_naming_something_without_a_complete_checkpoint_stops(tmp_path, latest):
    c = tmp_path / "checkpoints"
    c.mkdir()
    (c / LATEST).write_text(latest)
    make_interrupted(c, 20)
    (c / "notes.txt").write_text("mine")
    before = tree(c)
    with pytest.raises(CheckpointError) as e:
        choose(cfg(), c)
    msg = str(e.value)
    assert msg.startswith(f"{c / LATEST} ") and f"and {c} holds no complete checkpoint" in msg
    assert "checkpoint.start_over=true" in msg and "\n" not in msg
    assert tree(c) == before


def test_resume_false_refuses_a_directory_with_checkpoints(tmp_path):
    c = run_dir(tmp_path)
    before = tree(c)
    with pytest.raises(ConfigError) as e:
        choose(cfg("checkpoint.resume=false"), c)
    msg = str(e.value)
    assert msg.startswith(f"checkpoint.resume: false, but {c} already holds checkpoints (global_step10, ")
    assert "checkpoint.start_over=true" in msg and "moved aside, not deleted" in msg
    assert tree(c) == before
    assert choose(cfg("checkpoint.resume=false"), tmp_path / "absent") == Resume()


# ---- start_over ----


def test_start_over_moves_our_checkpoints_aside_once_and_leaves_the_rest(tmp_path):
    c = run_dir(tmp_path, steps=(10, 20))
    make_interrupted(c, 30)
    (c / "notes.txt").write_text("a user's file")
    (c / "global_step99").mkdir()  # not ours (no marks): left where it is
    (c / "global_step99" / "x.pt").write_bytes(b"theirs")
    (c / "my_eval").mkdir()
    before = tree(c)
    r = choose(cfg("checkpoint.start_over=true"), c)
    assert (r.tag, r.record) == (None, None)
    dest = the(c, "replaced-")
    assert re.fullmatch(f"replaced-{STAMP}", dest.name)
    assert r.note == f"checkpoint.start_over: a new run starts; the earlier checkpoints were moved into {dest}"
    assert sorted(os.listdir(c)) == sorted(["global_step99", "my_eval", APPLIED, "notes.txt", dest.name])
    assert applied(c) == {"start_over": True}
    assert sorted(os.listdir(dest)) == ["global_step10", "global_step20", "global_step30", LATEST]
    assert put_back(c, "replaced-") == {**before, APPLIED: (c / APPLIED).read_bytes()}  # every byte kept
    make_ckpt(c, 10)  # the new run saves; then it is requeued with the same command
    (c / LATEST).write_text("global_step10")
    before = tree(c)
    r = choose(cfg("checkpoint.start_over=true"), c)
    assert (r.tag, r.record.step, r.note) == ("global_step10", 10, already(c, "start_over", True))
    assert tree(c) == before  # one-shot: the new run's checkpoints stay where they are
    again = move_aside(c, ["global_step10", "global_step30"], "replaced")  # 30 is not there: skipped
    assert again != dest and re.fullmatch(f"replaced-{STAMP}", again.name)  # never reused, even in the same second
    assert sorted(os.listdir(again)) == ["global_step10", LATEST] and the(c, "global_step").name == "global_step99"


def test_start_over_with_nothing_or_only_latest_there(tmp_path):
    c = tmp_path / "checkpoints"
    c.mkdir()
    (c / "notes.txt").write_text("x")
    new_run = Resume(note="checkpoint.start_over: a new run starts")
    assert choose(cfg("checkpoint.start_over=true"), c) == new_run  # nothing to move: the marker is recorded
    assert sorted(os.listdir(c)) == [APPLIED, "notes.txt"] and applied(c) == {"start_over": True}
    assert choose(cfg("checkpoint.start_over=true"), tmp_path / "absent") == new_run
    assert os.listdir(tmp_path / "absent") == [APPLIED]  # the directory is created for the marker
    c = tmp_path / "only_latest"
    c.mkdir()
    (c / LATEST).write_text("global_step5")
    r = choose(cfg("checkpoint.start_over=true", "checkpoint.resume=false"), c)
    dest = the(c, "replaced-")
    assert sorted(os.listdir(c)) == [APPLIED, dest.name]
    assert os.listdir(dest) == [LATEST] and r.note.endswith(f"moved into {dest}")


def test_a_requeue_of_start_over_with_resume_false_resumes_its_run(tmp_path):
    """``checkpoint.start_over=true checkpoint.resume=false`` (a new run, twice): a requeue resumes that run."""
    c = run_dir(tmp_path, steps=(10, 20))
    over = ("checkpoint.start_over=true", "checkpoint.resume=false")
    assert choose(cfg(*over), c).tag is None
    make_ckpt(c, 5)
    (c / LATEST).write_text("global_step5")
    r = choose(cfg(*over), c)
    assert r.tag == "global_step5" and r.note == already(c, "start_over", True)


# ---- resume_from ----


def test_resume_from_picks_a_checkpoint_and_moves_the_newer_ones_aside(tmp_path):
    c = run_dir(tmp_path)
    make_interrupted(c, 35)
    (c / "notes.txt").write_text("a user's file")
    (c / "global_step99").mkdir()  # not ours (no marks): left where it is
    (c / "global_step99" / "x.pt").write_bytes(b"theirs")
    before = tree(c)
    r = choose(cfg("checkpoint.resume_from=global_step20"), c)
    assert (r.tag, r.record.step) == ("global_step20", 20)
    dest = the(c, "abandoned-")
    assert re.fullmatch(f"abandoned-{STAMP}", dest.name)
    assert r.note == (
        "resuming from global_step20 (checkpoint.resume_from); "
        f"the newer global_step30, global_step35 moved into {dest}"
    )
    assert sorted(os.listdir(dest)) == ["global_step30", "global_step35"]
    assert applied(c) == {"resume_from": "global_step20"}
    marker = (c / APPLIED).read_bytes()
    assert put_back(c, "abandoned-") == {**before, LATEST: b"global_step20", APPLIED: marker}  # nothing else changed


def test_resume_from_is_one_shot_a_different_value_applies_again(tmp_path):
    c = run_dir(tmp_path)
    choose(cfg("checkpoint.resume_from=global_step20"), c)
    first = the(c, "abandoned-")
    make_ckpt(c, 30)  # the resumed run saves newer ones
    make_ckpt(c, 40)
    (c / LATEST).write_text("global_step40")
    before = tree(c)
    r = choose(cfg("checkpoint.resume_from=global_step20"), c)  # the requeue: resumes from latest
    assert (r.tag, r.note) == ("global_step40", already(c, "resume_from", "global_step20"))
    assert tree(c) == before
    r = choose(cfg("checkpoint.resume_from=global_step10"), c)
    assert r.tag == "global_step10" and (c / LATEST).read_text() == "global_step10"
    second = next(p for p in c.iterdir() if p.name.startswith("abandoned-") and p != first)
    assert r.note.endswith(f"the newer global_step20, global_step30, global_step40 moved into {second}")
    assert sorted(os.listdir(c)) == sorted([first.name, second.name, "global_step10", LATEST, APPLIED])
    assert applied(c) == {"resume_from": "global_step10"}


@pytest.mark.parametrize("tag", ["global_step25", "global_step35"])
def test_resume_from_a_tag_that_is_not_complete_is_refused(tmp_path, tag):
    c = run_dir(tmp_path)
    make_interrupted(c, 35)
    before = tree(c)
    with pytest.raises(ConfigError) as e:
        choose(cfg(f"checkpoint.resume_from={tag}"), c)
    assert tree(c) == before  # no marker, nothing moved
    assert str(e.value) == (
        f"checkpoint.resume_from: {c / tag} is not a complete checkpoint (complete: global_step10, global_step20, "
        "global_step30)"
    )


def test_a_latest_folder_stops_naming_it(tmp_path):
    c = run_dir(tmp_path, steps=(10, 20), latest=None)
    (c / LATEST).mkdir()
    before = tree(c)
    with pytest.raises(CheckpointError, match=f"^{c / LATEST} is a folder, not the file naming the latest checkpoint"):
        choose(cfg(), c)
    assert tree(c) == before


def test_resume_from_an_unusable_checkpoint_without_fallback_changes_nothing(tmp_path):
    c = run_dir(tmp_path)
    truncate(c / "global_step20" / PT_FILES[0])
    before = tree(c)
    with pytest.raises(CheckpointError, match="global_step20 is unusable: .*Nothing was changed"):
        choose(cfg("checkpoint.resume_from=global_step20"), c)
    assert tree(c) == before


# ---- verify ----


def test_manifest_lists_every_file_but_our_marks(tmp_path):
    d = make_ckpt(tmp_path, 10)
    (d / "sub").mkdir()
    (d / "sub" / "part.bin").write_bytes(b"12345")
    (d / SAVING).write_text("{}")
    m = manifest(d)
    assert sorted(m) == [*sorted(PT_FILES), "sub/part.bin", "zero_to_fp32.py"]
    assert m["sub/part.bin"] == 5 and m[PT_FILES[0]] == (d / PT_FILES[0]).stat().st_size


def test_verify_names_the_file_that_does_not_check_out(tmp_path):
    d = make_ckpt(tmp_path, 10)
    assert verify(tmp_path, "global_step10").step == 10
    f = d / PT_FILES[1]
    size = f.stat().st_size
    with open(f, "ab") as h:
        h.write(b"x")
    with pytest.raises(CheckpointError, match=re.escape(f"{f}: {size + 1} bytes where {META} recorded {size}")):
        verify(tmp_path, "global_step10")
    f.unlink()
    with pytest.raises(CheckpointError, match=re.escape(f"{f}: No such file or directory (listed in {d / META})")):
        verify(tmp_path, "global_step10")
    torch.save({"w": torch.ones(3) * 10}, f)
    verify(tmp_path, "global_step10")
    truncate(d / PT_FILES[0])
    rerecord(d)  # sizes as they are: the zip check finds it
    with pytest.raises(CheckpointError, match=re.escape(f"{d / PT_FILES[0]}: not a whole torch file (")):
        verify(tmp_path, "global_step10")
    (d / PT_FILES[0]).unlink()
    rerecord(d)
    (d / "extra.pt").write_bytes(b"not a zip at all")  # a *.pt not listed is checked too
    with pytest.raises(CheckpointError, match="extra.pt: not a whole torch file"):
        verify(tmp_path, "global_step10")
    r = CheckpointRecord.read(d)
    r.files = None  # written before records listed their files: the torch files are still checked
    (d / META).write_text(r.dumps())
    with pytest.raises(CheckpointError, match="extra.pt: not a whole torch file"):
        verify(tmp_path, "global_step10")
    (d / "extra.pt").unlink()
    assert verify(tmp_path, "global_step10").files is None
    (d / META).write_text("{")
    with pytest.raises(CheckpointError, match=re.escape(f"{d / META}: unreadable")):
        verify(tmp_path, "global_step10")


# ---- unusable checkpoints and fallback ----


def test_an_unusable_checkpoint_stops_naming_the_file_and_the_older_one(tmp_path):
    c = run_dir(tmp_path)
    f = c / "global_step30" / PT_FILES[0]
    truncate(f)
    before = tree(c)
    with pytest.raises(CheckpointError) as e:
        choose(cfg(), c)
    msg = str(e.value)
    assert msg.startswith(f"checkpoint global_step30 is unusable: {f}: ")
    assert "Nothing was changed" in msg and "older complete checkpoint global_step20" in msg
    assert "checkpoint.fallback=true" in msg and "checkpoint.resume_from=global_step20" in msg
    assert "\n" not in msg
    assert tree(c) == before
    c = run_dir(tmp_path / "one", steps=(10,))
    (c / "global_step10" / META).write_text("[]")
    with pytest.raises(CheckpointError, match="global_step10 is unusable: .*there is no older complete checkpoint"):
        choose(cfg(), c)


def test_fallback_moves_the_unusable_aside_and_resumes_from_the_older_intact_one(tmp_path):
    c = run_dir(tmp_path, steps=(10, 20, 30, 40), latest="global_step30")
    truncate(c / "global_step30" / PT_FILES[0])
    rerecord(c / "global_step30")  # sizes match: only the zip check finds it
    (c / "global_step20" / PT_FILES[1]).write_bytes(b"short")  # size differs from the record
    (c / "notes.txt").write_text("mine")
    before = tree(c)
    r = choose(cfg("checkpoint.fallback=true"), c)
    assert (r.tag, r.record.step) == ("global_step10", 10)  # never the newer global_step40: latest said 30
    d30, d20 = the(c, "unusable-global_step30-"), the(c, "unusable-global_step20-")
    assert re.fullmatch(f"unusable-global_step30-{STAMP}", d30.name)
    assert r.note.startswith(f"checkpoint.fallback: global_step30 is unusable ({c / 'global_step30' / PT_FILES[0]}")
    assert f"moved into {d30}; checkpoint.fallback: global_step20 is unusable (" in r.note
    assert r.note.endswith(f"moved into {d20}; resuming from global_step10")
    assert sorted(os.listdir(c)) == sorted(["global_step10", "global_step40", LATEST, "notes.txt", d20.name, d30.name])
    assert os.listdir(d30) == ["global_step30"] and os.listdir(d20) == ["global_step20"]
    assert put_back(c, "unusable-") == {**before, LATEST: b"global_step10"}  # nothing deleted; latest names it


def test_fallback_keeps_the_notes_before_it(tmp_path):
    c = run_dir(tmp_path, latest=None)
    truncate(c / "global_step30" / PT_FILES[0])
    r = choose(cfg("checkpoint.fallback=true"), c)
    d30 = the(c, "unusable-global_step30-")
    assert r.note.startswith(
        f"{c / LATEST} is missing; resuming from the newest complete checkpoint global_step30; "
        f"checkpoint.fallback: global_step30 is unusable ({c / 'global_step30' / PT_FILES[0]}: "
    )
    assert r.note.endswith(f"), moved into {d30}; resuming from global_step20")
    assert r.tag == "global_step20" and (c / LATEST).read_text() == "global_step20"
    c = run_dir(tmp_path / "resume_from")  # with resume_from: its note first, the abandoned ones last
    truncate(c / "global_step20" / PT_FILES[0])
    r = choose(cfg("checkpoint.fallback=true", "checkpoint.resume_from=global_step20"), c)
    gone, bad = the(c, "abandoned-"), the(c, "unusable-global_step20-")
    assert r.tag == "global_step10" and (c / LATEST).read_text() == "global_step10"
    assert r.note.startswith(
        "resuming from global_step20 (checkpoint.resume_from); checkpoint.fallback: global_step20 is unusable ("
    )
    assert r.note.endswith(f"moved into {bad}; resuming from global_step10; the newer global_step30 moved into {gone}")
    assert os.listdir(gone) == ["global_step30"] and applied(c) == {"resume_from": "global_step20"}


def test_fallback_with_nothing_usable_stops(tmp_path):
    c = run_dir(tmp_path, steps=(10, 20))
    for s in (10, 20):
        truncate(c / f"global_step{s}" / PT_FILES[0])
    with pytest.raises(CheckpointError) as e:
        choose(cfg("checkpoint.fallback=true"), c)
    assert str(e.value).startswith(f"no usable checkpoint in {c}: checkpoint.fallback: global_step20 is unusable (")
    assert "; checkpoint.fallback: global_step10 is unusable (" in str(e.value)
    assert len([p for p in c.iterdir() if p.name.startswith("unusable-")]) == 2
    assert (c / LATEST).read_text() == "global_step20"  # refused: latest is not rewritten


# ---- the config ----


@pytest.mark.parametrize(
    "over, says",
    [
        ("checkpoint.resume_from=step400", "must be a checkpoint tag like global_step400"),
        ("checkpoint.resume_from=global_step", "got 'global_step'"),
        ("checkpoint.resume_from=global_step4x", "got 'global_step4x'"),
        ("checkpoint.resume_from=400", "got '400'"),
        ("checkpoint.resume_from=global_step1/..", "must be a checkpoint tag"),
        (
            "checkpoint.start_over=true,checkpoint.resume_from=global_step4",
            "cannot be combined with checkpoint.resume_",
        ),
        ("checkpoint.fallback=yes please", "expected true/false"),
    ],
)
def test_resume_keys_are_checked(over, says):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIG, over.split(","))
    assert f"{over.split('=')[0]}: " in str(e.value) and says in str(e.value)  # names the key


def test_resume_key_defaults():
    c = load_config(CONFIG).checkpoint
    assert (c.resume, c.resume_from, c.fallback, c.start_over) == (True, None, False, False)
    assert load_config(CONFIG, ["checkpoint.resume_from=global_step400"]).checkpoint.resume_from == "global_step400"
