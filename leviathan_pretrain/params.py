"""Parameter breakdown of a config without building the model.

    python -m leviathan_pretrain.params --config configs/1.2b-lev.yaml [key=value ...] [--json]

Prints ``input`` (the input representation), ``body`` (transformer layers + final norm), ``head`` (the
untied output head; 0 for TIED, whose head is the input table) and ``total``, for the whole model (all TP
ranks together; tables padded as megatron pads them for ``parallel.tensor_parallel``). ``--json`` prints one
object with exactly those four keys. The closed form lives in ``leviathan_pretrain.model.sizes`` and is
checked against real (and meta-device) megatron-core models in tests/test_params.py.
"""

from __future__ import annotations

import argparse
import json
import sys

from leviathan_pretrain.cli import run_main
from leviathan_pretrain.config import ConfigError, config_arguments, load_config
from leviathan_pretrain.model import sizes


def breakdown(cfg) -> dict:
    return sizes.param_breakdown(cfg.model, cfg.parallel.tensor_parallel)


def format_breakdown(cfg, counts: dict) -> str:
    m = cfg.model
    lines = [
        f"variant={m.variant} vocab_size={m.vocab_size} hidden={m.hidden_size} layers={m.num_layers} "
        f"tensor_parallel={cfg.parallel.tensor_parallel}"
    ]
    for key in ("input", "body", "head", "total"):
        lines.append(f"  {key:<6} {counts[key]:>15,d}  ({counts[key] / 1e6:,.2f} M)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m leviathan_pretrain.params", description=__doc__.splitlines()[0])
    config_arguments(ap, "YAML config (may name a base: file)", "dotted overrides, e.g. model.vocab_size=200019")
    ap.add_argument("--json", action="store_true", help="print one JSON object {input, body, head, total}")
    return ap


def main(argv=None) -> int:
    return run_main(_params, build_parser().parse_args(argv), errors=(ConfigError,))


def _params(args) -> int:
    cfg = load_config(args.config, args.overrides)
    counts = breakdown(cfg)
    print(json.dumps(counts) if args.json else format_breakdown(cfg, counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
