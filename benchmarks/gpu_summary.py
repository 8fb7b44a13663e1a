"""The GPU check's summary: ``python benchmarks/gpu_summary.py RUN_DIR ... --attach FILE ... --json S.json --md S.md``.

Reads what ``benchmarks/gpu_check.sh`` leaves: finished training runs (their ``train_log.jsonl``, ``config.json``
and console log ``<run dir>.log``), bench_step.py ``--json`` results, ``check-<name>.json`` files of the
correctness checks (``check_compile.py``, ``bench_loss.py``, ``profile_lev_gpu.py``) and the sections table
(``*.tsv``). Writes ``summary.json`` and ``summary.md``; per scale (``400m``, ``1.2b``, ...) ``summary.json``
gives ``scales[scale]``: ``ours_over_ref`` (ours/C), ``ours_over_liger`` (ours/D), ``ours_over_old`` (ours/A)
from bench_step.py's alternating rounds, ``lev_over_tied`` (LEV's over TIED's median step time through the
trainer), the trainer's TIED and LEV MFU, and each against the step-speed goals (:data:`GOALS`).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# the step-speed goals: (key in scales[scale], comparison, bound, per-scale bound overrides)
GOALS = (
    ("ours_over_ref", "<=", 0.85, {}),
    ("ours_over_liger", "<=", 1.00, {}),
    ("lev_over_tied", "<=", 1.05, {}),
    ("mfu_tied", ">=", 0.30, {"1.2b": 0.38}),
)


def peak_memory_gib(run: Path) -> float | None:
    """The trainer's last ``mem X GiB`` console figure (``torch.cuda.max_memory_allocated`` on a GPU, RSS on a
    CPU) from the run's console log ``<run dir>.log`` (``benchmarks/gpu_check.sh`` writes it), if any. Logs
    written before the label said GiB print ``GB`` for the same 2**30-byte unit: both are read."""
    log = Path(str(run) + ".log")
    found = re.findall(r"\| mem ([0-9.]+) GiB? \|", log.read_text(errors="replace")) if log.exists() else []
    return float(found[-1]) if found else None


def plan_gib(cfg, device: str, world: int) -> float | None:
    """``plan/planner.py``'s per-rank memory estimate (GiB) for the run's config on ``world`` ranks of one node."""
    from leviathan_pretrain.plan.planner import make_plan

    try:
        plan = make_plan(cfg, 1, world, device="gpu" if device == "cuda" else "cpu", mem_limit_gb=None)
    except Exception:  # noqa: BLE001 -- a summary column, never a reason to lose the others
        return None
    return plan.memory["total"] / 2**30


def summarize_run(d: Path, warmup: int) -> dict:
    from leviathan_pretrain.config import Config
    from leviathan_pretrain.config.loader import build
    from leviathan_pretrain.model.flops import model_flops_per_token

    cfg = build(Config, json.loads((d / "config.json").read_text()))
    recs = [json.loads(x) for x in (d / "train_log.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "step_time_s" in r and not r.get("skipped")][warmup:]
    if not steps:
        raise ValueError(f"{d}/train_log.jsonl has no timed steps after {warmup} warm-up steps")
    step_s = statistics.median(r["step_time_s"] for r in steps)
    tokens = cfg.train.global_batch_size * cfg.model.seq_length
    layout = next(r for r in reversed(recs) if r.get("event") == "layout")
    world, peak = layout["world"], layout.get("peak_flops")  # None: no known peak (CPU), no MFU
    tps = tokens / step_s
    flops = tps * model_flops_per_token(cfg) / world
    return {
        "run": str(d),
        "variant": cfg.model.variant,
        "steps": len(steps),
        "step_s": step_s,
        "tokens_per_s": tps,
        "tflops_per_device": flops / 1e12,
        "mfu": flops / peak if peak else None,
        "final_loss": steps[-1]["loss"],
        "peak_gib": peak_memory_gib(d),
        "plan_gib": plan_gib(cfg, layout.get("device", "cpu"), world),
    }


def summarize(dirs: list[str], warmup: int) -> list[dict]:
    """One row per run; a run that did not finish (or left no log) is a row with its ``error``."""
    rows = []
    for d in map(Path, dirs):
        try:
            rows.append(summarize_run(d, warmup))
        except (OSError, ValueError, KeyError, StopIteration) as e:
            rows.append({"run": str(d), "variant": d.name.rsplit("-", 1)[-1], "error": f"{type(e).__name__}: {e}"})
    return rows


def group_of(row: dict) -> str:
    """The scale of a ``<scale>-<variant>`` run directory (gpu_check.sh's names), else ''."""
    name = Path(row["run"]).name
    return name.rsplit("-", 1)[0] if "-" in name else ""


def scale_of_config(path: str) -> str:
    """``configs/400m-tied.yaml`` -> ``400m``."""
    return Path(path).stem.rsplit("-", 1)[0]


def lev_tied_ratios(rows: list[dict]) -> dict[str, float]:
    """Per scale, LEV's tokens/s over TIED's (the trainer)."""
    out = {}
    for g in dict.fromkeys(group_of(r) for r in rows):
        by = {r["variant"]: r for r in rows if group_of(r) == g and "error" not in r}
        if "lev" in by and "tied" in by:
            out[g] = by["lev"]["tokens_per_s"] / by["tied"]["tokens_per_s"]
    return out


def scales(rows: list[dict], attached: dict) -> dict:
    """``scales[scale]``: the step-speed ratios and MFU, with ``goals`` (each: value, bound, met)."""
    out: dict[str, dict] = {}
    for r in rows:
        if "error" not in r and r["variant"] in ("tied", "lev"):
            s = out.setdefault(group_of(r), {})
            s[f"step_s_{r['variant']}"], s[f"mfu_{r['variant']}"] = r["step_s"], r["mfu"]
    for s in out.values():
        if "step_s_lev" in s and "step_s_tied" in s:
            s["lev_over_tied"] = s["step_s_lev"] / s["step_s_tied"]
    for res in attached.get("results", []):
        step = res.get("step", {})
        if "ratio_pairs_vs" not in step and "ratio_pairs" in step:  # a result from before the four contestants
            step = {**step, "ratio_pairs_vs": {"ref": step["ratio_pairs"]}}
        if "ratio_pairs_vs" in step:
            s = out.setdefault(scale_of_config(step["config"]), {})
            for k, v in step["ratio_pairs_vs"].items():
                s[f"ours_over_{k}"] = v
            if step.get("mfu"):
                s["mfu_step"] = step["mfu"]
    for g, s in out.items():
        s["goals"] = {}
        for key, op, bound, per in GOALS:
            bound = per.get(g, bound)
            v = s.get(key)
            met = None if v is None else (v <= bound if op == "<=" else v >= bound)
            s["goals"][key] = {"value": v, "goal": f"{op} {bound:g}", "met": met}
    return out


def _gib(x) -> str:
    return f"{x:.2f}" if x is not None else "n/a"


def _pct(x) -> str:
    return f"{100 * x:.2f}%" if x is not None else "n/a"


def print_summary(rows: list[dict]) -> None:
    if not rows:
        print("no training runs to summarize")
        return
    print(
        f"{'run':<40} {'variant':>8} {'tokens/s':>12} {'TFLOP/s':>9} {'MFU':>7} {'final loss':>10} "
        f"{'peak GiB':>9} {'plan GiB':>9}"
    )
    for r in rows:
        if "error" in r:
            print(f"{r['run']:<40} {r['variant']:>8} failed: {r['error']}")
            continue
        print(
            f"{r['run']:<40} {r['variant']:>8} {r['tokens_per_s']:>12,.0f} {r['tflops_per_device']:>9.2f} "
            + (f"{100 * r['mfu']:>6.2f}%" if r["mfu"] is not None else f"{'n/a':>7}")
            + f" {r['final_loss']:>10.4f} {_gib(r['peak_gib']):>9} {_gib(r['plan_gib']):>9}"
        )
    for g, ratio in lev_tied_ratios(rows).items():
        print(f"LEV/TIED tokens/s{f' ({g})' if g else ''}: {ratio:.3f}")


def _runs_md(rows: list[dict]) -> list[str]:
    out = ["## Training runs (leviathan_pretrain.train)", ""]
    if not rows:
        return out + ["None in this check."]
    out += [
        "| run | variant | tokens/s | TFLOP/s | MFU | step s | final loss | peak GiB | plan/planner.py GiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            out.append(f"| {Path(r['run']).name} | {r['variant']} | failed: {r['error']} | | | | | | |")
        else:
            out.append(
                f"| {Path(r['run']).name} | {r['variant']} | {r['tokens_per_s']:,.0f} | {r['tflops_per_device']:.2f} | "
                f"{_pct(r['mfu'])} | {r['step_s']:.3f} | {r['final_loss']:.4f} | {_gib(r['peak_gib'])} | "
                f"{_gib(r['plan_gib'])} |"
            )
    return out + [f"\nLEV/TIED tokens/s ({g or 'all'}): {x:.3f}" for g, x in lev_tied_ratios(rows).items()]


def _steps_md(steps: list[dict]) -> list[str]:
    out = ["", "## Ours against plain Hugging Face loops (bench_step.py: same batches, rotating order)", ""]
    for r in steps:
        names = r.get("contestants", ["ours", "ref"])
        mem = r.get("memory") or {}
        gas = r["global_batch"] // r["micro_batch"]
        out += [f"### {r['config']}: {r['precision']}, micro-batch {r['micro_batch']} x {gas}"]
        out += [""] + [f"- **{k}**: {text}" for k, text in r.get("describe", {}).items()]
        if r.get("old_overrides"):
            out.append(f"- old = ours with `{r['old_overrides']}`")
        for k, err in r.get("failed_contestants", {}).items():
            out.append(f"- **{k}: failed, not measured**: {err.strip().splitlines()[-1]}")
        out += [
            "",
            "| contestant | tokens/s | MFU | step ms | ours / it | held GiB | step GiB |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        vs = r.get("ratio_pairs_vs", {"ref": r["ratio_pairs"]})
        for k in names:
            ratio = "1" if k == "ours" else f"{vs[k]:.3f}"
            held, trans = (mem.get("static_gib") or {}).get(k), (mem.get("transient_gib") or {}).get(k)
            out.append(
                f"| {k} | {r['tokens_per_s'][k]:,.0f} | {_pct((r.get('mfu') or {}).get(k))} | "
                f"{r['median_wall_s'][k] * 1e3:.1f} | {ratio} | {_gib(held)} | {_gib(trans)} |"
            )
        for k, ph in r.get("phases_s", {}).items():
            out.append(f"\n{k}: " + ", ".join(f"{p} {v * 1e3:.1f} ms" for p, v in ph.items()))
        snap = r.get("memory_snapshot")
        if snap and "by_category_gib" in snap:
            cats = ", ".join(f"{c} {g:.2f}" for c, g in snap["by_category_gib"].items())
            out.append(
                f"\nMemory at the peak of one step of ours: {snap['peak_gib']:.2f} GiB = {cats} ({snap['path']})"
            )
        out.append("")
    return out


def _goals_md(sc: dict) -> list[str]:
    out = ["", "## The step-speed goals", "", "| scale | measure | value | goal | met |", "|---|---|---:|---|---|"]
    for g, s in sc.items():
        for key, v in s.get("goals", {}).items():
            val = "n/a" if v["value"] is None else f"{v['value']:.3f}"
            met = {True: "yes", False: "**no**", None: "not measured"}[v["met"]]
            out.append(f"| {g} | {key} | {val} | {v['goal']} | {met} |")
    return out


def _checks_md(checks: dict) -> list[str]:
    if not checks:
        return []
    out = ["", "## Correctness checks on this device", ""]
    for name, c in checks.items():
        bad = [f for part in (c.values() if isinstance(c, dict) else []) if isinstance(part, dict)
               for f in part.get("failures", [])]  # fmt: skip
        bad += c.get("failures", []) if isinstance(c, dict) else []
        out.append(f"- {name}: {'ok' if not bad else 'FAILED: ' + '; '.join(map(str, bad[:5]))}")
    return out


def report_md(rows: list[dict], attached: dict, sc: dict | None = None) -> str:
    """gpu_check.sh's summary.md: sections, goals, checks, training runs, the step comparisons, the probe."""
    out = ["# GPU check summary", ""]
    if attached.get("sections"):
        out += ["| section | state | seconds |", "|---|---|---:|"]
        out += [f"| {n} | {st} | {sec} |" for n, st, sec in attached["sections"]]
        out.append("")
    out += _goals_md(sc or scales(rows, attached)) + _checks_md(attached.get("checks", {})) + [""] + _runs_md(rows)
    results = attached.get("results", [])
    out += _steps_md([r["step"] for r in results if "median_s" in r.get("step", {})])
    failed = [(k, r[k]) for r in results for k in ("step", "probe") if "error" in r.get(k, {})]
    if failed:
        out += ["", "## bench_step.py parts that failed (whole tracebacks in gpu_check.log)", ""]
        out += [f"- {k} {r['config']}: {r['error'].strip().splitlines()[-1]}" for k, r in failed]
    for r in (r["probe"] for r in results if "syncs" in r.get("probe", {})):
        if r["device"] != "cuda":
            out += [
                "",
                f"Host syncs in one step of {r['config']}: not counted on the {r['device']} (CUDA's sync debug mode)",
            ]
            continue
        n = sum(r["syncs"].values())
        out += ["", f"## Host syncs in one step of {r['config']} ({r['device']}): {n}", ""]
        out += [f"- {c} x {where}" for where, c in sorted(r["syncs"].items(), key=lambda kv: -kv[1])[:15]]
    return "\n".join(out) + "\n"


def attachments(paths: list[str]) -> dict:
    """``--attach``: bench_step.py ``--json`` results (a missing one: its section failed), ``check-<name>.json``
    files (``checks[name]``) and gpu_check.sh's section table (``*.tsv``: name, state, seconds)."""
    out: dict = {"results": [], "sections": [], "checks": {}}
    for p in map(Path, paths):
        if not p.exists():
            continue
        if p.suffix == ".tsv":
            out["sections"] += [line.split("\t")[:3] for line in p.read_text().splitlines() if line.strip()]
        elif p.name.startswith("check-"):
            try:
                out["checks"][p.stem[len("check-") :]] = json.loads(p.read_text())
            except ValueError as e:
                out["checks"][p.stem[len("check-") :]] = {"failures": [f"unreadable {p.name}: {e}"]}
        else:
            out["results"].append(json.loads(p.read_text()))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python benchmarks/gpu_summary.py",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("runs", nargs="*", metavar="RUN_DIR", help="finished training runs")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps of each run (default 5)")
    ap.add_argument("--attach", nargs="*", default=[], metavar="FILE", help="bench_step JSONs, check-*.json, *.tsv")
    ap.add_argument("--json", metavar="PATH", help="write runs + attachments + scales as JSON")
    ap.add_argument("--md", metavar="PATH", help="write the Markdown report")
    args = ap.parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).*not installed.*")
    rows, attached = summarize(args.runs, args.warmup), attachments(args.attach)
    sc = scales(rows, attached)
    print_summary(rows)
    for g, s in sc.items():
        got = ", ".join(f"{k} {v['value']:.3f}" for k, v in s["goals"].items() if v["value"] is not None)
        print(f"scale {g}: {got or 'no ratios'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": rows, **attached, "scales": sc}, indent=1))
    if args.md:
        Path(args.md).write_text(report_md(rows, attached, sc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
