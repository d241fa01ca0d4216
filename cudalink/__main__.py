"""``python -m cudalink``: the command line lives in :mod:`cudalink.tools.cli`."""

import sys

from .tools.cli import main

if __name__ == "__main__":  # spawn children import this module under another name: run nothing then
    sys.exit(main())
