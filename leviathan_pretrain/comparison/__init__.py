"""The comparison of runs behind ``lev compare``: their rows, tables, CSV, geometry columns and plots.

- :mod:`.tables`    the rows (:class:`~.tables.RunRow`, :class:`~.tables.Comparison`), Markdown tables and CSV
- :mod:`.geometry`  the token-vector geometry columns and curves
- :mod:`.plots`     the PNGs (matplotlib, imported on use)
"""
