"""The command-line vocabulary every command shares, its argparse helpers, :class:`UserError` and the one-line-error
``run_main`` (data_prep's, the trainer's and the launchers' commands all use them).

One spelling per meaning, in every command:

- ``--run RUN_DIR``: the training run (``train.out_dir``) a command reads or writes. ``compare`` takes several runs
  as positionals; ``launchers.slurm status`` takes its RUN_DIR as a positional or as ``--run``.
- ``--step N``, ``--checkpoint-dir DIR``, ``--tokenizer PATH``: which checkpoint of the run, and its tokenizer.
- ``--out PATH``: where the output goes (a file, a directory or a file prefix: each command's help says which).
- ``--overwrite``: replace existing output (only the command's own files; each command's help says which).
- ``--dtype NAME``: a floating-point dtype, by our short name (``fp32``, ``bf16``, ``fp16``) or the torch /
  Hugging Face one (``float32``, ``bfloat16``, ``float16``); each command keeps its own default (in its help).
- ``--quiet``: no progress output; ``--verbose``: more output, where a command has it.

Older spellings still parse, as hidden aliases (they work; ``--help`` does not show them): ``--run-dir``,
``--force`` / ``--fresh`` (``--overwrite``), ``--output`` / ``--output-prefix`` and make_corpus's positional OUT_DIR
(``--out``), ``--no-progress`` (``--quiet``). Torch-free.
"""

from __future__ import annotations

import argparse
import sys

from common.dtypes import ALIASES, DTYPES, canonical
from common.exit_codes import EXIT_BAD_INPUT


class UserError(Exception):
    """A problem the user can fix (bad argument, missing or unreadable input, existing output).

    Command-line entry points print it as one line and exit with status 2, never as a traceback.
    """


def add_option(ap, name: str, old=(), *, dest: str, required=False, positional=None, positional_help=None, **kw):
    """``name`` (shown in ``--help``) and its hidden ``old`` spellings, all parsing into ``dest``. ``positional``
    (a metavar): the value may be given as a positional too, hidden unless ``positional_help``. When ``required``,
    exactly one of the spellings must be given (argparse says so otherwise)."""
    either = bool(old or positional)
    group = ap.add_mutually_exclusive_group(required=True) if required and either else ap
    group.add_argument(name, dest=dest, required=required and not either, **kw)
    hidden = {k: v for k, v in kw.items() if k != "help"}
    for spelling in old:
        group.add_argument(spelling, dest=dest, help=argparse.SUPPRESS, **hidden)
    if positional:  # default SUPPRESS: an absent positional leaves ``dest`` to the option
        shown = positional_help or argparse.SUPPRESS
        group.add_argument(dest, nargs="?", default=argparse.SUPPRESS, metavar=positional, help=shown)


def add_run(ap, help: str, *, dest="run", required=False, nargs=None, metavar="RUN_DIR", positional_help=None):
    """``--run RUN_DIR`` (hidden ``--run-dir``); with ``positional_help``, a positional RUN_DIR is the same."""
    positional = metavar if positional_help else None
    kw = dict(dest=dest, required=required, positional=positional, positional_help=positional_help)
    add_option(ap, "--run", ("--run-dir",), nargs=nargs, metavar=metavar, help=help, **kw)


def add_checkpoint_options(ap, verb: str) -> None:
    """``--step N``, ``--checkpoint-dir DIR``, ``--tokenizer PATH``: which checkpoint of ``--run`` to ``verb``."""
    ap.add_argument("--step", type=int, metavar="N", help=f"{verb} global_step<N> (default: the latest checkpoint)")
    ap.add_argument(
        "--checkpoint-dir", metavar="DIR", help="the run's checkpoint.dir, when it is not RUN_DIR/checkpoints"
    )
    ap.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="the run's tokenizer, any kind data_prep reads (default: the run's data.tokenizer; its fingerprint "
        "is checked)",
    )


def dtype(name: str) -> str:
    """argparse ``type`` of ``--dtype``: :func:`~common.dtypes.canonical`, its error as argparse's."""
    try:
        return canonical(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_dtype(ap, default: str, help: str, choices=tuple(DTYPES)) -> None:
    """``--dtype`` of ``choices`` (short names), the torch / HF names accepted as well; ``default`` in the help."""
    longs = ", ".join(long for long, short in ALIASES.items() if short in choices)
    ap.add_argument(
        "--dtype",
        type=dtype,
        default=default,
        choices=choices,
        help=f"{help}; default {default} (also spelled {longs})",
    )


def add_overwrite(ap, help: str, old=()) -> None:
    """``--overwrite`` (hidden ``old`` spellings, e.g. ``--force``)."""
    add_option(ap, "--overwrite", old, dest="overwrite", action="store_true", help=help)


def add_out(ap, help: str, *, old=(), dest: str = "out", metavar: str = "PATH", **kw) -> None:
    """``--out PATH`` (hidden ``old`` spellings); ``kw``: ``required``, ``default``, ``positional``."""
    add_option(ap, "--out", old, dest=dest, metavar=metavar, help=help, **kw)


def add_quiet(ap, help: str, old=()) -> None:
    """``--quiet`` (hidden ``old`` spellings, e.g. ``--no-progress``)."""
    add_option(ap, "--quiet", old, dest="quiet", action="store_true", help=help)


def run_main(main, argv=None, errors: tuple[type[BaseException], ...] = ()) -> int:
    """``main(argv)``, its exit code; a :class:`UserError` or an exception of ``errors`` (the user's to fix) is one
    ``error: ...`` line and ``EXIT_BAD_INPUT``, Ctrl-C ``error: interrupted`` and 130. ``argv`` may be a parsed
    namespace: it is passed on."""
    try:
        rc = main(argv)
    except (UserError, *errors) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr, flush=True)
        return 130
    return int(rc or 0)
