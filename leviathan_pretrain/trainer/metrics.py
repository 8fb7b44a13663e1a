"""Monitoring: TensorBoard scalars, one console line per log interval, and ``train_log.jsonl``.

Only one rank writes: the last pipeline stage's first tensor-parallel rank of data-parallel replica 0
(where the loss is). Scalars (TensorBoard tags):

- every step: ``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/skipped_steps``
- every ``logging.log_interval`` steps: ``train/perplexity``, ``train/loss_scale``, ``train/samples_consumed``,
  ``train/tokens_consumed``, ``perf/tokens_per_s``, ``perf/step_time_s``, ``perf/tflops_per_device``,
  ``perf/mfu`` (model FLOPs from ``model_flops_per_token`` incl. LEV's per-unique-id work, over the
  per-device peak of :func:`peak_flops` x devices; only where that peak is known: never on a CPU unless
  ``logging.peak_flops`` is set), ``memory/cuda_max_allocated_gib`` (GPU) or ``memory/rss_gib`` (CPU), in GiB
  (2**30 bytes; also the console line's ``mem``),
  ``lev/...`` (LEV health from the first stage: per-head output norm, spline coordinates near 0/1)
- every validation: ``valid/loss``, ``valid/perplexity`` (the console line and the ``train_log.jsonl`` record name
  the tokens scored and the data: :func:`validation_set`)
- at step 0 and every ``logging.geometry_interval`` steps: ``geometry/{input,head}/{rms,cosine,mean_share,
  eff_rank}`` (trainer/geometry_log.py; per frequency bucket ``geometry/input/<bucket>/...`` too with
  ``logging.geometry_buckets``), also as a step record of those keys in ``train_log.jsonl``

``train_log.jsonl`` (in ``train.out_dir``) gets one JSON record per step with the exact float loss (and the
step's wall time, ``step_time_s``, which ``benchmarks/bench_train.py --summarize`` reads; on log steps also the
interval's ``perf/*`` and ``memory/*`` values: throughput, MFU, peak memory), plus
``valid`` and ``event`` records; it is what tests and scripts read. On resume, records after the resumed
step are dropped (and TensorBoard purges them via ``purge_step``), so each step appears once.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch

from leviathan_pretrain.config import ConfigError
from leviathan_pretrain.rundir.train_log import LOG_NAME


def rss_gib() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def memory_stats(device: torch.device) -> dict:
    if device.type == "cuda":
        return {
            "memory/cuda_max_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "memory/rss_gib": rss_gib(),
        }
    return {"memory/rss_gib": rss_gib()}


def check_tensorboard(cfg) -> None:
    """``logging.tensorboard`` needs ``torch.utils.tensorboard`` (the ``tensorboard`` package): checked at start,
    before any model is built, so a missing or broken install fails in seconds with the fix named."""
    if not cfg.logging.tensorboard:
        return
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a broken install raises more than ImportError
        raise ConfigError(
            f"logging.tensorboard: TensorBoard cannot be imported ({type(e).__name__}: {e}); install it with "
            "`pip install tensorboard==2.21.0`, or set logging.tensorboard=false"
        ) from e


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 80.0)) if math.isfinite(loss) else float("nan")


# Dense peak FLOP/s per GPU from the vendors' datasheets (no sparsity), by precision. fp32 is the plain
# (non-tensor-core) rate: torch does not use TF32 for fp32 matmuls unless told to.
GPU_PEAK_FLOPS = (  # (substrings of torch.cuda.get_device_name(), all must match), {precision: FLOP/s}
    (("H200",), {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    (("H100", "PCIe"), {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12}),
    (("H100", "HBM3"), {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),  # H100 SXM
    (("H100", "SXM"), {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}),
    (("A100",), {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}),
)


def peak_flops(device: torch.device, precision: str, configured: float | None) -> tuple[float | None, str]:
    """The per-device peak that MFU divides by, and where it came from. ``logging.peak_flops`` wins; else a
    known GPU's datasheet figure for ``precision``; else None (every CPU, unknown GPUs): no MFU is reported,
    because a guessed peak gives a figure that can exceed 100% on another machine."""
    if configured is not None:
        return float(configured), "logging.peak_flops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for keys, table in GPU_PEAK_FLOPS:
            if all(k in name for k in keys):
                return table[precision], f"{name} {precision} datasheet"
        return None, f"unknown GPU {name!r}: set logging.peak_flops for MFU"
    return None, "a CPU has no reliable peak; set logging.peak_flops to your machine's measured one for MFU"


def throughput(tokens: int, seconds: float, flops_per_token: float, world: int, peak: float | None) -> dict:
    """Tokens/s, achieved model TFLOP/s per device and, when the peak is known, MFU (a fraction)."""
    tps = tokens / max(seconds, 1e-9)
    tflops = tps * flops_per_token / world / 1e12
    out = {"perf/tokens_per_s": tps, "perf/step_time_s": seconds, "perf/tflops_per_device": tflops}
    if peak is not None:
        out["perf/mfu"] = tflops * 1e12 / peak
    return out


def validation_set(cfg) -> tuple[int, str]:
    """``(tokens, text)``: what each validation scores: the same ``train.eval_iters`` global batches every time
    (target tokens: eval_iters x global batch x seq_length) from ``data.valid_prefixes`` or the validation split
    of ``data.prefixes``; ``text`` says so in the console line's words."""
    t, d, seq = cfg.train, cfg.data, cfg.model.seq_length
    tokens = t.eval_iters * t.global_batch_size * seq
    if d.valid_prefixes:
        names = [Path(p).name for p in d.valid_prefixes]
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        where = f"data.valid_prefixes ({', '.join(names[:3])}{more})"
    else:
        where = f"the validation split of data.prefixes (data.split={d.split})"
    masked = ", EOD targets not scored" if d.eod_mask_loss else ""
    return tokens, (
        f"{tokens:,} tokens: a fixed sample of {t.eval_iters} x {t.global_batch_size} sequences of {seq} from {where}"
        f"{masked}"
    )


def truncate_log(path: Path, last_step: int) -> None:
    """Keep records up to ``last_step`` (a resumed run rewrites what came after)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("step", 0) <= last_step:
            keep.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(k + "\n" for k in keep))
    os.replace(tmp, path)


class Metrics:
    def __init__(
        self, out_dir: Path, tb_dir: Path | None, is_writer: bool, resume_step: int, log_interval: int, total_steps: int
    ):
        self.is_writer, self.log_interval, self.total_steps = is_writer, log_interval, total_steps
        self.tb = None
        self.log = None
        self.t_last = time.perf_counter()
        if not is_writer:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / LOG_NAME
        truncate_log(path, resume_step)
        self.log = open(path, "a", buffering=1)
        if tb_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(tb_dir), purge_step=resume_step + 1 if resume_step else None)

    def record(self, rec: dict) -> None:
        if self.log is not None:
            self.log.write(json.dumps(rec) + "\n")

    def scalars(self, step: int, values: dict) -> None:
        if self.tb is None:
            return
        for k, v in values.items():
            if v is not None and isinstance(v, (int, float)):
                self.tb.add_scalar(k, float(v), step)

    def event(self, step: int, what: str, **kw) -> None:
        self.record({"step": step, "event": what, **kw})
        if self.is_writer:
            print(f"[train] step {step}: {what} " + " ".join(f"{k}={v}" for k, v in kw.items()), flush=True)

    def train_step(self, step: int, rec: dict, extra: dict | None) -> None:
        """Per-step record + scalars; ``extra`` (on log steps) adds the interval scalars and the console line."""
        if not self.is_writer:
            return
        interval = {k: v for k, v in (extra or {}).items() if k.startswith(("perf/", "memory/"))}
        self.record({"step": step, **rec, **interval})
        self.scalars(
            step,
            {
                "train/loss": rec["loss"],
                "train/lr": rec["lr"],
                "train/grad_norm": rec["grad_norm"],
                "train/skipped_steps": rec["skipped_total"],
            },
        )
        if extra:
            self.scalars(step, extra)
            gn = rec["grad_norm"]
            mem = extra.get("memory/cuda_max_allocated_gib", extra.get("memory/rss_gib", 0.0))
            print(
                f"[train] step {step:>6}/{self.total_steps} | loss {rec['loss']:.4f} | "
                f"ppl {extra['train/perplexity']:.2f} | lr {rec['lr']:.3e} | "
                f"gnorm {gn if gn is None else f'{gn:.3f}'} | {extra['perf/tokens_per_s']:,.0f} tok/s | "
                f"{extra['perf/step_time_s']:.3f} s/step | {extra['perf/tflops_per_device']:.3f} TFLOP/s | "
                + (f"mfu {100 * extra['perf/mfu']:.2f}% | " if "perf/mfu" in extra else "")
                + f"mem {mem:.2f} GiB | skipped {rec['skipped_total']}",
                flush=True,
            )

    def geometry(self, step: int, stats: dict) -> None:
        """The token vectors' geometry (trainer/geometry_log.py): a step record of its flat keys + scalars."""
        if not self.is_writer or not stats:
            return
        self.record({"step": step, **stats})
        self.scalars(step, stats)

    def valid(self, step: int, loss: float, scored: tuple[int, str] | None = None) -> None:
        """A validation's loss; ``scored``: :func:`validation_set`'s (tokens, what), in the record and the line."""
        if not self.is_writer:
            return
        ppl = perplexity(loss)
        what = {"valid_tokens": scored[0], "valid_data": scored[1]} if scored else {}
        self.record({"step": step, "valid_loss": loss, "valid_perplexity": ppl, **what})
        self.scalars(step, {"valid/loss": loss, "valid/perplexity": ppl})
        print(
            f"[train] step {step:>6}/{self.total_steps} | validation loss {loss:.4f} | ppl {ppl:.2f}"
            + (f" | {scored[1]}" if scored else ""),
            flush=True,
        )

    def close(self) -> None:
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
            self.tb = None
        if self.log is not None:
            self.log.close()
            self.log = None
