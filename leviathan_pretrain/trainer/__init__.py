"""The trainer behind ``python -m leviathan_pretrain.train``: one module per concern (its input is
:mod:`leviathan_pretrain.data`).

- :mod:`.loop`               ``Trainer``: the training loop tying the others together
- :mod:`.engine`             the DeepSpeed engine (the model's pieces in order, or a ``PipelineModule`` for PP > 1)
- :mod:`.pipeline_parallel`  the pieces as DeepSpeed pipeline-stage layers
- :mod:`.schedule`           the learning-rate schedule and AdamW parameter groups (weight decay)
- :mod:`.state`              ``TrainState``: step, samples consumed, skipped steps; per-rank RNG state
- :mod:`.checkpoint`         checkpoints: save, load, prune, the resume rules, the run lock (a package)
- :mod:`.guard`              the divergence guard: healthy steps, non-finite runs, loss and gradient-norm spikes
- :mod:`.faults`             SIGTERM/SIGUSR1, the stop vote, one rank's error (exit codes: ``common.exit_codes``)
- :mod:`.peers`              every rank's host, its pulse in the job's store, the line naming a lost or stalled peer
- :mod:`.metrics`            TensorBoard, console line, ``train_log.jsonl``, throughput/MFU/memory
- :mod:`.geometry_log`       the token vectors' geometry during training, read off the model at any TP / PP / ZeRO
"""
