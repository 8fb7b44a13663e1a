"""``python -m leviathan_pretrain COMMAND [args]``: the same as ``lev COMMAND``. A door, imported by nothing: the
command table it opens lives in the top layer (launchers/commands.py), as it names commands of every layer."""

import sys

from launchers.commands import main

if __name__ == "__main__":
    sys.exit(main())
