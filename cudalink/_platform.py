"""Everything that differs between operating systems lives here, and only here.

Each Windows branch is a few lines next to its POSIX twin, and takes its OS module or DLL as an
argument where it can, so ``tests/test_platform.py`` runs it on Linux against a stub.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import getpass
import hashlib
import math
import mmap
import os
import platform
import re
import select
import socket
import stat
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from .errors import ArgumentError, ArgumentTypeError, LinkError

if TYPE_CHECKING:
    import ctypes

IS_LINUX = sys.platform.startswith("linux")
IS_WINDOWS = sys.platform == "win32"
IS_MACOS = sys.platform == "darwin"
#: macOS: POSIX shm names hold 31 characters (PSHMNAMLEN, the leading '/' included), Unix socket paths 104
_MACOS_SHM_NAME_MAX = 31
#: fds can cross the control channel (SCM_RIGHTS): needed for cuda.core IPC pools
HAS_FD_PASSING = hasattr(socket, "AF_UNIX") and hasattr(socket, "send_fds")

CONTROLS = ("unix", "tcp")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,47}")


def check_name(name: object) -> str:
    """Link names become file and segment names, so they are a strict, traversal-free alphabet."""
    if not isinstance(name, str):
        raise ArgumentTypeError(
            f"cudalink: invalid link name {name!r}: a link name is a str of 1-48 letters, digits, '_', '-' or '.', "
            f"got {type(name).__name__}"
        )
    if not _NAME.fullmatch(name) or ".." in name:
        if "://" in name:  # an address of a kind we do not speak (tcp://, http://, UCX:// in capitals)
            raise ArgumentError(
                f"cudalink: invalid link name {name!r}: the addresses cudalink reads are ucx://HOST:PORT/NAME (a "
                "link served from another host; a Sender serves its own with serve='ucx://HOST:PORT') and "
                "cuda-link:NAME; a local link's name is 1-48 letters, digits, '_', '-' or '.'"
            )
        # cuda-link's own default names ("cudalink_ipc_TD>>Python") are read through its address, written by
        # protocol="cuda-link" (a Sender given the address itself lands here too: its name, not the address)
        seg = name.removeprefix("cuda-link:")
        other = (
            f"; a cuda-link segment is read as 'cuda-link:{seg}' and written by Sender({seg!r}, ..., "
            "protocol='cuda-link')"
            if (">>" in name or seg != name) and segment_name_ok(seg)
            else ""  # no hint that names an invalid name: 'cuda-link:' alone, or a path
        )
        raise ArgumentError(
            f"cudalink: invalid link name {name!r}: use 1-48 letters, digits, '_', '-' or '.', "
            f"starting with a letter or digit (no '/', no '..'){other}"
        )
    return name


def is_wsl(release: str | None = None) -> bool:
    """WSL2 kernels say so in their release string; its driver refuses cuda.core IPC pools."""
    return IS_LINUX and "microsoft" in (platform.uname().release if release is None else release).lower()


def default_handles(linux: bool = IS_LINUX, wsl: bool | None = None) -> str:
    """``handles="auto"``: IPC pools where the driver has them (native Linux), cuIpc handles elsewhere."""
    return "pool" if linux and not (is_wsl() if wsl is None else wsl) else "legacy"


def default_control(env: str | None = None) -> str:
    """The control channel a producer opens: a Unix socket where fds can be passed, else loopback TCP.

    ``CUDALINK_CONTROL=tcp`` forces the loopback channel (what Windows uses) on any OS, so it can be
    tested and used where Unix sockets are unavailable (some sandboxes).
    """
    want = os.environ.get("CUDALINK_CONTROL", "auto") if env is None else env
    if want in ("", "auto"):
        return "unix" if HAS_FD_PASSING else "tcp"
    if want not in CONTROLS:
        raise LinkError(f"cudalink: CUDALINK_CONTROL must be 'auto', 'unix' or 'tcp', got {want!r}")
    if want == "unix" and not hasattr(socket, "AF_UNIX"):
        raise LinkError("cudalink: this Python has no Unix sockets; set CUDALINK_CONTROL=tcp (or unset it)")
    return want


# -- users --------------------------------------------------------------------------------------------------


def uid() -> int:
    """The uid the Unix channel compares with SO_PEERCRED (0 where uids do not exist)."""
    return os.getuid() if hasattr(os, "getuid") else 0


def user_tag(user: str | None = None) -> str:
    """Names are per user: the uid on POSIX, a digest of the account name on Windows."""
    if hasattr(os, "getuid") and user is None:
        return str(uid())
    name = getpass.getuser() if user is None else user
    return "u" + hashlib.sha256(name.lower().encode()).hexdigest()[:12]


def segment_name(name: str, suffix: str = "") -> str:
    """Per-user shared-memory name, so two users' ``cam0`` never meet. On macOS, whose shm names hold 31
    characters, the user and link name go as a digest (``cl`` + 10 hex, before the longest suffix's 18)."""
    if IS_MACOS:
        digest = hashlib.blake2b(f"{user_tag()}/{name}".encode(), digest_size=5).hexdigest()
        return f"cl{digest}{suffix}"
    return f"cudalink-{user_tag()}-{name}{suffix}"


# -- files ------------------------------------------------------------------------------------------------


def runtime_dir() -> str:
    """A private directory for control sockets, locks and keys: 0700 and ours on POSIX (next to /dev/shm
    where it exists); on Windows the per-user temp directory, which the profile's ACL keeps private."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        base = "/dev/shm"
    elif IS_MACOS and os.access("/tmp", os.W_OK):
        base = "/tmp"  # $TMPDIR (/var/folders/...) would push a 48-character name's socket past 104 bytes
    else:
        base = tempfile.gettempdir()
    path = os.path.join(base, f"cudalink-{user_tag()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if hasattr(os, "getuid") and st.st_uid != uid():
        raise LinkError(
            f"cudalink: {path}, where your links keep their sockets and locks, belongs to uid {st.st_uid}, not "
            f"you: another user made it; an administrator must remove it (sudo rm -r {path})"
        )
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise LinkError(f"cudalink: {path} is not a directory owned by you; remove it and retry")
    if hasattr(os, "getuid") and st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def segment_name_ok(seg: str) -> bool:
    """Whether ``seg`` can name a cuda-link segment: taken as given (cuda-link's names hold ``>`` and other
    characters), but never empty, a path or NUL, which no shared-memory name can hold."""
    return bool(seg) and "/" not in seg and "\0" not in seg and seg not in (".", "..")


def socket_path(name: str) -> str:
    return os.path.join(runtime_dir(), f"{name}.sock")


def in_the_way(path: str, what: str) -> LinkError:
    """A directory where a link keeps ``what`` (its lock, socket or rendezvous file): cudalink never made it, and
    unlink() cannot remove it, so a Sender, a Receiver and ``clean`` each stop here and say so, rather than
    fail with a bare IsADirectoryError or take it for a dead producer's leftover."""
    return LinkError(
        f"cudalink: {path} is a directory, where cudalink keeps {what}; cudalink did not make it and will not "
        f"remove it: remove it yourself (rm -r {path}) and retry"
    )


def write_private(path: str, data: bytes) -> None:
    """Replace ``path`` atomically with a 0600 file, so a reader sees the old bytes or the new, never half."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_BINARY", 0), 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    for attempt in range(50):
        try:
            os.replace(tmp, path)
            return
        except PermissionError:  # Windows: a reader has the old file open for a moment
            if not IS_WINDOWS or attempt == 49:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            time.sleep(0.002)


def usable_cores() -> int | None:
    """CPUs this process may run on: its affinity where the OS has one (a container or ``taskset`` limits it
    below ``os.cpu_count()``), else the count of the machine's; None where neither is known."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows
        return os.cpu_count()


def open_to_others(st_mode: int) -> bool:
    """Whether a file's mode lets users other than its owner read or write it. Windows keeps no such bits: no."""
    return not IS_WINDOWS and bool(st_mode & 0o077)


def read_regular(path: str, size: int, follow: bool = True) -> bytes | None:
    """Up to ``size`` bytes of the regular file ``path``; None where something else carries the name: a FIFO
    (an open() of one blocks until a writer comes, which none may) or a directory. Raises as ``open`` does
    (``follow=False``: also on a symlink, where the OS can say)."""
    return read_regular_mode(path, size, follow)[0]


def read_regular_mode(path: str, size: int, follow: bool = True) -> tuple[bytes | None, int]:
    """:func:`read_regular`, and the mode of what carries the name (read from the same open file)."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags if follow else flags | getattr(os, "O_NOFOLLOW", 0))
    try:
        mode = os.fstat(fd).st_mode
        return (os.read(fd, size) if stat.S_ISREG(mode) else None), mode
    finally:
        os.close(fd)


class ProcessLock:
    """An exclusive lock that the OS drops when its holder dies: the liveness test that cannot go stale.

    POSIX uses ``flock`` (per open file, so two Senders in one process exclude each other too);
    Windows uses ``msvcrt.locking`` on byte 0. The file may be removed only by :meth:`remove_and_release`
    (unlinked while held, POSIX; deleted once closed, Windows, which refuses while anyone has it open),
    and :meth:`acquire` counts a lock only on the file the path still names: a process that opened the
    file just before it was removed would otherwise hold "the" lock on an inode nobody else can see.
    """

    def __init__(self, path: str, windows: bool = IS_WINDOWS) -> None:
        self.path = path
        self._windows = windows
        self._fd = -1

    def acquire(self, wait: float = 0.0) -> bool:
        """Take the lock now, or within ``wait`` seconds: a lock is held for a moment by a process that
        only looks (a Receiver or ``cudalink clean`` asking whether a producer is alive)."""
        deadline = time.monotonic() + wait
        while not self._try():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def _try(self) -> bool:
        """One attempt: False while another holds it, or when the file was replaced under us."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_BINARY", 0), 0o600)
        except OSError:  # IsADirectoryError on POSIX, PermissionError on Windows
            if os.path.isdir(self.path):
                raise in_the_way(self.path, "a link's lock file") from None
            raise
        try:
            if self._windows:
                import msvcrt

                msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)  # type: ignore[attr-defined]
            else:
                import fcntl

                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # BlockingIOError on POSIX, PermissionError (EACCES) on Windows
            os.close(fd)
            return False
        try:
            now = os.stat(self.path)
            ours = os.fstat(fd)
            same = (now.st_dev, now.st_ino) == (ours.st_dev, ours.st_ino)
        except OSError:  # removed after we opened it
            same = False
        if not same:
            self._fd = fd
            self.release()
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        with contextlib.suppress(OSError):
            if self._windows:
                import msvcrt

                os.lseek(fd, 0, os.SEEK_SET)
                msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)  # type: ignore[attr-defined]
        os.close(fd)  # POSIX: closing drops the flock

    def forget(self) -> None:
        """A forked child's copy: close it without unlocking (an unlock on any copy drops the parent's lock)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    def remove_and_release(self) -> None:
        """Release and leave no file behind, without ever removing a lock another process holds."""
        if self._fd < 0:
            return
        if self._windows:  # Windows deletes no file that is open: another holder's open keeps it
            self.release()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            return
        with contextlib.suppress(OSError):
            os.unlink(self.path)  # while held: whoever opens the path next makes a new file
        self.release()

    @property
    def held(self) -> bool:
        return self._fd >= 0


# -- ports ---------------------------------------------------------------------------------------------------

#: the ports an OS hands out for port 0 and outgoing connections where it does not say (IANA's, Windows' and
#: macOS's default)
DEFAULT_EPHEMERAL = (49152, 65535)


def ephemeral_ports(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """The range the OS picks local ports from, for outgoing connections and binds to port 0 (UCX's own
    listening sockets among them): a port chosen for a server later must come from outside it, or the
    process that is to listen on it may take it first."""
    if IS_LINUX:
        try:
            with open(path) as f:
                low, high = (int(x) for x in f.read().split())
            if 0 < low <= high <= 65535:
                return low, high
        except (OSError, ValueError):
            pass
    return DEFAULT_EPHEMERAL


# -- shared-memory space -------------------------------------------------------------------------------------

#: where Linux keeps POSIX shared memory: a tmpfs whose size bounds every host link (Docker: 64 MiB by default)
SHM_DIR = "/dev/shm"


def physical_memory() -> int | None:
    """The machine's RAM in bytes (POSIX ``sysconf``); None where unknown. Bounds what a peer's word may make
    us allocate."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return None


def shm_free_bytes(path: str = SHM_DIR) -> int | None:
    """Bytes free for new shared memory where it is a filesystem (Linux's /dev/shm); None where unknown."""
    if not IS_LINUX or not hasattr(os, "statvfs"):
        return None
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return int(st.f_bavail) * int(st.f_frsize)


def shm_full_message(needed: int, free: int | None, what: str) -> str:
    room = f"only {free:,} are free" if free is not None else "there is not that much room"
    return (
        f"cudalink: {what} needs {needed:,} bytes of shared memory ({SHM_DIR}) but {room}; use a smaller link "
        "(fewer slots, smaller frames or capacity), free space there, or, in Docker, give the container more "
        "with --shm-size (e.g. docker run --shm-size=2g)"
    )


def check_shm_space(needed: int, free: int | None, what: str) -> None:
    """Refuse a segment that cannot fit: writing to pages a full tmpfs cannot back is a SIGBUS, not an error."""
    if free is not None and needed > free:
        raise LinkError(shm_full_message(needed, free, what))


def reserve_shm(fd: int, size: int, what: str, free: Callable[[], int | None] | None = None) -> None:
    """Give a new shared-memory segment its pages now, so a full /dev/shm is a :class:`LinkError` here and
    never a SIGBUS at the first write into a sparse segment.

    ``free`` (default :func:`shm_free_bytes`) is checked first: cheap, and it saves allocating most of a
    segment that cannot fit. Then ``posix_fallocate`` reserves the pages where the OS has it. Where it has
    not (macOS; Windows commits a segment when it is made) or the filesystem cannot preallocate, the check
    is what remains.
    """
    avail = shm_free_bytes() if free is None else free()
    check_shm_space(size, avail, what)
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None or fd < 0 or size <= 0:
        return
    try:
        fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise LinkError(shm_full_message(size, avail, what)) from exc
        if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENODEV, errno.ESPIPE):
            raise LinkError(f"cudalink: could not reserve {size:,} bytes of shared memory for {what}: {exc}") from exc


def lock_path(name: str) -> str:
    """The file a link's producer holds locked for its whole life."""
    return os.path.join(runtime_dir(), f"{name}.lock")


def shm_owner(name: str) -> int | None:
    """The uid owning POSIX segment ``name`` (None where it cannot be told)."""
    try:
        return os.stat(f"/dev/shm/{name.lstrip('/')}").st_uid
    except OSError:
        return None


def shm_inode(name: str) -> int | None:
    """The inode of POSIX segment ``name`` where segments are files (Linux's /dev/shm), 0 once it is gone (one
    made anew under that name has another); None where that cannot be told (macOS, Windows)."""
    if not IS_LINUX:
        return None
    try:
        return os.stat(f"{SHM_DIR}/{name.lstrip('/')}").st_ino
    except OSError:
        return 0


def shm_segments(prefix: str) -> list[str]:
    """Names of the POSIX shared-memory segments that start with ``prefix`` (none where they cannot be
    listed: Windows frees a segment with its last handle, so a dead producer leaves none there)."""
    if not os.path.isdir("/dev/shm"):
        return []
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    except OSError:
        return []


def shm_map_readonly(segment: str) -> mmap.mmap | bytes | None:
    """A POSIX shared-memory segment mapped PROT_READ (b"" if empty); None where POSIX shm does not exist."""
    try:
        import _posixshmem  # type: ignore[import-not-found]
    except ImportError:
        return None
    # anyone may put a FIFO in /dev/shm: opened blocking, it hung ``info``/``monitor`` until a writer came
    fd = _posixshmem.shm_open("/" + segment, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0), 0)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "a FIFO or device file")
        size = st.st_size
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) if size else b""
    finally:
        os.close(fd)


# -- sockets ----------------------------------------------------------------------------------------------


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket."""
    if IS_LINUX:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, peer_uid, _gid = struct.unpack("3i", raw)
        return pid, peer_uid
    if IS_MACOS:  # LOCAL_PEERCRED: a struct xucred (u_int version, uid_t uid, ...); CPython names neither
        with contextlib.suppress(OSError):
            raw = sock.getsockopt(_SOL_LOCAL, _LOCAL_PEERCRED, _XUCRED_SIZE)
            version, peer_uid = struct.unpack_from("=II", raw)
            if version == 0:  # XUCRED_VERSION
                return 0, int(peer_uid)
    if hasattr(os, "getuid"):  # other BSDs: no pid, but the uid is what the check needs
        getpeereid = getattr(socket, "getpeereid", None)
        if getpeereid is not None:
            peer_uid, _ = getpeereid(sock)
            return 0, int(peer_uid)
    return 0, uid()  # nothing to ask: the runtime directory's 0700 is the guard left (and the rendezvous key)


#: macOS <sys/un.h> and <sys/ucred.h>: SOL_LOCAL, LOCAL_PEERCRED, and sizeof(struct xucred) (4 + 4 + 2 + 2 pad
#: + 16 * 4 groups)
_SOL_LOCAL = 0
_LOCAL_PEERCRED = 0x001
_XUCRED_SIZE = 76


def loopback_listener(sock: socket.socket | None = None) -> socket.socket:
    """A TCP listener on 127.0.0.1 with an OS-chosen port.

    On Windows, ``SO_EXCLUSIVEADDRUSE`` stops another process from binding the same port with
    ``SO_REUSEADDR`` and stealing connections (POSIX refuses that across users by default).
    """
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM) if sock is None else sock
    try:
        exclusive = getattr(socket, "SO_EXCLUSIVEADDRUSE", None)
        if exclusive is not None:
            s.setsockopt(socket.SOL_SOCKET, exclusive, 1)
        s.bind(("127.0.0.1", 0))
        s.listen(64)
    except BaseException:
        s.close()
        raise
    return s


def no_delay(sock: socket.socket) -> None:
    """Wake-ups are single bytes: Nagle would hold each one back for an ACK."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def readable_waiter(fd: int) -> Callable[[float | None], bool]:
    """``wait(timeout)``: whether ``fd`` became readable within ``timeout`` seconds (None: no limit). ``poll``
    where the OS has it: ``select`` refuses fds from 1024 on, which a busy process (a DCC, a server) reaches."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(fd, select.POLLIN)

        def wait(timeout: float | None) -> bool:
            return bool(poller.poll(-1 if timeout is None else max(0, math.ceil(timeout * 1000))))

        return wait

    def wait_select(timeout: float | None) -> bool:
        return bool(select.select([fd], [], [], None if timeout is None else max(0.0, timeout))[0])

    return wait_select


def wait_readable(fd: int, timeout: float | None) -> bool:
    """One wait of :func:`readable_waiter`."""
    return readable_waiter(fd)(timeout)


async def wait_readable_async(fd: int, timeout: float | None) -> None:
    """Return once ``fd`` is readable, or after ``timeout`` (None: no limit), on the running loop; consumes
    nothing. NotImplementedError on a loop that cannot watch an fd (Windows' proactor loop).

    On the path of every frame an asyncio consumer waits for (a ucx server's included), so it does little: a
    timer of its own rather than ``asyncio.wait_for`` (more objects and callbacks per wait), and the reader goes
    as it fires (level-triggered, it fired again each loop turn until the waiter ran). The local and the ucx
    consumers' waits share it (each had its own copy of the old one)."""
    import asyncio

    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        loop.remove_reader(fd)
        if not fut.done():
            fut.set_result(None)

    def timed_out() -> None:
        if not fut.done():
            fut.set_result(None)

    loop.add_reader(fd, readable)
    timer = None if timeout is None else loop.call_later(max(0.0, timeout), timed_out)
    try:
        await fut
    finally:
        if timer is not None:
            timer.cancel()
        loop.remove_reader(fd)  # gone already where it fired (a dict lookup then)


def hangup_poller(sock: socket.socket, pid: int = 0) -> Callable[[], bool]:
    """A check, without reading anything, of whether the peer of ``sock`` has closed its end (it exited or was
    killed), even with unread bytes still queued: ``poll`` with POLLRDHUP where the OS has it (Linux). Elsewhere
    (Windows, macOS) a peek, which sees the hang-up only once the queued bytes are read: while bytes are queued
    (the wake-up a Receiver leaves on purpose) the peer's process ``pid``, where known, is asked about instead."""
    rdhup = getattr(select, "POLLRDHUP", 0)
    if rdhup and hasattr(select, "poll"):
        poller = select.poll()
        poller.register(sock, rdhup)

        def closed() -> bool:
            try:
                return bool(poller.poll(0))
            except OSError:
                return True

        return closed

    def peek_closed() -> bool:
        try:
            queued = sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        if not queued:
            return True
        if pid <= 0:
            return False
        # a hang-up behind queued bytes cannot be seen: ask the OS about the process, at most every
        # _PID_LOOK_S (this runs at each GPU frame's stream wait; a Windows process query costs microseconds)
        now = time.monotonic()
        if now - looked[0] >= _PID_LOOK_S:
            looked[0], looked[1] = now, float(not pid_alive(pid))
        return bool(looked[1])

    looked = [-_PID_LOOK_S, 0.0]  # when the pid was last asked about, and whether it was dead then
    return peek_closed


#: how often a hang-up check where the OS cannot see one (see ``hangup_poller``) asks about the peer's pid
_PID_LOOK_S = 0.05


# -- processes --------------------------------------------------------------------------------------------


def host_id(boot_id_path: str = "/proc/sys/kernel/random/boot_id") -> bytes:
    """16 bytes naming this host's running kernel: equal in two processes only when they share a machine
    (a ucx:// server sends GPU memory as is to a consumer on its own host, and host bytes across hosts).

    Linux: the boot id, which network namespaces and containers on one kernel share (as they share its
    GPUs). Elsewhere, or where it cannot be read: a hash of the host name.
    """
    import uuid

    try:
        with open(boot_id_path) as f:
            return uuid.UUID(f.read().strip()).bytes
    except (OSError, ValueError):
        return hashlib.sha256(socket.gethostname().encode()).digest()[:16]


_STILL_ACTIVE = 259
_PROCESS_QUERY_LIMITED_INFORMATION = 0x1000
_ERROR_ACCESS_DENIED = 5


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    if IS_WINDOWS:  # os.kill(pid, 0) would *terminate* the process there
        import ctypes

        return _pid_alive_windows(pid, _kernel32(), ctypes.get_last_error)  # type: ignore[attr-defined]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@functools.cache
def _kernel32() -> ctypes.CDLL:
    """kernel32 with the prototypes spelled out: a HANDLE is pointer-sized, ctypes' default int is not."""
    import ctypes
    from ctypes import wintypes

    k: ctypes.CDLL = ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]
    k.OpenProcess.argtypes = (wintypes.DWORD, wintypes.BOOL, wintypes.DWORD)
    k.OpenProcess.restype = wintypes.HANDLE
    k.GetExitCodeProcess.argtypes = (wintypes.HANDLE, ctypes.POINTER(wintypes.DWORD))
    k.GetExitCodeProcess.restype = wintypes.BOOL
    k.CloseHandle.argtypes = (wintypes.HANDLE,)
    k.CloseHandle.restype = wintypes.BOOL
    return k


def _pid_alive_windows(pid: int, kernel32: ctypes.CDLL, last_error: Callable[[], int]) -> bool:
    import ctypes

    handle = kernel32.OpenProcess(_PROCESS_QUERY_LIMITED_INFORMATION, False, pid)
    if not handle:
        return bool(last_error() == _ERROR_ACCESS_DENIED)  # exists, but not ours to query
    try:
        code = ctypes.c_ulong(0)  # a DWORD
        if not kernel32.GetExitCodeProcess(handle, ctypes.byref(code)):
            return True
        return code.value == _STILL_ACTIVE
    finally:
        kernel32.CloseHandle(handle)


def yield_cpu() -> None:
    """Let other threads (and processes) run, without sleeping.

    ``time.sleep(0)`` is a ``nanosleep`` on Linux, and the kernel's timer slack (50 us for normal
    tasks) turns it into a real sleep: 76 us measured on a small VM, far longer than a spinning
    receiver may look away. ``sched_yield`` releases the GIL and returns at once; Windows has no
    ``os.sched_yield``, and there ``Sleep(0)`` is the same thing.
    """
    _yield()


_yield = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))


def yield_core() -> None:
    """Let whatever else is runnable on this core run now, keeping the GIL where the compiled core is built.

    For a producer whose woken consumer the OS queued behind it on its own core: ``os.sched_yield`` would
    also let the GIL go, and a busy thread of this process that took it would keep it up to the switch
    interval (5 ms) before ``send()`` could return. Elsewhere (no compiled core, Windows) ``yield_cpu``.
    """
    global _native_yield
    native = _native_yield
    if native is _UNSET:  # looked up on first use: the compiled ring imports this module as it loads
        from . import _native

        native = _native_yield = getattr(_native.ring, "yield_core", None) if _native.ring is not None else None
    if native is None or not native():
        _yield()


_UNSET: Callable[[], bool] = lambda: False  # noqa: E731
_native_yield: Callable[[], bool] | None = _UNSET


# -- named events (Windows): cuda-link's optional doorbell -------------------------------------------------

_SYNCHRONIZE = 0x00100000
_EVENT_MODIFY_STATE = 0x0002
_WAIT_OBJECT_0 = 0


def _kernel32_events() -> ctypes.CDLL:
    """kernel32's named-event calls, with pointer-sized HANDLE prototypes."""
    import ctypes
    from ctypes import wintypes

    k: ctypes.CDLL = ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]
    k.OpenEventW.argtypes = (wintypes.DWORD, wintypes.BOOL, wintypes.LPCWSTR)
    k.OpenEventW.restype = wintypes.HANDLE
    k.CreateEventW.argtypes = (wintypes.LPVOID, wintypes.BOOL, wintypes.BOOL, wintypes.LPCWSTR)
    k.CreateEventW.restype = wintypes.HANDLE
    k.SetEvent.argtypes = (wintypes.HANDLE,)
    k.SetEvent.restype = wintypes.BOOL
    k.WaitForSingleObject.argtypes = (wintypes.HANDLE, wintypes.DWORD)
    k.WaitForSingleObject.restype = wintypes.DWORD
    k.CloseHandle.argtypes = (wintypes.HANDLE,)
    k.CloseHandle.restype = wintypes.BOOL
    return k


class Doorbell:
    """A named auto-reset event (Windows): a producer rings it after each publish, a waiting reader sleeps on it.

    cuda-link's producers may ring ``Local\\cudalink_db_<segment name>``; :meth:`open` returns None where it does
    not exist (or off Windows), and the reader then polls. ``kernel32`` is injectable for tests."""

    def __init__(self, handle: int, kernel32: object) -> None:
        self.handle = handle
        self._k = kernel32

    @staticmethod
    def name_for(segment: str) -> str:
        return "Local\\cudalink_db_" + segment

    @classmethod
    def open(cls, segment: str, kernel32: object = None) -> Doorbell | None:
        """The producer's doorbell for ``segment`` if it made one; None otherwise (and on every other OS)."""
        if kernel32 is None:
            if not IS_WINDOWS:
                return None
            kernel32 = _kernel32_events()
        h = kernel32.OpenEventW(_SYNCHRONIZE | _EVENT_MODIFY_STATE, False, cls.name_for(segment))  # type: ignore[attr-defined]
        return cls(int(h), kernel32) if h else None

    @classmethod
    def create(cls, segment: str, kernel32: object = None) -> Doorbell | None:
        """A producer's doorbell for ``segment`` (auto-reset, not signalled); None off Windows or on failure."""
        if kernel32 is None:
            if not IS_WINDOWS:
                return None
            kernel32 = _kernel32_events()
        h = kernel32.CreateEventW(None, False, False, cls.name_for(segment))  # type: ignore[attr-defined]
        return cls(int(h), kernel32) if h else None

    def ring(self) -> None:
        self._k.SetEvent(self.handle)  # type: ignore[attr-defined]

    def wait(self, timeout: float) -> bool:
        """Sleep until rung or ``timeout`` seconds (at least 1 ms: the kernel's granularity); True if rung."""
        ms = max(1, min(int(timeout * 1000), 0x7FFFFFFF))
        return bool(self._k.WaitForSingleObject(self.handle, ms) == _WAIT_OBJECT_0)  # type: ignore[attr-defined]

    def close(self) -> None:
        if self.handle:
            self._k.CloseHandle(self.handle)  # type: ignore[attr-defined]
            self.handle = 0
