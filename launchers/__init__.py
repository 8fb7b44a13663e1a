"""Launching: the `lev` command table, local ranks, and SLURM jobs (submit, sweep, pipeline, status, requeue)."""
