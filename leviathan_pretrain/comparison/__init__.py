"""The comparison of runs behind ``lev compare``: their rows, tables, CSV, geometry columns and plots.

- :mod:`.runs`      a run directory or an evaluation report as a :class:`~.runs.Run` (report, config, curves); the
                    baseline, each run's numbers and their change vs it; the files ``--out`` gets
- :mod:`.tables`    the rows (:class:`~.tables.RunRow`, :class:`~.tables.Comparison`), Markdown tables and CSV
- :mod:`.geometry`  the token-vector geometry columns and curves
- :mod:`.plots`     the PNGs (matplotlib, imported on use)
"""
