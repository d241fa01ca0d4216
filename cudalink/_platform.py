"""Everything that differs between operating systems lives here, and only here."""

from __future__ import annotations

import os
import re
import socket
import stat
import struct
import sys
import tempfile

from .errors import LinkError

IS_LINUX = sys.platform.startswith("linux")
IS_WINDOWS = sys.platform == "win32"

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,47}")


def check_name(name: object) -> str:
    """Link names become file and segment names, so they are a strict, traversal-free alphabet."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise LinkError(
            f"cudalink: invalid link name {name!r}: use 1-48 letters, digits, '_', '-' or '.', "
            "starting with a letter or digit (no '/', no '..')"
        )
    return name


def uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0


def segment_name(name: str, suffix: str = "") -> str:
    """Per-user shared-memory name, so two users' ``cam0`` never meet."""
    return f"cudalink-{uid()}-{name}{suffix}"


def runtime_dir() -> str:
    """A private (0700, ours, not a symlink) directory for control sockets, next to /dev/shm where it exists."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    path = os.path.join(base, f"cudalink-{uid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or (hasattr(os, "getuid") and st.st_uid != uid()):
        raise LinkError(f"cudalink: {path} is not a directory owned by you; remove it and retry")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def socket_path(name: str) -> str:
    return os.path.join(runtime_dir(), f"{name}.sock")


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket."""
    if IS_LINUX:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, peer_uid, _gid = struct.unpack("3i", raw)
        return pid, peer_uid
    if hasattr(os, "getuid"):  # BSD/macOS: no pid, but the uid is what the check needs
        getpeereid = getattr(socket, "getpeereid", None)
        if getpeereid is not None:
            peer_uid, _ = getpeereid(sock)
            return 0, int(peer_uid)
    return 0, uid()


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
