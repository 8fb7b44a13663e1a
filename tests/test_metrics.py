"""Monitoring: TensorBoard scalars read back with EventAccumulator, one writer rank, throughput/MFU math."""

import math
import re

import pytest

from leviathan_pretrain.trainer.metrics import memory_stats, peak_flops, throughput, truncate_log
from tests.workers.train_common import dp_tp_runs, records, workdir

REQUIRED = [
    "train/loss",
    "train/perplexity",
    "train/lr",
    "train/grad_norm",
    "train/loss_scale",
    "perf/tokens_per_s",
    "train/samples_consumed",
    "perf/step_time_s",
    "perf/tflops_per_device",
    "memory/rss_gib",
    "valid/loss",
    "valid/perplexity",
    "lev/u_edge_frac",
]


def test_throughput_and_mfu_math():
    t = throughput(tokens=1000, seconds=2.0, flops_per_token=6e6, world=2, peak=1e12)
    assert t["perf/tokens_per_s"] == 500
    assert t["perf/tflops_per_device"] == pytest.approx(500 * 6e6 / 2 / 1e12)
    assert t["perf/mfu"] == pytest.approx(1.5e-3)
    assert "perf/mfu" not in throughput(tokens=1000, seconds=2.0, flops_per_token=6e6, world=2, peak=None)
    import torch

    assert memory_stats(torch.device("cpu"))["memory/rss_gib"] > 0.01


def test_peak_flops_is_known_or_absent(monkeypatch):
    """No MFU on a CPU (a guessed peak could give > 100% elsewhere) unless logging.peak_flops is set; GPUs by
    datasheet and precision; an unknown GPU gets none."""
    import torch

    cpu = torch.device("cpu")
    assert peak_flops(cpu, "fp32", None)[0] is None and "a CPU" in peak_flops(cpu, "fp32", None)[1]
    assert peak_flops(cpu, "fp32", 2e11) == (2e11, "logging.peak_flops")
    for name, prec, want in (
        ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
        ("NVIDIA H200", "fp32", 67e12),
        ("NVIDIA H100 PCIe", "bf16", 756e12),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
        ("NVIDIA GeForce RTX 4090", "bf16", None),
    ):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None, n=name: n)
        assert peak_flops(torch.device("cuda", 0), prec, None)[0] == want, name


def test_truncate_log_keeps_steps_up_to_resume(tmp_path):
    p = tmp_path / "log.jsonl"
    p.write_text("".join(f'{{"step": {s}, "loss": 1.0}}\n' for s in range(1, 8)) + '{"step": 3, "event": "x"}\n')
    truncate_log(p, 4)
    assert [line for line in p.read_text().splitlines()][-1] == '{"step": 3, "event": "x"}'
    assert len(p.read_text().splitlines()) == 5


@pytest.mark.multiproc
def test_tensorboard_scalars_from_tp2_run():
    """The TP=2 LEV run (log_interval=1): every scalar exists and is finite; LEV health covers the heads of
    both TP ranks; one event file (only the writer rank writes); a console line per log interval."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = dp_tp_runs()
    tb = workdir() / "tp2" / "tensorboard"
    assert len(list(tb.glob("events.out.tfevents.*"))) == 1
    ea = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    ea.Reload()
    tags = set(ea.Tags()["scalars"])
    heads = {f"lev/head{h}/out_norm" for h in range(4)} | {f"lev/head{h}/u_edge_frac" for h in range(4)}
    missing = (set(REQUIRED) | heads) - tags
    assert not missing, f"missing TensorBoard scalars {sorted(missing)}; have {sorted(tags)}"
    for tag in tags:
        values = [e.value for e in ea.Scalars(tag)]
        assert values and all(math.isfinite(v) for v in values), tag
    assert [e.step for e in ea.Scalars("train/loss")] == list(range(1, 21))
    assert [e.step for e in ea.Scalars("valid/loss")] == [10, 20]
    loss = {r["step"]: r["loss"] for r in records("tp2") if "loss" in r}
    assert [e.value for e in ea.Scalars("train/loss")] == pytest.approx([loss[s] for s in range(1, 21)])
    assert "perf/mfu" not in tags  # a CPU run: no peak to divide by, so no MFU at all
    assert ea.Scalars("perf/tflops_per_device")[-1].value > 0 and ea.Scalars("train/samples_consumed")[-1].value == 160
    lines = [line for line in runs["outputs"][0].splitlines() if line.startswith("[train] step") and "tok/s" in line]
    assert len([line for line in lines if "loss" in line and "TFLOP/s" in line and "mfu" not in line]) >= 20
    # the console's memory figure names its unit, GiB (2**30 bytes; it said GB before), as the logged value does
    assert all(re.search(r"\| mem [0-9]+\.[0-9]{2} GiB \|", line) for line in lines), lines[-1]
    logged = [r["memory/rss_gib"] for r in records("tp2") if "memory/rss_gib" in r]
    assert logged and all(0.01 < x < 64 for x in logged)
    assert not any("tok/s" in line for line in runs["outputs"][1].splitlines())  # rank 1 prints nothing
    # the start names the trained parameters as `params` counts them; each validation its tokens and data
    from leviathan_pretrain.config import load_config
    from leviathan_pretrain.model import counts
    from leviathan_pretrain.trainer.metrics import validation_set
    from tests.workers.train_common import CONFIG, overrides

    cfg = load_config(CONFIG, overrides("tp2", "parallel.tensor_parallel=2"))
    assert f"[train] {counts.trained_text(counts.param_summary(cfg.model, 2))}\n" in runs["outputs"][0]
    (layout,) = [r for r in records("tp2") if r.get("event") == "layout"]
    assert layout["params"]["total"] == counts.param_breakdown(cfg.model, 2)["total"]
    tokens, what = validation_set(cfg)
    assert tokens == 2 * 8 * 64 and what.endswith("from the validation split of data.prefixes (data.split=90,8,2)")
    valid = [line for line in runs["outputs"][0].splitlines() if "validation loss" in line]
    assert valid and all(line.endswith(f"| {what}") for line in valid), valid[-1]
    assert all(r["valid_tokens"] == tokens and r["valid_data"] == what for r in records("tp2") if "valid_loss" in r)
