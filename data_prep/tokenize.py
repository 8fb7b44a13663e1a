"""``python -m data_prep.tokenize``: the command's name. Its code is data_prep/tokenize_cli.py.

This file exists only so the documented command keeps working. Nothing imports it: a module named
``tokenize`` shadows the standard library's wherever data_prep/ itself is on sys.path (``python
data_prep/x.py``), so the code lives under a name that cannot.
"""

import sys

from common.cli import run_main
from data_prep.tokenize_cli import main

if __name__ == "__main__":
    sys.exit(run_main(main))
