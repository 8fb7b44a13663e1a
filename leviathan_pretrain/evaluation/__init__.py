"""Evaluation of a trained run behind ``lev evaluate`` (docs/evaluation.md).

- :mod:`.load`             a checkpoint of any layout as one model: TP shards, pipeline layer files, ZeRO-3 partitions
- :mod:`.scoring`          sliding-window per-token scoring (every target once), data-parallel shares summed
- :mod:`.heldout`          held-out shard streams and training-frequency buckets
- :mod:`.texts`            WikiText and LAMBADA
- :mod:`.report`           the evaluation report (JSON schema 1), its console table and ``eval/`` TensorBoard scalars
- :mod:`.evaluate_run`     one evaluation: the options, the checkpoint loaded, each section scored into the report,
                           the reports written; several runs in one process
- :mod:`.lm_eval_adapter`  a run as lm-evaluation-harness's ``leviathan`` model
"""
