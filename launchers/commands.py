"""Every command of the project in one table: ``lev COMMAND [args]`` (or ``python -m leviathan_pretrain COMMAND``).

Each command is also its own module (``python -m leviathan_pretrain.train ...``, ``python -m launchers.slurm ...``,
as the docs show) and its own console script (``lev-train``, ``lev-slurm``, ...; ``pyproject.toml``'s
``[project.scripts]``, installed by ``make setup``). The modules not in this table are libraries. The table lives
in the top layer (launchers) because it names commands of every layer; it imports a command only when it runs
(``common.entry_points``), so ``lev --help`` starts no torch.
"""

from __future__ import annotations

import functools
import os
import sys

from common.cli import run_main
from common.entry_points import resolve
from common.exit_codes import EXIT_BAD_INPUT

# command -> (its main(argv), one line); the order is the order of the work
COMMANDS = {
    "make-corpus": ("data_prep.make_corpus:main", "build the small multi-source test corpus in the Pile's format"),
    "train-tokenizer": ("data_prep.train_tokenizer:main", "train a SentencePiece/BPE tokenizer on a seeded sample"),
    "tokenize": (
        "data_prep.tokenize_cli:main",
        "tokenize jsonl/text (.zst, .gz) or Parquet into megatron-core .bin/.idx shards",
    ),
    "data-demo": ("data_prep.data_demo:main", "the data half of the demo: corpus, tokenizer, shards"),
    "build-data-cache": (
        "leviathan_pretrain.build_data_cache:main",
        "build megatron-core's dataset index cache offline",
    ),
    "params": ("leviathan_pretrain.params:main", "closed-form parameter counts of a config"),
    "train": ("leviathan_pretrain.train:main", "pretrain: a config + key=value overrides (one process per rank)"),
    "local": ("launchers.local:main", "run N local ranks of a command (rank variables, failure handling)"),
    "slurm": ("launchers.slurm:main", "SLURM: submit, sweep, pipeline, status (requeue on preemption)"),
    "status": ("launchers.status:main", "a run's (or a sweep's) SLURM state, progress and last metrics"),
    "evaluate": ("leviathan_pretrain.evaluate:main", "held-out, frequency-bucket, WikiText and LAMBADA evaluation"),
    "compare": ("leviathan_pretrain.compare:main", "compare runs and reports: table, CSV and plots"),
    "export-hf": ("leviathan_pretrain.export_hf:main", "export a checkpoint as a Hugging Face Llama model"),
    "lm-eval": ("leviathan_pretrain.lm_eval:main", "lm-evaluation-harness with the leviathan model registered"),
    "demo": ("leviathan_pretrain.demo:main", "the whole pipeline on a tiny corpus (make demo)"),
}


def run(command: str, argv: list[str]) -> int:
    """Run ``command`` with ``argv``: its ``main``, with the one-line errors (exit 2) around it."""
    main = resolve(COMMANDS[command][0])
    if command == "lm-eval":  # lm-eval's own CLI reads sys.argv
        sys.argv = [f"lev {command}", *argv]
        main()
        return 0
    return run_main(main, argv)


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        "usage: lev COMMAND [args]   (python -m leviathan_pretrain COMMAND [args]; COMMAND --help for its own)",
        "",
    ]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def quiet_on_closed_pipe(fn):
    """``lev ... | head``: when the reader of stdout leaves, end with exit 1 and no traceback (the recipe of Python's
    "Note on SIGPIPE": what is left to print goes to /dev/null)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs) -> int:
        try:
            code = fn(*args, **kwargs)
            sys.stdout.flush()
            return code
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1

    return wrapped


@quiet_on_closed_pipe
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] not in COMMANDS:
        print(f"error: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return run(argv[0], argv[1:])


def _script(command: str):
    """The console script ``lev-<command>``."""

    def entry() -> int:
        return run(command, sys.argv[1:])

    entry.__name__ = command.replace("-", "_")
    return quiet_on_closed_pipe(entry)


for _name in COMMANDS:  # lev_train, lev_export_hf, ...: the [project.scripts] targets
    globals()[f"lev_{_name.replace('-', '_')}"] = _script(_name)

if __name__ == "__main__":
    sys.exit(main())
