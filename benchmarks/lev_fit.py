"""Can LEV represent what a table learned? Fit LEV's function of the token id to a trained run's input table.

For a trained table run (TIED, UNTIED), LEV in each ``--form`` (the run's own ``model.lev`` sizes plus the form's
overrides) is fitted by least squares to the run's input rows, over the ids seen in training (an unseen id's row is
its init: noise no function of the id should fit). Printed per form, as the fraction of the table's variance
explained (R^2 = 1 - residual / variance about the set's mean row):

- overall (every seen id alike) and frequency-weighted (each id by its training count); the fit minimises the first
  (``--weight uniform``, the default: the table's geometry) or the second (``--weight frequency``: what the
  language model's loss weighs);
- per training-frequency bucket (evaluate's decades);
- ``rank-k bound``: the best any map of rank k = heads x rank does on the same rows under the same weights (a
  truncated SVD): LEV's rows lie in the row space of its W_out, so this bounds its fitted objective from above;
- ``noise``: the same LEV fitted to a table of Gaussian noise of the table's RMS: what LEV reaches with no structure
  to use. A form that fits the trained table no better than noise represents its geometry by capacity alone.

This is a diagnostic, not a training run: an optimiser fitting rows directly is not the language model's
gradient, so a form that fits well might still train badly; one that cannot fit the table cannot learn it either,
whatever its start. A fit is also an optimisation: its R^2 is what the optimiser reached, a lower bound on what the
form can do. ``--lr`` takes several rates and keeps, per fit, the one with the lowest fitted objective over every
seen id; the output says which won, and warns when the smallest one tried did (a smaller one may do better still).
The defaults suit the tiny sizes; at the spec's sizes (a product of 128 factors) the paper's form did not fit at 3e-3
and the centred form fitted at 1e-3: give both.

    python benchmarks/lev_fit.py --run RUN [--form NAME=KEY=VALUE[,KEY=VALUE]...] [--weight frequency]
                                 [--steps N] [--lr LR [LR ...]] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FORMS = ("lev=", "lev-center=model.lev.center=true", "lev-center-r64=model.lev.center=true,model.lev.rank=64")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--run", required=True, help="a trained run of a table variant (tied, untied)")
    p.add_argument("--step", type=int, help="its checkpoint step (default: the last)")
    p.add_argument("--form", action="append", metavar="NAME=OVERRIDES",
                   help=f"a LEV form: comma-separated overrides on the run's config (default: {FORMS})")  # fmt: skip
    p.add_argument("--steps", type=int, default=1500, help="optimiser steps per fit (default 1500)")
    p.add_argument("--batch", type=int, default=2048, help="ids per step, drawn uniformly from the seen ids")
    p.add_argument("--lr", type=float, nargs="+", default=[3e-3],
                   help="Adam's peak learning rate (cosine to 0; default 3e-3); several: best kept")  # fmt: skip
    p.add_argument("--weight", choices=("uniform", "frequency"), default="uniform",
                   help="the fit's weight of an id: alike (the table's geometry; default) or its training count "
                        "(what the language model's loss weighs)")  # fmt: skip
    p.add_argument("--no-noise", action="store_true", help="skip the fits to a noise table")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    args.form = args.form or list(FORMS)
    for f in args.form:
        name, sep, spec = f.partition("=")
        if not name or "." in name or not sep or any("=" not in o for o in spec.split(",") if o):
            p.error(f"--form {f!r}: expected NAME=KEY=VALUE[,KEY=VALUE] (or NAME= for the run's own sizes)")
    if any(lr <= 0 for lr in args.lr):
        p.error(f"--lr {args.lr}: learning rates must be > 0")
    return args


def objective(target, rows, seen, weights) -> float:
    """What a fit minimises, over every seen id: the weighted mean of the rows' squared error."""
    w = weights[seen].double()
    return float((w * (rows[seen].double() - target[seen].double()).pow(2).sum(1)).sum() / w.sum())


def r2(target, fit, ids, weights=None) -> float:
    """1 - weighted residual (``objective``) / weighted variance about the weighted mean row, over ``ids``."""
    import torch

    weights = torch.ones(len(target), dtype=torch.float64) if weights is None else weights
    t, w = target[ids].double(), weights[ids].double()
    mean = (w[:, None] * t).sum(0) / w.sum()
    var = float((w * (t - mean).pow(2).sum(1)).sum() / w.sum())
    return 1 - objective(target, fit, ids, weights) / var


def scores(target, fit, seen, counts, buckets) -> dict:
    out = {"overall": r2(target, fit, seen), "frequency_weighted": r2(target, fit, seen, counts)}
    out["buckets"] = {name: r2(target, fit, ids) for name, ids in buckets if len(ids) >= 2}
    return out


def lev_model_config(run_cfg, overrides: list[str]):
    from leviathan_pretrain.config import Config, loader

    data = loader.to_dict(run_cfg)
    loader.apply_overrides(data, ["model.variant=lev", *overrides])
    cfg = loader.build(Config, data)
    loader.validate_tree(cfg)
    return cfg


def best_fit(cfg, target, seen, weights, args, label: str):
    """``fit`` at each of ``args.lr``: the rows with the lowest ``objective``, their lr, and each lr's objective."""
    tried = {}
    for lr in args.lr:
        rows = fit(cfg, target, seen, weights, args, label + (f" lr {lr:g}" if len(args.lr) > 1 else ""), lr)
        tried[lr] = (objective(target, rows, seen, weights), rows)
    lr = min(tried, key=lambda k: tried[k][0])
    return tried[lr][1], lr, {f"{k:g}": v[0] for k, v in tried.items()}


def fit(cfg, target, seen, weights, args, label: str, lr: float):
    """LEV (``cfg.model``) fitted to ``target``'s rows at ``seen``, each row weighted by ``weights[seen]`` (a batch
    draws ids with those probabilities; an id drawn n times counts n times); its rows for every id, fp32."""
    import torch

    from leviathan_pretrain.model.gpt import build_transformer_config
    from leviathan_pretrain.model.lev import LEVInput
    from leviathan_pretrain.model.settings import BuildSettings

    torch.manual_seed(args.seed)
    layer = LEVInput(build_transformer_config(cfg.model, BuildSettings(device="cpu")), cfg.model)
    opt = torch.optim.Adam(layer.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    gen = torch.Generator().manual_seed(args.seed)
    probs = weights[seen].double() / weights[seen].double().sum()
    t0 = time.time()
    for step in range(args.steps):
        ids, n = seen[torch.multinomial(probs, args.batch, replacement=True, generator=gen)].unique(return_counts=True)
        loss = ((layer.compute_rows(ids) - target[ids]).pow(2).sum(1) * n).sum() / args.batch
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % max(1, args.steps // 5) == 0 or step == args.steps - 1:
            print(f"[fit] {label}: step {step + 1}/{args.steps} mse/row {loss.item():.3e} ({time.time() - t0:.0f} s)",
                  file=sys.stderr, flush=True)  # fmt: skip
    with torch.no_grad():
        return torch.cat([layer.compute_rows(c) for c in torch.arange(len(target)).split(4096)])


def rank_bound(target, seen, k: int, weights=None):
    """The best rank-k fit of the seen rows, each weighted by ``weights`` (default alike), as a full table: the rows
    projected on the top k right singular vectors of the weighted rows (for equal weights, the truncated SVD)."""
    import torch

    rows = target[seen].double()
    scale = torch.ones(len(seen), dtype=torch.float64) if weights is None else weights[seen].double().sqrt()
    vh = torch.linalg.svd(scale[:, None] * rows, full_matrices=False)[2][:k]
    out = torch.zeros_like(target, dtype=torch.float64)
    out[seen] = rows @ vh.T @ vh
    return out.float()


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from leviathan_pretrain.evaluation import heldout as H
    from leviathan_pretrain.evaluation.load import eval_world, load_trained
    from leviathan_pretrain.model import geometry as G

    torch.set_num_threads(1)
    with eval_world("cpu"):
        tr = load_trained(args.run, args.step, lookup=False)
    layer = tr.model.input_layer
    if not hasattr(layer, "word_embeddings"):
        raise SystemExit(f"error: {args.run} is a {tr.variant} run; give a table run (tied, untied)")
    V = tr.cfg.model.vocab_size
    target = layer.word_embeddings.weight[:V].detach().float()
    counts = torch.as_tensor(H.training_counts(list(tr.cfg.data.prefixes), V)[0], dtype=torch.float64)
    buckets = G.bucket_ids(counts.numpy(), H.decade_buckets())[1:]  # "unseen" left out (see the doc)
    seen = torch.nonzero(counts > 0).flatten()
    weights = counts if args.weight == "frequency" else torch.ones_like(counts)
    rms = float(target[seen].pow(2).mean().sqrt())
    noise = torch.randn(target.shape, generator=torch.Generator().manual_seed(args.seed)) * rms
    print(f"[fit] {args.run} step {tr.step}: {tr.variant} table {tuple(target.shape)}, {len(seen)} seen ids, "
          f"RMS {rms:.4f}; {args.steps} steps x {args.batch} ids per fit", file=sys.stderr)  # fmt: skip
    results = {"run": str(args.run), "step": tr.step, "seen_ids": len(seen), "args": vars(args), "forms": {}}
    bounds = {}  # k -> the rank-k bound's scores (forms of one h x r share it)
    for form in args.form:
        name, spec = form.split("=", 1)
        cfg = lev_model_config(tr.cfg, [o for o in spec.split(",") if o])
        k = cfg.model.lev.heads * cfg.model.lev.rank
        if k not in bounds:
            bounds[k] = scores(target, rank_bound(target, seen, k, weights), seen, counts, buckets)
        rows, lr, tried = best_fit(cfg, target, seen, weights, args, name)
        entry = {"overrides": spec, "k": k, "fit": scores(target, rows, seen, counts, buckets), "rank_bound": bounds[k]}
        entry["lr"] = {"fit": lr, "fit_objective": tried}
        if not args.no_noise:
            noise_rows, lr, tried = best_fit(cfg, noise, seen, weights, args, name + " (noise)")
            entry["noise"] = scores(noise, noise_rows, seen, counts, buckets)
            entry["lr"].update(noise=lr, noise_objective=tried)
        results["forms"][name] = entry
    lrs = " ".join(f"{lr:g}" for lr in args.lr)
    print(f"LEV fitted to {args.run} (step {tr.step}, {len(seen)} seen ids), {args.weight} weights, "
          f"{args.steps} steps x {args.batch} ids, lr {lrs}, seed {args.seed}")  # fmt: skip
    print(table(results, [name for name, _ in buckets]))
    for line in lr_notes(results, args.lr):
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


def lr_notes(results: dict, lrs: list[float]) -> list[str]:
    """What the learning rates say about the R^2 values: one tried, a lower bound; the smallest won, try smaller."""
    if len(lrs) == 1:
        return [f"One learning rate ({lrs[0]:g}): each R^2 is what the optimiser reached, a lower bound on the form's "
                "fit; give --lr several rates to keep the best of each."]  # fmt: skip
    notes = []
    for name, e in results["forms"].items():
        for what in ("fit", "noise"):
            if what in e["lr"] and e["lr"][what] == min(lrs):
                notes.append(f"warning: {name} ({what}): the smallest learning rate tried ({min(lrs):g}) fitted "
                             "best; a smaller one may fit better still.")  # fmt: skip
    return notes


def table(results: dict, bucket_names: list[str]) -> str:
    """The R^2 values as a Markdown table: a row per form and what it was fitted to."""
    head = ["form", "k = h x r", "fitted to", "lr", "R^2 overall", "R^2 freq-weighted", *bucket_names]
    lines = ["| " + " | ".join(head) + " |", "|---|---:|---|---:|" + "---:|" * (len(head) - 4)]
    labels = {"fit": "the table", "rank_bound": "the table, best rank k (SVD)", "noise": "noise of its RMS"}
    for name, e in results["forms"].items():
        for what, label in labels.items():
            if what in e:
                s = e[what]
                cells = [f"{s['overall']:.3f}", f"{s['frequency_weighted']:.3f}"]
                cells += [f"{s['buckets'][b]:.3f}" if b in s["buckets"] else "" for b in bucket_names]
                lr = f"{e['lr'][what]:g}" if what in e["lr"] else ""  # the rank bound is an SVD, no lr
                lines.append(f"| {name} | {e['k']} | {label} | {lr} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
