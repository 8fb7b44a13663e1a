"""The export behind ``lev export-hf`` (``python -m leviathan_pretrain.export_hf``, whose docstring and
docs/export.md say what the directory holds): the output directory checked, the run's checkpoint loaded and
converted (:mod:`.convert`), cast and checked finite, every file written into a staging directory beside ``DIR``
(the tokenizer by :mod:`.tokenizer`, our ``leviathan_export.json`` marker) and renamed into place; an existing
directory is replaced only when it is an export of ours and ``--overwrite`` says so.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from common.dtypes import DTYPES, long_name
from leviathan_pretrain.evaluation.load import load_trained
from leviathan_pretrain.hf.tokenizer import ExportError, special_ids, write_tokenizer
from leviathan_pretrain.model import counts

MARKER = "leviathan_export.json"
FORMAT = "leviathan-hf-export"
DTYPE_NAMES = {name: long_name(name) for name in DTYPES}  # --dtype -> torch / HF name (common/dtypes.py)


# ---------------------------------------------------------------- the output directory


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse an ``out`` that is a file, a link, or a non-empty directory that is not our export (or is, without
    ``overwrite``)."""
    if out.is_symlink():
        raise ExportError(f"{out}: is a symbolic link; give the real directory")
    if not out.exists():
        if not out.parent.is_dir():
            raise ExportError(f"{out.parent}: no such directory (the parent of --out)")
        return
    if not out.is_dir():
        raise ExportError(f"{out}: exists and is not a directory")
    if not any(out.iterdir()):
        return
    if not overwrite:
        raise ExportError(f"{out}: exists and is not empty; give --overwrite to replace an earlier export")
    try:
        mark = json.loads((out / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        mark = None
    if not isinstance(mark, dict) or mark.get("format") != FORMAT:
        raise ExportError(f"{out}: not an export of ours (no {MARKER}); refusing to replace it, --overwrite or not")


def move_into_place(tmp: Path, out: Path, overwrite: bool) -> None:
    check_out(out, overwrite)  # again: it may have changed while the model was converted
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        os.replace(tmp, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    old.rmdir()
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------- export


@dataclass
class Exported:
    out: Path
    files: list[str]
    parameters: int
    dtype: str
    variant: str
    tag: str
    step: int
    seconds: float
    tokenizer: str = ""
    counts: tuple[str, str] = ("", "")  # model/counts.py's exported_text and trained_text of the run


@dataclass
class Converted:
    """A checkpoint as a Hugging Face Llama: its ``LlamaConfig``, its tensors in the export dtype."""

    config: object  # transformers.LlamaConfig
    state: dict  # {HF name: tensor}
    ids: dict  # the tokenizer's special ids (hf.tokenizer.special_ids)
    parameters: int


def export(
    run_dir,
    out,
    step: int | None = None,
    checkpoint_dir=None,
    tokenizer=None,
    dtype: str = "bf16",
    overwrite: bool = False,
) -> Exported:
    """Write the HF export of a run's checkpoint to ``out`` (docs/export.md); inside ``eval_world``."""
    t0 = time.time()
    if dtype not in DTYPE_NAMES:
        raise ExportError(f"--dtype {dtype}: choose one of {', '.join(DTYPE_NAMES)}")
    out = Path(out).absolute()
    check_out(out, overwrite)
    trained = load_checked(run_dir, step, checkpoint_dir, tokenizer)
    converted = convert(trained, dtype)
    with _staging_dir(out) as tmp:
        tok_record = write_export(tmp, run_dir, trained, converted, dtype)
        files = publish(tmp, out, overwrite)
    return Exported(
        out,
        files,
        converted.parameters,
        dtype,
        trained.variant,
        trained.tag,
        trained.step,
        time.time() - t0,
        _tokenizer_note(trained.tokenizer, tok_record),
        _counts(trained, converted.parameters),
    )


def _counts(trained, parameters: int) -> tuple[str, str]:
    """The export's count and the run's trained parameters, in model/counts.py's words."""
    return counts.exported_text(trained.cfg.model, parameters), counts.trained_text(_trained_counts(trained))


def _trained_counts(trained) -> dict:
    """The run's trained parameters by part (model/counts.py ``param_summary``, at the TP it trained with)."""
    return counts.param_summary(trained.cfg.model, trained.record.layout.tp)


def load_checked(run_dir, step: int | None, checkpoint_dir, tokenizer):
    """The run's checkpoint (``load_trained``), refused without a tokenizer or with one larger than the model's
    vocabulary."""
    trained = load_trained(run_dir, step=step, checkpoint_dir=checkpoint_dir, tokenizer=tokenizer)
    if trained.tokenizer is None:
        where = tokenizer or trained.cfg.data.tokenizer or "(none recorded)"
        raise ExportError(f"{where}: the run's tokenizer is not found; give --tokenizer")
    tok = trained.tokenizer
    if tok.vocab_size > trained.vocab_size:
        raise ExportError(f"{tok.path}: {tok.vocab_size} ids, more than the model's vocab_size {trained.vocab_size}")
    return trained


def convert(trained, dtype: str) -> Converted:
    """The Llama config and tensors of ``trained`` (its model is released), checked and cast to ``dtype``."""
    # on use: .convert loads megatron-core (through evaluation.scoring), and the command answers bad input first
    from leviathan_pretrain.hf.convert import check_llama_layout, llama_config, llama_state_dict

    ids = special_ids(trained.tokenizer)
    config = llama_config(trained.cfg, ids, DTYPE_NAMES[dtype])
    state = llama_state_dict(trained.model, trained.cfg)
    del trained.model
    check_llama_layout(config, state)
    state = {k: v.to(getattr(torch, DTYPE_NAMES[dtype])) for k, v in state.items()}
    bad = [k for k, v in state.items() if not torch.isfinite(v).all()]
    if bad:
        raise ExportError(f"{bad[0]}: not finite in {dtype} (overflow?); export with --dtype bf16 or fp32")
    return Converted(config, state, ids, sum(v.numel() for v in state.values()))


@contextmanager
def _staging_dir(out: Path):
    """A fresh ordinary directory beside ``out``, removed on the way out unless it was moved into place."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _public(tmp, 0o777)  # mkdtemp makes it private; the export is an ordinary directory
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def write_export(tmp: Path, run_dir, trained, converted: Converted, dtype: str) -> dict:
    """Every file of the export into ``tmp``; the tokenizer's record (``write_tokenizer``)."""
    # transformers on use, as in .convert: importing it takes seconds, and the command answers bad input first
    from transformers import GenerationConfig

    ids = converted.ids
    converted.config.save_pretrained(str(tmp))
    conf = json.loads((tmp / "config.json").read_text())  # older readers: rope_theta, torch_dtype
    conf.update(rope_theta=float(trained.cfg.model.rotary_base), torch_dtype=DTYPE_NAMES[dtype])
    (tmp / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    pad = ids["pad"] if ids["pad"] is not None else ids["eos"]
    GenerationConfig(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=pad).save_pretrained(str(tmp))
    save_file(converted.state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tok_record = write_tokenizer(trained.tokenizer, tmp)
    marker = _marker(run_dir, trained, tok_record, dtype, converted.parameters)
    (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return tok_record


def _marker(run_dir, trained, tok_record: dict, dtype: str, parameters: int) -> dict:
    """``leviathan_export.json``: where the export came from."""
    tok = trained.tokenizer
    return {
        "format": FORMAT,
        "version": 1,
        "source_run": str(Path(run_dir).absolute()),
        "checkpoint_dir": str(trained.ckpt_dir.absolute()),
        "tag": trained.tag,
        "step": trained.step,
        "variant": trained.variant,
        "vocab_size": trained.vocab_size,
        "tokenizer": str(Path(tok.path).absolute()),
        "tokenizer_kind": tok.kind,
        "tokenizer_sha256": tok.file_sha256,
        "tokenizer_fingerprint": tok.fingerprint,
        **tok_record,
        "dtype": dtype,
        "parameters": parameters,  # the exported parameters (model/counts.py): the Llama's, embed_tokens V x D
        "trained_parameters": _trained_counts(trained)["total"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def publish(tmp: Path, out: Path, overwrite: bool) -> list[str]:
    """Make ``tmp``'s files ordinary and rename it to ``out``; the names of the files."""
    files = sorted(p.name for p in tmp.iterdir())
    for f in files:
        _public(tmp / f, 0o666)
    move_into_place(tmp, out, overwrite)
    return files


def _tokenizer_note(tok, tok_record: dict) -> str:
    note = f"{tok.kind} {Path(tok.path).name} -> {', '.join(tok_record['tokenizer_files'])}"
    if tok_record.get("post_processor_removed_ids"):
        note += (
            f" (without the source's post-processor, which adds ids {tok_record['post_processor_removed_ids']}: "
            "the training data has none)"
        )
    return note


def _public(path: Path, mode: int) -> None:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, mode & ~umask)
