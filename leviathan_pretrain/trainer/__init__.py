"""The trainer behind ``python -m leviathan_pretrain.train``: one module per concern.

- :mod:`.data`        shard checks, megatron-core ``GPTDataset`` blends, deterministic micro-batches
- :mod:`.data_cache`  the data index cache's location, index files and stamp
- :mod:`.transfer`    a micro-batch to the device: one packed (pinned on CUDA) buffer, one copy, host unique ids
- :mod:`.prefetch`    the next global batch built on a background thread while the step runs
- :mod:`.schedule`    learning-rate schedule and AdamW parameter groups
- :mod:`.engine`      the DeepSpeed engine (megatron-core model, or a DeepSpeed ``PipelineModule`` for PP > 1)
- :mod:`.pipe`        the pipeline-stage layers
- :mod:`.checkpoint`  DeepSpeed checkpoints, atomic ``latest``, keep-last-K, RNG/data state, safe loading
- :mod:`.ckpt_names`  the checkpoint directory's names and their torch-free readers (re-exported by ``.checkpoint``)
- :mod:`.ckpt_record` ``CheckpointRecord``: ``leviathan.json``'s fields, defaults and JSON (torch-free)
- :mod:`.ckpt_resume` what a start resumes from: the rules of ``latest``, the checks before loading, fallback
- :mod:`.run_lock`    one owner of a run directory: the ``leviathan.lock`` lease with its heartbeat
- :mod:`.guard`       the divergence guard: healthy steps, non-finite runs, loss and gradient-norm spikes
- :mod:`.safe_io`     weights-only checkpoint loading, saving through our file object, DeepSpeed's engine with both
- :mod:`.ckpt_errors` a checkpoint file not written or not readable, in one line: the file, the cause, what to do
- :mod:`.state`       ``TrainState``: step, samples consumed, skipped steps; per-rank RNG state
- :mod:`.reshard`     resume at another data-parallel size (DeepSpeed universal checkpoint)
- :mod:`.metrics`     TensorBoard, console line, ``train_log.jsonl``, throughput/MFU/memory
- :mod:`.geometry_log` the token vectors' geometry during training, read off the model at any TP / PP / ZeRO
- :mod:`.faults`      SIGTERM/SIGUSR1, the stop vote, one rank's error (exit codes: ``data_prep.exit_codes``)
- :mod:`.peers`       every rank's host, its pulse in the job's store, the line naming a lost or stalled peer
- :mod:`.loop`        the training loop tying them together
"""
