"""A run's checkpoints: written atomically, resumed exactly, never lost to a crash, a second job or a bad step.

- :mod:`.store`     the checkpoint directory: save (every file listed, then committed), load, prune, crash-safe deletes
- :mod:`.names`     the directory's names and their torch-free readers (``latest``, tags, marks)
- :mod:`.record`    ``leviathan.json``: :class:`~.record.CheckpointRecord` (torch-free)
- :mod:`.resume`    what a start resumes from: the rules of ``latest``, the checks before loading, fallback (torch-free)
- :mod:`.run_lock`  one owner of a run directory: the ``leviathan.lock`` lease and its heartbeat (torch-free)
- :mod:`.safe_io`   weights-only loading, writes through our file object, DeepSpeed's checkpoint engine with both
- :mod:`.errors`    a file not written or not readable, in one line: the file, the cause, what to do (torch-free)
- :mod:`.reshard`   resume at another data-parallel size (DeepSpeed's universal checkpoint)
"""
