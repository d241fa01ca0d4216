"""``clean``: remove what killed producers left behind (segments, sockets, rendezvous files, locks).

A link is removed only while nobody holds its lock: the OS drops a producer's lock when it dies, so a
live producer, or one starting or closing, is never touched.
"""

from __future__ import annotations

import argparse
import sys

from ..transport.shm import clean


def cmd_clean(args: argparse.Namespace) -> int:
    failed: list[str] = []

    def say(exc: Exception) -> None:  # one link in the way of cleaning: the others are still cleaned
        if str(exc) not in failed:  # said once (a link's data segments meet the same lock in the way)
            failed.append(str(exc))
            print(exc, file=sys.stderr)

    removed = clean(dry_run=args.dry_run, only=args.names or None, on_error=say)
    verb = "would remove" if args.dry_run else "removed"
    for name, items in removed:
        print(f"{verb} {name!r}: its producer is dead; {len(items)} leftover(s): {', '.join(items)}")
    if not removed and args.names and not failed:
        for name in args.names:
            print(f"nothing to clean for {name!r}: its producer is alive, or nothing of it is left")
    elif not removed and not failed:
        print("nothing to clean: every link here has a live producer, or none is left")
    return 1 if failed else 0
