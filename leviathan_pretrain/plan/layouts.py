"""The parallel layouts :mod:`.planner` proposes when a geometry does not fit (pure Python, deterministic).

On the same nodes x GPUs: TP in :data:`LAYOUT_TP` (at most the GPUs of a node), PP a divisor of ``model.num_layers``
up to :data:`LAYOUT_MAX_PP` with an integer DP, sequence parallelism off/on (TP >= 2), recompute none / selective
(mlp) / full (every layer), at ZeRO 1 (what DeepSpeed's pipeline engine allows) and the config's micro and global
batch. A layout config loading would refuse (TP not dividing the heads, the query groups or LEV's heads, sequence
parallelism with ``model.compile``, ...) is skipped; the estimate of each is the caller's (``plan.make_plan``).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass

from leviathan_pretrain.config.loader import ConfigError, validate_tree

LAYOUT_TP = (1, 2, 4, 8)  # tensor-parallel sizes tried
LAYOUT_MAX_PP = 8  # pipeline sizes tried: the divisors of num_layers up to this
LAYOUT_RECOMPUTE = (("none", None), ("selective", ["mlp"]), ("full", None))  # cheapest first


@dataclass(frozen=True)
class Layout:
    """One layout tried: its estimate and the overrides that select it."""

    tp: int
    pp: int
    sp: bool
    recompute: str  # none | selective (mlp) | full (every layer)
    total: float  # the plan's estimate, bytes per GPU
    overrides: tuple[str, ...]  # "key=value", to paste after the config


def layout_config(cfg, tp: int, pp: int, sp: bool, recompute: str, modules: list[str] | None = None):
    """``cfg`` with this layout at ZeRO 1 (a new config), or None where config loading would refuse it."""
    m, p = cfg.model, cfg.parallel
    par = dataclasses.replace(p, tensor_parallel=tp, pipeline_parallel=pp, sequence_parallel=sp, zero_stage=1)
    mod = dataclasses.replace(m, recompute=recompute, recompute_modules=modules or m.recompute_modules)
    out = dataclasses.replace(cfg, model=dataclasses.replace(mod, recompute_layers=None), parallel=par)
    try:
        with warnings.catch_warnings():  # e.g. a vocabulary larger than the tokenizer's: said once, at load
            warnings.simplefilter("ignore")
            validate_tree(out)
    except ConfigError:
        return None
    return out


def layout_overrides(cfg, tp: int, pp: int, sp: bool, recompute: str) -> tuple[str, ...]:
    """The ``key=value`` overrides that turn ``cfg`` into this layout (always TP, PP, SP and recompute)."""
    out = [f"parallel.tensor_parallel={tp}", f"parallel.pipeline_parallel={pp}"]
    out += [f"parallel.sequence_parallel={str(sp).lower()}"]
    out += ["parallel.zero_stage=1"] if cfg.parallel.zero_stage != 1 else []
    out += [f"model.recompute={recompute}"] + (["model.recompute_modules=[mlp]"] if recompute == "selective" else [])
    return tuple(out + (["model.recompute_layers=null"] if cfg.model.recompute_layers is not None else []))


def fitting_layouts(
    cfg, world: int, ranks_per_node: int, total: Callable, limit: float, count: int = 3
) -> tuple[list[Layout], Layout | None]:
    """``(up to count layouts whose total(config) <= limit bytes, the smallest of all)``; ``total`` returns None for a
    geometry that cannot run (a batch that does not split over DP). Cheapest first: less recompute, then a smaller TP
    x PP, then fewer stages, then without sequence parallelism (so it is listed where only it fits); one layout per
    (TP, PP, recompute)."""
    tried = []
    for rank, (recompute, modules) in enumerate(LAYOUT_RECOMPUTE):
        for tp in (t for t in LAYOUT_TP if t <= ranks_per_node):
            for pp in range(1, LAYOUT_MAX_PP + 1):
                if cfg.model.num_layers % pp or world % (tp * pp):
                    continue
                for sp in (False, True) if tp > 1 else (False,):
                    c = layout_config(cfg, tp, pp, sp, recompute, modules)
                    bytes_ = total(c) if c is not None else None
                    if bytes_ is not None:
                        over = layout_overrides(cfg, tp, pp, sp, recompute)
                        tried.append(((rank, tp * pp, pp, sp), Layout(tp, pp, sp, recompute, bytes_, over)))
    tried.sort(key=lambda kv: kv[0])
    fits, seen = [], set()
    for _, lay in tried:
        if lay.total <= limit and (lay.tp, lay.pp, lay.recompute) not in seen:
            seen.add((lay.tp, lay.pp, lay.recompute))
            fits.append(lay)
    return fits[:count], min((lay for _, lay in tried), key=lambda lay: lay.total, default=None)


def recompute_hint(m) -> str | None:
    """What more activation recompute ``model`` could do, in override words (None: it recomputes every layer)."""
    if m.recompute == "none":
        return (
            "model.recompute=selective model.recompute_modules=[mlp] (the MLP's 5F recomputed), or "
            "model.recompute=full (a layer keeps only its input; one more forward)"
        )
    if m.recompute == "selective":
        return "model.recompute=full (a layer keeps only its input; one more forward)"
    return "model.recompute_layers=null (every layer recomputed)" if m.recompute_layers is not None else None
