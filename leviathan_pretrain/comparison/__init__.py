"""The comparison of runs behind ``lev compare``: their rows, tables, CSV, geometry columns and plots.

- :mod:`.runs`      a run directory or an evaluation report as a :class:`~.runs.Run` (report, config, curves); the
                    baseline among the runs, names that tell them apart; :class:`~.runs.CompareError`
- :mod:`.rows`      each run's numbers, their change vs the baseline, tokens to the baseline's validation loss
- :mod:`.tables`    the rows (:class:`~.tables.RunRow`, :class:`~.tables.Comparison`), Markdown tables and CSV
- :mod:`.geometry`  the token-vector geometry columns and curves
- :mod:`.plots`     the PNGs (matplotlib, imported on use)
- :mod:`.outputs`   everything ``--out`` gets: the Markdown, the CSV and the plots
"""
