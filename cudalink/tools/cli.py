"""``python -m cudalink demo|info|monitor|bench|clean|serve|relay``: see it work, check a machine, watch a
link, measure, remove what killed producers left, and cross hosts.

Every command prints one ``cudalink: ...`` line on failure (``--debug`` shows the traceback), so a
user sees what to do instead of a stack. ``monitor`` maps the header segment read-only and never
joins the link, so watching a production link cannot disturb it.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from .._version import __version__
from ..errors import LinkError
from .clean import cmd_clean
from .demo import cmd_demo
from .info import cmd_info
from .monitor import cmd_monitor
from .relay import cmd_relay
from .report import check_bench_args, cmd_bench
from .serve import cmd_serve


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors read as every other cudalink error does: a ``cudalink:`` line that
    says where to look. Its sub-commands' parsers are of this class too (``add_subparsers`` makes them so)."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"cudalink: {self.prog}: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show full tracebacks instead of one-line errors",
    )
    parser = _Parser(
        prog="python -m cudalink",
        parents=[common],
        description="cudalink: zero-copy GPU (and CPU) frames between processes.",
    )
    parser.add_argument("--version", action="version", version=f"cudalink {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{demo,info,monitor,bench,clean,serve,relay}")

    p = sub.add_parser("demo", parents=[common], help="one producer and N consumer processes on one link, live stats")
    p.add_argument("--device", default="auto", help="cpu | 0 | cuda:N | auto (default: a GPU if usable, else cpu)")
    p.add_argument("--consumers", type=int, default=2, help="consumer processes (default 2)")
    p.add_argument("--shape", default="720,1280,4", help="frame shape (default 720,1280,4)")
    p.add_argument("--dtype", default="uint8", help="frame dtype (default uint8)")
    p.add_argument("--slots", type=int, default=4, help="ring slots (default 4)")
    p.add_argument("--fps", type=float, default=60.0, help="producer frame rate; 0 = as fast as possible (default 60)")
    p.add_argument("--seconds", type=float, default=None, help="stop after this long (default 5 unless --frames)")
    p.add_argument("--frames", type=int, default=None, help="stop after this many published frames")
    p.add_argument("--name", default=None, help="link name (default demo-<pid>)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser(
        "info", parents=[common], help="driver, GPUs, IPC support, shared memory: is this machine ready?"
    )
    p.add_argument(
        "segments",
        nargs="*",
        metavar="cuda-link:NAME",
        help="describe these cuda-link segments (default: every one found on this machine)",
    )
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("monitor", parents=[common], help="watch a link read-only (never joins it)")
    p.add_argument("name", help="link name, as given to Sender, or cuda-link:NAME for a cuda-link segment")
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between samples (default 0.5)")
    p.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="stop after this long (default: until Ctrl-C); exit status 1 if the link was never there to read",
    )
    p.set_defaults(func=cmd_monitor)

    p = sub.add_parser(
        "clean", parents=[common], help="remove what dead producers left (only links whose producer is dead)"
    )
    p.add_argument("names", nargs="*", metavar="NAME", help="only these links (default: every link of yours here)")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    p.set_defaults(func=cmd_clean)

    p = sub.add_parser("bench", parents=[common], help="latency/throughput vs torch.multiprocessing and other peers")
    p.add_argument("--quick", action="store_true", help="short CPU-backend run (CI: under a minute on 2 cores)")
    p.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="also write the full JSON report to PATH ('-': stdout, and the tables go to stderr)",
    )
    p.add_argument("--device", default=None, help="cpu | 0 | cuda:N | auto (default: auto; cpu with --quick)")
    p.add_argument("--frames", type=int, default=None, help="frames per latency run (overrides the plan)")
    p.add_argument("--fanout", type=int, default=None, help="consumers in the fan-out run (default 8)")
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="only the floors and where one frame's time goes, stage by stage, across both processes",
    )
    p.add_argument(
        "--only",
        metavar="PARTS",
        default=None,
        help="run only these parts, comma-separated: floors, breakdown, handoff, recv-export, small, fanout, "
        "wait-modes, copy-send, gpu-clock (e.g. --only copy-send,gpu-clock)",
    )
    p.add_argument(
        "--mps",
        action="store_true",
        help="the GPU-clock rows also run under the MPS daemon, which the bench starts "
        "(nvidia-cuda-mps-control -d) and stops again (quit) around that pass",
    )
    p.add_argument(
        "--no-wake-ahead",
        dest="wake_ahead",
        action="store_false",
        help="the breakdown's consumer sleeps until each frame is published (Receiver(wake_ahead=False))",
    )
    p.add_argument(
        "--remote",
        action="store_true",
        help="ucx:// on loopback against a bare UCXX send/recv and a plain TCP socket (needs cudalink[ucx])",
    )
    p.add_argument(
        "--multi-gpu",
        dest="multi_gpu",
        action="store_true",
        help="a consumer on GPU 1 of a producer on GPU 0 against one on GPU 0 and a bare torch .to('cuda:1')",
    )
    p.set_defaults(func=_bench)

    p = sub.add_parser(
        "serve",
        parents=[common],
        help="serve a local link to other hosts over UCX (cudalink[ucx])",
        description="Serve a local link to other hosts over UCX. Both hosts need the same key: the first serve "
        "writes ~/.config/cudalink/ucx.key (copy it to each consumer's host), or set CUDALINK_KEY to the same hex "
        "on both. Frames are not encrypted: use a trusted network or a VPN.",
    )
    p.add_argument("name", help="the local link to serve")
    p.add_argument("--listen", default="ucx://127.0.0.1:13337", help="ucx://HOST:PORT (default 127.0.0.1:13337)")
    p.add_argument("--parent", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--ready-fd", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("-v", "--verbose", action="store_true", help="log consumers joining and leaving")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("relay", parents=[common], help="republish a remote ucx:// stream as a local link")
    p.add_argument("url", help="ucx://HOST:PORT/NAME (port 13337 if left out; a local link's name works too)")
    p.add_argument("--as", dest="local", required=True, help="the local link name to publish")
    p.add_argument("--device", default="cpu", help="cpu | 0 | cuda:N: where the local link's slots live (default cpu)")
    p.add_argument(
        "--slots",
        type=int,
        default=4,
        help="local ring slots (default 4): what local consumers hold at once, plus one a frame lands in",
    )
    p.add_argument("--in-order", action="store_true", help="every frame in order (latest=False) instead of the newest")
    p.add_argument(
        "--seconds", type=float, default=None, help="stop after this long (default: until Ctrl-C or SIGTERM)"
    )
    p.set_defaults(func=cmd_relay)
    return parser


def _bench(args: argparse.Namespace) -> int:
    check_bench_args(args)
    if getattr(args, "multi_gpu", False):
        from .multigpu_bench import cmd_multi_gpu

        return cmd_multi_gpu(args)
    return cmd_bench(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m cudalink`` and the ``cudalink`` script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = bool(getattr(args, "debug", False))
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    import multiprocessing

    # every child we start is spawned; making it the default too keeps torch's queue feeders from
    # assuming fork (and warning) when CUDA tensors are pickled in this process
    multiprocessing.set_start_method("spawn", force=True)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        print("cudalink: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug:
            traceback.print_exc()
        text = " ".join(str(exc).split()) or type(exc).__name__
        # the library's advice, in this command line's words (an option, not a keyword argument)
        text = text.replace("use device='cpu'", "use --device cpu")
        text = text.replace("pick another port for serve=", "pick another port for --listen")
        if args.command == "relay":  # the relay has no timeout to lengthen: what it waits for is the server
            text = text.replace("start the Sender first, or pass a longer timeout", "start it, then the relay")
        if not text.startswith("cudalink:"):
            text = f"cudalink: {type(exc).__name__}: {text}" if not isinstance(exc, LinkError) else f"cudalink: {text}"
        print(text, file=sys.stderr)
        return 1


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
