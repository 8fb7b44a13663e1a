"""Monitoring: TensorBoard scalars read back with EventAccumulator, one writer rank, throughput/MFU math."""
import math

import pytest

from leviathan_pretrain.trainer.metrics import memory_stats, throughput, truncate_log
from tests.workers.train_common import dp_tp_runs, records, workdir

REQUIRED = ["train/loss", "train/perplexity", "train/lr", "train/grad_norm", "train/loss_scale",
            "perf/tokens_per_s", "train/samples_consumed", "perf/step_time_s", "perf/tflops_per_device", "perf/mfu",
            "memory/rss_gb", "valid/loss", "valid/perplexity", "lev/u_edge_frac"]


def test_throughput_and_mfu_math():
    t = throughput(tokens=1000, seconds=2.0, flops_per_token=6e6, world=2, peak_flops=1e12)
    assert t["perf/tokens_per_s"] == 500
    assert t["perf/tflops_per_device"] == pytest.approx(500 * 6e6 / 2 / 1e12)
    assert t["perf/mfu"] == pytest.approx(1.5e-3)
    import torch
    assert memory_stats(torch.device("cpu"))["memory/rss_gb"] > 0.01


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
    assert 0 < ea.Scalars("perf/mfu")[-1].value < 1 and ea.Scalars("train/samples_consumed")[-1].value == 160
    lines = [line for line in runs["outputs"][0].splitlines() if line.startswith("[train] step") and "tok/s" in line]
    assert len([line for line in lines if "loss" in line and "mfu" in line]) >= 20
    assert not any("tok/s" in line for line in runs["outputs"][1].splitlines())   # rank 1 prints nothing
