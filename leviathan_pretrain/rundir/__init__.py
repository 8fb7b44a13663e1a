"""A run directory (``train.out_dir``) and the files in it that more than one command reads: torch-free.

- :mod:`.layout`     where a run's checkpoints, reports, logs and TensorBoard events live (:class:`RunLayout`)
- :mod:`.train_log`  ``train_log.jsonl``: its name and its one reader (a torn last line of a live run skipped)
- :mod:`.tb_events`  the one reader of a run's TensorBoard scalars (compare's curves, the launchers' status)
- :mod:`.host`       the machine a run trains on, in one line (the training log's ``layout`` record names it)
"""
