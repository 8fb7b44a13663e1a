"""The demo's work behind ``lev demo`` (``python -m leviathan_pretrain.demo``, ``make demo``): the whole pipeline on a
tiny corpus; the data half is ``data_prep.data_demo``.

- :mod:`.steps`    the request, the data, the marked training directory, the trainer, evaluation and export run as
                   the user's commands (each reused when its output is there), the time each took
- :mod:`.results`  what the demo prints about the run: losses, checkpoint, TensorBoard, what the figures mean
"""
