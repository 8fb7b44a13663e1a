"""What ``python -m data_prep.tokenize`` runs: its parsed arguments checked into the :class:`data_prep.parts.Job`
of the run (inputs, tokenizer, dtype, set filter, reader settings, output prefix and work dir), and the summary of
the run's :class:`data_prep.manifest.Manifest` printed at the end.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from common.cli import UserError
from data_prep.console import human_bytes, log
from data_prep.input_files import expand_inputs, input_format
from data_prep.manifest import Manifest
from data_prep.outputs import existing_outputs, plain_text_hint
from data_prep.parts import Job
from data_prep.pile_sets import make_set_filter
from data_prep.shards import choose_dtype
from data_prep.tokenizer import open_tokenizer
from data_prep.workdir import work_dir_for


def make_job(args: argparse.Namespace, argv) -> Job:
    """The job of the parsed command line (``argv``: as given, for the manifest); UserError if it is unusable."""
    if args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
    if args.batch_bytes <= 0:
        raise UserError(f"--batch-bytes must be > 0, got {args.batch_bytes}")
    if args.max_record_bytes <= 0:
        raise UserError(f"--max-record-bytes must be > 0, got {args.max_record_bytes}")
    max_record = max(1, int(args.max_record_bytes * 1e6))
    inputs = expand_inputs(args.input)
    for p in inputs:
        input_format(p, args.format)
    tok = open_tokenizer(args.tokenizer, pattern=args.tiktoken_pattern, eod_token=args.eod_token)
    dtype = choose_dtype(tok.vocab_size, args.dtype)
    sf = make_set_filter(args.include_sets, args.exclude_sets, args.preset)
    chunk = max(0, args.chunk_bytes)
    if chunk and not tok.chunk_safe():
        log(
            "note: this tokenizer may merge across newlines or normalizes whitespace; encoding whole "
            "documents (no --chunk-bytes speed-up)"
        )
        chunk = 0
    prefix = args.out
    _check_output_prefix(prefix, args.overwrite)
    reader_kwargs = {
        "fmt": args.format,
        "json_key": args.json_key,
        "text_unit": args.text_unit,
        "set_filter": sf,
        "on_bad": args.on_bad_record,
        "batch_bytes": max(1, int(args.batch_bytes * 1e6)),
        "max_record_bytes": max_record,
    }
    options = {
        "json_key": args.json_key,
        "format": args.format,
        "text_unit": args.text_unit,
        "on_bad_record": args.on_bad_record,
        "preset": args.preset,
        "max_record_bytes": max_record,
        **sf.describe(),
    }
    return Job(
        inputs=inputs,
        tok=tok,
        dtype=dtype,
        out_prefix=prefix,
        work_dir=work_dir_for(prefix, args.work_dir),
        workers=args.workers,
        split_by_set=args.split_by_set,
        reader_kwargs=reader_kwargs,
        options=options,
        overwrite=args.overwrite,
        keep_work=args.keep_work,
        command=["python", "-m", "data_prep.tokenize", *(argv or sys.argv[1:])],
        progress_interval=args.log_interval,
        show_progress=not args.quiet,
        chunk_bytes=chunk,
    )


def _check_output_prefix(prefix: str, overwrite: bool) -> None:
    """PREFIX names files in a writable directory (created if missing) and, without --overwrite, none exist."""
    if prefix.endswith(("/", os.sep)) or os.path.isdir(prefix):
        raise UserError(f"--out must name files, not a directory: {prefix} (e.g. {prefix.rstrip('/')}/train)")
    if not overwrite:
        found = existing_outputs(prefix)
        if found:
            raise UserError(f"output already exists: {found[0]} (pass --overwrite to replace it)")
    parent = Path(prefix).parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create output directory {parent}: {e.strerror}") from None
    if not os.access(parent, os.W_OK):
        raise UserError(f"output directory is not writable: {parent}")


def summary(m: Manifest) -> str:
    secs = m.elapsed_s
    lines = [f"wrote {len(m.outputs)} shard pair(s), dtype {m.dtype}, EOD id {m.eod_id} ({m.tokenizer['eod_piece']}):"]
    for o in m.outputs:
        lines.append(f"  {o['prefix']}.bin/.idx  {o['documents']:,} docs  {o['tokens']:,} tokens")
    skipped = sum(m.skipped.values())
    lines.append(
        f"total {m.documents:,} docs, {m.tokens:,} tokens, {human_bytes(m.text_bytes)} text "
        f"from {len(m.inputs)} file(s) in {secs:.1f} s "
        f"({m.text_bytes / 1e6 / max(secs, 1e-9):.2f} MB/s, "
        f"{m.tokens / max(secs, 1e-9) / 1e6:.2f} M tokens/s)"
    )
    lines.append(
        f"skipped {skipped:,} record(s)"
        + (f": {m.skipped}" if skipped else "")
        + (f"; filtered by set: {m.filtered_sets}" if m.filtered_sets else "")
    )
    lines.append(f"manifest: {m.manifest}")
    hint = plain_text_hint(m.skipped, m.records)
    if hint:
        lines.append(f"warning: {sum(m.skipped.values()):,} of {m.records:,} records skipped: {hint}")
    return "\n".join(lines)
