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

The export is :mod:`leviathan_pretrain.hf.export`; the conversion itself (and
:func:`~.hf.convert.greedy_decode`, the reference for HF ``generate()``) is in :mod:`leviathan_pretrain.hf.convert`.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

from common import cli


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

    # imported only now: --help answers without torch, and DeepSpeed reads DS_ACCELERATOR when it loads
    from leviathan_pretrain.evaluation.load import EvalError

    return cli.run_main(_export, args, errors=(EvalError,))  # hf.tokenizer.ExportError included


def _export(args) -> int:
    from leviathan_pretrain.evaluation.load import checkpoint_location, eval_world, select_tag
    from leviathan_pretrain.hf.export import DTYPE_NAMES, check_out, export

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


def _size(path: Path) -> str:
    n = path.stat().st_size
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


if __name__ == "__main__":
    sys.exit(main())
