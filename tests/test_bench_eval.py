"""benchmarks/bench_eval.py deletes only training directories it (or the demo) made: a run it is pointed at twice
is replaced, a user's directory of the same name is refused with nothing deleted, and files beside it survive."""

from __future__ import annotations

import pytest

from leviathan_pretrain.walkthrough.steps import DEMO_MARK
from tests.benchmark_scripts import load

bench = load("bench_eval")


def test_a_run_is_replaced_only_when_it_is_ours_and_files_beside_it_survive(tmp_path):
    out = tmp_path / "pair"
    out.mkdir()
    (out / "notes.txt").write_text("mine")  # the user's, beside the run
    req = bench.fresh_request(out, 30, 2)
    assert req.run_dir == out / "train" and (out / "train" / DEMO_MARK).is_file()
    (out / "train" / "train_log.jsonl").write_text("{}\n")  # a previous measurement
    bench.fresh_request(out, 30, 2)
    assert sorted(p.name for p in (out / "train").iterdir()) == [DEMO_MARK]
    assert (out / "notes.txt").read_text() == "mine"

    foreign = tmp_path / "theirs"
    (foreign / "train").mkdir(parents=True)
    (foreign / "train" / "model.pt").write_text("weights")  # no mark: not ours
    with pytest.raises(SystemExit, match="was not created by the demo"):
        bench.fresh_request(foreign, 30, 2)
    assert (foreign / "train" / "model.pt").read_text() == "weights"
