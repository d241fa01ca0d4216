"""``python benchmarks/run.py [--quick] [--json PATH] [--device 0]``: same as ``python -m cudalink bench``.

Kept as a file so the benchmark can be run from a checkout without installing; everything it does
lives in :mod:`cudalink.tools.bench` (spawned children must import their code from the package).
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    try:
        from cudalink.tools.cli import main
    except ImportError:  # a plain checkout: use the package next to this folder
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from cudalink.tools.cli import main
    sys.exit(main(["bench", *sys.argv[1:]]))
