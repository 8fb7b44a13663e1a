"""Parameter breakdown of a config without building the model.

    python -m leviathan_pretrain.params --config configs/1.2b-lev.yaml [key=value ...] [--json]
    python -m leviathan_pretrain.params --config configs/200m-lev.yaml --iso-to configs/200m-untied.yaml

Prints the input layer (``input``), the transformer body (``body``: layers + final norm), the output head
(``head``: the untied head; 0 for TIED, whose head is the input table) and their sum, the trained parameters
(``total``), for the whole model (all TP ranks together; tables padded as megatron pads them for
``parallel.tensor_parallel``, the padded rows' share named: ``padding``), and the exported parameters
(``exported``: the Hugging Face Llama ``export_hf`` writes, every input layer materialised into a ``V x D`` table).
The same figures and words as ``train``'s start, ``evaluate``'s report and ``export_hf`` (model/counts.py).
``--json`` prints one object with exactly those six keys. The closed form lives in
``leviathan_pretrain.model.sizes`` and is checked against real (and meta-device) megatron-core models in
tests/test_params.py.

``--iso-to OTHER``: the paper's v1 protocol, equal total parameters by depth. Prints the ``model.num_layers`` of
this config whose total is nearest below and above OTHER's total, both totals and their ratio to OTHER's. The
overrides apply to both configs (the vocabulary, width or TP you compare at: ``model.vocab_size=16000`` moves
both totals); the search replaces this config's ``model.num_layers`` only. ``--json`` prints ``{target, below:
{num_layers, total}, above: {...}}``.
Only depth changes: LEV's savings exist against a model with an input table *and* a head (UNTIED); against TIED
LEV is the larger one (its head), so the nearest below has fewer layers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from common.cli import run_main
from leviathan_pretrain.config import ConfigError, config_arguments, load_config
from leviathan_pretrain.model import counts

KEYS = ("input", "body", "head", "total", "padding", "exported")  # --json


def breakdown(cfg) -> dict:
    return counts.param_breakdown(cfg.model, cfg.parallel.tensor_parallel)


def all_counts(cfg) -> dict:
    """:data:`KEYS`: the breakdown, the padded rows' share of it and the export's count."""
    s = counts.param_summary(cfg.model, cfg.parallel.tensor_parallel)
    return {**{k: s[k] for k in KEYS[:5]}, "exported": counts.exported_params(cfg.model)}


def format_breakdown(cfg, got: dict) -> str:
    m = cfg.model
    s = counts.param_summary(m, cfg.parallel.tensor_parallel)
    lines = [
        f"variant={m.variant} vocab_size={m.vocab_size} hidden={m.hidden_size} layers={m.num_layers} "
        f"tensor_parallel={cfg.parallel.tensor_parallel}"
    ]
    exported = counts.exported_text(m).split(" = ", 1)[1]  # its parts
    rows = [
        ("input layer", "input", ""),
        ("transformer body", "body", ""),
        ("output head", "head", "" if got["head"] else "tied: the input table"),
        (counts.TRAINED, "total", counts.padding_text(s)),
        (counts.EXPORTED, "exported", f"export_hf's Llama: {exported}"),
    ]
    for label, key, note in rows:
        lines.append(f"  {label:<20} {got[key]:>15,d}  ({counts.millions(got[key])})" + (f"  {note}" if note else ""))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m leviathan_pretrain.params", description=__doc__.splitlines()[0])
    config_arguments(ap, "YAML config (may name a base: file)", "dotted overrides, e.g. model.vocab_size=200019")
    ap.add_argument(
        "--json", action="store_true", help="print one JSON object {input, body, head, total, padding, exported}"
    )
    ap.add_argument(
        "--iso-to",
        metavar="OTHER",
        help="the num_layers that brings this config's total nearest to OTHER's (a config file; the overrides apply "
        "to both), below and above",
    )
    return ap


def total_at(cfg, layers: int) -> int:
    return counts.param_breakdown(dataclasses.replace(cfg.model, num_layers=layers), cfg.parallel.tensor_parallel)[
        "total"
    ]


def iso_layers(cfg, target: int) -> dict:
    """``{target, below, above}``: the depths (``num_layers``, ``total``) whose totals bracket ``target``; ``below``
    is None when even one layer is over it. The total grows by the same count per layer."""
    per_layer = total_at(cfg, 2) - total_at(cfg, 1)
    below_n = (target - total_at(cfg, 1)) // per_layer + 1  # the most layers whose total is <= target
    below = {"num_layers": below_n, "total": total_at(cfg, below_n)} if below_n >= 1 else None
    above_n = max(1, below_n + (below is None or below["total"] < target))
    return {"target": target, "below": below, "above": {"num_layers": above_n, "total": total_at(cfg, above_n)}}


def format_iso(cfg, other_path: str, iso: dict) -> str:
    m = cfg.model
    lines = [
        f"{m.variant}: num_layers for the total of {other_path} ({iso['target']:,d}; vocab_size={m.vocab_size} "
        f"hidden={m.hidden_size} tensor_parallel={cfg.parallel.tensor_parallel} in both)"
    ]
    for key in ("below", "above"):
        got = iso[key]
        if got is None:
            lines.append(f"  {key:<5}  none: one layer is already over it")
        else:
            ratio = got["total"] / iso["target"]
            lines.append(f"  {key:<5}  num_layers={got['num_layers']:<4d} total {got['total']:>15,d}  ({ratio:.4f}x)")
    return "\n".join(lines)


def main(argv=None) -> int:
    return run_main(_params, build_parser().parse_args(argv), errors=(ConfigError,))


def _params(args) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.iso_to:
        other = load_config(args.iso_to, args.overrides)  # compared at the same vocabulary, width, TP
        iso = iso_layers(cfg, breakdown(other)["total"])
        print(json.dumps(iso) if args.json else format_iso(cfg, args.iso_to, iso))
        return 0
    got = all_counts(cfg)
    print(json.dumps(got) if args.json else format_breakdown(cfg, got))
    return 0


if __name__ == "__main__":
    sys.exit(main())
