"""``python -m cudalink serve NAME --listen ucx://HOST:PORT``: a local link, served to other hosts."""

from __future__ import annotations

import argparse


def cmd_serve(args: argparse.Namespace) -> int:
    from ..ucx_server import serve

    return serve(args.name, args.listen, parent=args.parent, verbose=args.verbose, ready_fd=args.ready_fd)
