"""Learning-rate schedule and AdamW parameter groups.

- :func:`lr_at`: linear warmup from 0 over ``optim.warmup_steps``, then cosine (or linear) decay to
  ``optim.min_lr`` at ``optim.decay_steps`` (default ``train.steps``), then flat at ``min_lr``. The LR is a pure
  function of the step, so a resumed run needs nothing but the step number.
- :func:`param_groups`: weight decay on matrices only; never on norms and biases, and on LEV's digit
  codebooks only when ``optim.decay_lev_codebooks`` is set (:func:`weight_decay_groups`; the model flags its
  parameters).
"""

from __future__ import annotations

import math

import torch

from leviathan_pretrain.config import Config, OptimConfig


def lr_at(step: int, ocfg: OptimConfig, total_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based)."""
    warm = ocfg.warmup_steps
    if warm > 0 and step < warm:
        return ocfg.lr * (step + 1) / warm
    if ocfg.decay_style == "constant":
        return ocfg.lr
    decay = (ocfg.decay_steps or total_steps) - warm
    if decay <= 0:
        return ocfg.lr
    t = min(1.0, (step - warm) / decay)
    coeff = 0.5 * (1.0 + math.cos(math.pi * t)) if ocfg.decay_style == "cosine" else 1.0 - t
    return ocfg.min_lr + coeff * (ocfg.lr - ocfg.min_lr)


def param_groups(module: torch.nn.Module, cfg: Config) -> list[dict]:
    """The model's own grouping (norms, biases, LEV codebooks unless ``optim.decay_lev_codebooks``); with
    ``optim.lev_lr_mult`` != 1 each group is split into LEV's parameters, carrying ``lr_mult``, and the rest
    (:meth:`~.engine.TrainEngine.set_lr` applies it)."""
    from leviathan_pretrain.model.lev import LEVInput

    groups = weight_decay_groups(module, cfg.optim.weight_decay, cfg.optim.decay_lev_codebooks)
    mult = cfg.optim.lev_lr_mult
    if mult != 1.0:
        lev = {id(p) for m in module.modules() if isinstance(m, LEVInput) for p in m.parameters()}
        split = []
        for g in groups:
            split.append({**g, "params": [p for p in g["params"] if id(p) not in lev]})
            split.append({**g, "params": [p for p in g["params"] if id(p) in lev], "lr_mult": mult})
        groups = split
    return [g for g in groups if g["params"]]


def no_weight_decay(name: str, param) -> bool:
    """True for norms and biases (``ndim < 2``) and parameters flagged ``no_weight_decay`` (LEV's LayerNorm
    affines and spline values). LEV codebooks are flagged ``lev_codebook`` instead (see weight_decay_groups)."""
    return param.ndim < 2 or getattr(param, "no_weight_decay", False)


def weight_decay_groups(model, weight_decay: float, decay_lev_codebooks: bool = False) -> list[dict]:
    """Optimizer param groups: ``[{"params": decayed, "weight_decay": wd}, {"params": rest, "weight_decay": 0}]``
    (the LEV codebooks join the decayed group only with ``decay_lev_codebooks``). Shared (tied) parameters
    appear once."""
    decay, no_decay, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        skip = no_weight_decay(name, p) or (getattr(p, "lev_codebook", False) and not decay_lev_codebooks)
        (no_decay if skip else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
