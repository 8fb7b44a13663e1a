"""Export a trained run as a Hugging Face ``LlamaForCausalLM`` directory: ``python -m leviathan_pretrain.export_hf``.

``python -m leviathan_pretrain.export_hf --run RUN --out DIR [--step N] [--checkpoint-dir D] [--tokenizer T]
[--dtype bf16|fp32|fp16] [--overwrite]`` loads the checkpoint with :func:`~.evaluation.load.load_trained` (TP /
PP shards merged, ZeRO-3 partitions gathered) and writes into ``DIR``:

- ``config.json`` (``LlamaConfig``), ``generation_config.json``, ``model.safetensors``;
- the tokenizer, for each kind (:mod:`~.hf.tokenizer`): a SentencePiece run's ``tokenizer.model``
  with transformers' ``LlamaTokenizer`` files, a Hugging Face run's ``tokenizer.json`` as it is, a tiktoken run's
  encoding converted to a fast byte-level BPE ``tokenizer.json``; each with a ``tokenizer_config.json`` adding no
  BOS / EOS, loaded back with ``AutoTokenizer`` and checked to give the run's ids on probe texts before writing;
- ``leviathan_export.json``: where it came from (run, tag, step, variant, tokenizer kind / sha256, dtype), its
  ``parameters`` (the exported parameters) and the run's ``trained_parameters`` (model/counts.py: the export has
  more for LEV, ALBERT and the MLP ablations, whose input layer becomes a whole ``V x D`` table, and fewer for TIED
  and UNTIED, whose padded vocabulary rows are dropped).

Every input variant exports as a plain Llama: TIED / UNTIED tables are copied, the input layer of LEV, ALBERT
and the MLP ablations is a function of the token id alone and is materialised into the dense ``[V, D]``
``embed_tokens`` table (``UniqueIdInput.materialize``). The padded vocabulary rows (``make_vocab_size_divisible_by``)
are dropped: HF ``vocab_size`` is ``model.vocab_size``. megatron-core's fused tensors are split: ``linear_qkv``
(interleaved per query group: ``[q heads of the group; k; v]``) into ``q_proj`` / ``k_proj`` / ``v_proj``,
``linear_fc1`` (``[gate; up]``) into ``gate_proj`` / ``up_proj``. docs/export.md has the whole table.

The directory is written beside ``DIR`` and renamed into place. An existing non-empty ``DIR`` is refused unless
``--overwrite``, and even then only a directory holding our ``leviathan_export.json`` is replaced. Bad input
prints one ``error: ...`` line naming the file and exits 2. Nothing is downloaded (``local_files_only``).

The conversion itself (and :func:`~.hf.convert.greedy_decode`, the reference for HF ``generate()``)
is in :mod:`leviathan_pretrain.hf.convert`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from common import cli
from common.dtypes import DTYPES, long_name

MARKER = "leviathan_export.json"
FORMAT = "leviathan-hf-export"
DTYPE_NAMES = {name: long_name(name) for name in DTYPES}  # --dtype -> torch / HF name (common/dtypes.py)


# ---------------------------------------------------------------- the output directory


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse an ``out`` that is a file, a link, or a non-empty directory that is not our export (or is, without
    ``overwrite``)."""
    from leviathan_pretrain.hf.tokenizer import ExportError

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
    """Write the HF export of a run's checkpoint to ``out`` (see the module doc); inside ``eval_world``."""
    from leviathan_pretrain.hf.tokenizer import ExportError

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
    from leviathan_pretrain.model import counts

    return counts.exported_text(trained.cfg.model, parameters), counts.trained_text(_trained_counts(trained))


def _trained_counts(trained) -> dict:
    """The run's trained parameters by part (model/counts.py ``param_summary``, at the TP it trained with)."""
    from leviathan_pretrain.model import counts

    return counts.param_summary(trained.cfg.model, trained.record.layout.tp)


def load_checked(run_dir, step: int | None, checkpoint_dir, tokenizer):
    """The run's checkpoint (``load_trained``), refused without a tokenizer or with one larger than the model's
    vocabulary."""
    from leviathan_pretrain.evaluation.load import load_trained
    from leviathan_pretrain.hf.tokenizer import ExportError

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
    import torch

    from leviathan_pretrain.hf.convert import check_llama_layout, llama_config, llama_state_dict
    from leviathan_pretrain.hf.tokenizer import ExportError, special_ids

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
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from leviathan_pretrain.hf.tokenizer import write_tokenizer

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


def _size(path: Path) -> str:
    n = path.stat().st_size
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m leviathan_pretrain.export_hf",
        description="Export a trained run's checkpoint as a Hugging Face LlamaForCausalLM directory "
        "(config.json, model.safetensors, tokenizer); see docs/export.md.",
    )
    cli.add_run(ap, "the training run directory (train.out_dir)", required=True)
    cli.add_checkpoint_options(ap, "export")
    cli.add_out(ap, "the export directory to create", required=True, metavar="DIR")
    cli.add_dtype(ap, "bf16", "weight dtype")
    cli.add_overwrite(ap, "replace an earlier export in DIR (only one of ours)")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # the export runs on the CPU; set before DeepSpeed loads
    os.environ.setdefault("TQDM_DISABLE", "1")  # DeepSpeed's zero_to_fp32 progress bars (ZeRO-3 checkpoints)

    from leviathan_pretrain.evaluation.load import EvalError

    return cli.run_main(_export, args, errors=(EvalError,))  # hf.tokenizer.ExportError included


def _export(args) -> int:
    from leviathan_pretrain.evaluation.load import checkpoint_location, eval_world, select_tag

    try:
        check_out(Path(args.out).absolute(), args.overwrite)  # answer bad input before megatron-core loads
        select_tag(checkpoint_location(args.run, args.checkpoint_dir), args.step)
        with eval_world("cpu"):
            done = export(
                args.run, args.out, args.step, args.checkpoint_dir, args.tokenizer, args.dtype, args.overwrite
            )
    except OSError as e:
        print(f"error: {e.filename or args.out}: {e.strerror or e}", file=sys.stderr, flush=True)
        return 1
    files = ", ".join(f"{f} ({_size(done.out / f)})" if f == "model.safetensors" else f for f in done.files)
    print(
        f"exported {done.variant} {done.tag} (step {done.step}) of {args.run} as LlamaForCausalLM to {done.out}\n"
        f"  {done.counts[0]}, dtype {DTYPE_NAMES[done.dtype]}\n"
        f"  the run's {done.counts[1]}\n"
        f"  files: {files}\n"
        f"  tokenizer: {done.tokenizer}\n"
        f"  load: AutoModelForCausalLM.from_pretrained({str(done.out)!r}); AutoTokenizer.from_pretrained(same)\n"
        f"  done in {done.seconds:.1f} s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
