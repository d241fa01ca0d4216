# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The ring's per-frame operations, compiled: the same protocol as ``cudalink._ring``, cell for cell.

Each side of the stamp/lease handshake stores its cell, fences, then loads the other's: here with
C11-style atomics (``atomics.h``) instead of a lock round trip. Offsets come from ``wire.Layout`` at
construction, so ``transport/wire.py`` still owns the layout; this file owns only the loops.

The header buffer is re-acquired per call (``PyObject_GetBuffer``, no allocation), never kept: a
segment the transport has closed raises ``ValueError`` here exactly as ``struct.pack_into`` would,
instead of touching unmapped memory.
"""

cimport cython
from cpython.exc cimport PyErr_CheckSignals
from cpython.object cimport PyObject
from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport uint8_t, uint32_t, uint64_t, uintptr_t
from libc.string cimport memcmp, memcpy

import time

from cudalink import _trace
from cudalink.errors import ProtocolError
from cudalink.transport import wire

#: this module's interface version, which ``cudalink._native`` checks (2: ``claim(seq, skip)``)
ABI = 3

cdef extern from "atomics.h":
    uint64_t cl_load64(const void *p) nogil
    uint32_t cl_load32(const void *p) nogil
    void cl_store64(void *p, uint64_t v) nogil
    void cl_store32(void *p, uint32_t v) nogil
    void cl_fence() nogil
    int CL_LITTLE_ENDIAN

cdef extern from *:
    """
    #if defined(_WIN32)
    static int cl_poll_in(int fd, int ms) { (void)fd; (void)ms; return -1; }
    static int cl_yield(void) { return 0; }
    #define CL_EINTR 4
    #else
    #include <errno.h>
    #include <poll.h>
    #include <sched.h>
    static int cl_yield(void) { return sched_yield() == 0; }
    /* Wait for one fd to be readable (or to hang up): >0 ready, 0 timed out, -errno on failure. */
    static int cl_poll_in(int fd, int ms) {
        struct pollfd p;
        int r;
        p.fd = fd;
        p.events = POLLIN;
        p.revents = 0;
        r = poll(&p, 1, ms);
        return r < 0 ? -errno : r;
    }
    #define CL_EINTR EINTR
    #endif
    """
    int cl_poll_in(int fd, int ms) nogil
    int cl_yield()
    int CL_EINTR


def yield_core():
    """``sched_yield()`` with the GIL held: True where it ran (not on Windows). ``os.sched_yield`` lets the
    GIL go, and a busy thread of this process that takes it keeps it up to the switch interval (5 ms)."""
    return cl_yield() != 0

cdef extern from *:
    """
    #include <string.h>
    #include "structmember.h"
    #ifndef Py_T_OBJECT_EX
    #define Py_T_OBJECT_EX T_OBJECT_EX
    #endif
    /* The offset of a plain Python class's __slots__ member ``name`` (its tp_members), or -1. */
    static Py_ssize_t cl_slot_offset(PyObject *type, const char *name) {
        PyMemberDef *m = ((PyTypeObject *)type)->tp_members;
        for (; m != NULL && m->name != NULL; m++)
            if (m->type == Py_T_OBJECT_EX && !(m->flags & READONLY) && strcmp(m->name, name) == 0)
                return m->offset;
        return -1;
    }
    /* What the slot's setter does to a slot still empty: a new reference stored at its offset. */
    static void cl_slot_init(PyObject *o, Py_ssize_t off, PyObject *v) {
        Py_INCREF(v);
        *(PyObject **)((char *)o + off) = v;
    }
    static PyObject *cl_alloc(PyObject *type) {
        return ((PyTypeObject *)type)->tp_alloc((PyTypeObject *)type, 0);
    }
    """
    Py_ssize_t cl_slot_offset(object type, const char *name)
    void cl_slot_init(object o, Py_ssize_t off, PyObject *v)
    object cl_alloc(object type)

if not CL_LITTLE_ENDIAN:  # the wire is little-endian; a big-endian build uses the Python ring
    raise ImportError("cudalink._native.ring: big-endian platform")

cdef Py_ssize_t SPEC_AT = 16, SPEC_LEN = 144, META_LEN_AT = 28, META_AT = 160
assert wire._SPEC_BYTES == slice(SPEC_AT, SPEC_AT + SPEC_LEN) and wire._META_LEN + SPEC_AT == META_LEN_AT
assert wire.RECORD.size == META_AT + wire.META_MAX and wire.U64X2.size == 16
cdef Py_ssize_t META_MAX = wire.META_MAX
cdef Py_ssize_t OFF_PUBLISHED = wire.OFF_PUBLISHED, OFF_FLAGS = wire.OFF_FLAGS, RECORD_SIZE = wire.RECORD_SIZE
cdef Py_ssize_t OFF_WAITING = wire.CONSUMER_OFF_WAITING, OFF_RECEIVED = wire.CONSUMER_OFF_RECEIVED
cdef Py_ssize_t OFF_LAST_RECV = wire.CONSUMER_OFF_LAST_RECV
cdef uint32_t WAIT_ON = wire.WAIT_ON, WOKEN_AHEAD = wire.WOKEN_AHEAD, WAIT_AHEAD = wire.WAIT_AHEAD
cdef uint32_t WAIT_MAX = wire.WAIT_AHEAD
cdef object _time_ns = time.time_ns
cdef Py_ssize_t TAKE_RETRIES = wire.TAKE_RETRIES
cdef object _stamp_lie = wire.stamp_lie
cdef object _unpack_record = wire.unpack_record
cdef object _spec_bytes = wire.spec_bytes
cdef dict _spec_cache = wire._spec_cache
cdef object _SlotRecord = wire.SlotRecord
cdef object _tuple_new = tuple.__new__  # a SlotRecord without running the namedtuple's Python ``__new__``


cdef object _read_record(const uint8_t *base, Py_ssize_t off, object buf, Py_ssize_t capacity):
    """``wire.unpack_record``, with its cached-spec fast path in C (the same cache, the same result)."""
    cdef bytes raw = PyBytes_FromStringAndSize(<const char *>(base + off + SPEC_AT), SPEC_LEN)
    spec = _spec_cache.get(raw)
    if spec is None or spec.nbytes > capacity:
        return _unpack_record(buf, off, capacity)
    cdef uint64_t seq, ts
    memcpy(&seq, base + off, 8)
    memcpy(&ts, base + off + 8, 8)
    cdef Py_ssize_t mlen = base[off + META_LEN_AT]
    if mlen > META_MAX:  # changed since the spec bytes were read: only a scribbler does that
        raise ProtocolError(f"cudalink: slot record meta length {mlen} > {META_MAX}")
    meta = PyBytes_FromStringAndSize(<const char *>(base + off + META_AT), mlen) if mlen else b""
    return _tuple_new(_SlotRecord, (seq, ts, spec, meta))


cdef inline uint8_t *_map(object buf, Py_buffer *view, Py_ssize_t need) except NULL:
    PyObject_GetBuffer(buf, view, PyBUF_WRITABLE)
    if view.len < need:
        PyBuffer_Release(view)
        raise ValueError("cudalink: the header segment is smaller than its layout")
    return <uint8_t *>view.buf


cdef inline bint _column_set(const uint8_t *col, Py_ssize_t n) noexcept nogil:
    cdef Py_ssize_t c
    for c in range(n):
        if cl_load64(col + 8 * c):
            return True
    return False


cdef struct Offsets:
    Py_ssize_t nslots, ncons, size, stamps, records, leases, fences, consumers, consumer_size


cdef int _offsets(Offsets *o, object buf, object layout) except -1:
    """Take the layout's offsets once, and check the buffer holds them (8-byte aligned, writable)."""
    cdef Py_buffer v
    cdef uint8_t *base
    o.nslots = layout.nslots
    o.ncons = layout.nconsumers
    o.size = layout.size
    o.stamps = layout.stamps
    o.records = layout.records
    o.leases = layout.leases
    o.fences = layout.fences
    o.consumers = layout.consumers
    o.consumer_size = layout.consumer_size
    base = _map(buf, &v, o.size)
    PyBuffer_Release(&v)
    if <uintptr_t>base % 8:
        raise ValueError("cudalink: the header segment is not 8-byte aligned")
    return 0


cdef class ProducerCore:
    cdef readonly object buf
    cdef readonly object layout
    cdef Offsets o
    cdef uint64_t published, dropped
    cdef object _spec, _spec_raw

    def __init__(self, buf, layout):
        cdef Py_buffer v
        cdef uint8_t *base
        _offsets(&self.o, buf, layout)
        self.buf = buf
        self.layout = layout
        base = _map(buf, &v, self.o.size)
        memcpy(&self.published, base + OFF_PUBLISHED, 8)
        memcpy(&self.dropped, base + OFF_PUBLISHED + 8, 8)
        PyBuffer_Release(&v)

    cdef inline bint _leased(self, const uint8_t *base, Py_ssize_t slot) noexcept nogil:
        return _column_set(base + self.o.leases + 8 * slot * self.o.ncons, self.o.ncons)

    def claim(self, uint64_t seq, uint64_t skip=0):
        """Take the oldest slot no consumer holds and not in ``skip`` (bit i: slot i, those an open ``reserve()``
        writes), marking it 'being written' for frame ``seq``."""
        cdef Py_buffer v
        cdef uint8_t *base = _map(self.buf, &v, self.o.size)
        cdef uint64_t tried = skip, oldest = 0, st
        cdef Py_ssize_t i, slot
        cdef uint8_t *cell
        try:
            while True:
                slot = -1
                for i in range(self.o.nslots):  # the oldest unleased slot
                    st = cl_load64(base + self.o.stamps + 8 * i)
                    if (slot < 0 or st < oldest) and not (tried >> i) & 1 and not self._leased(base, i):
                        slot, oldest = i, st
                if slot < 0:
                    return None
                cell = base + self.o.stamps + 8 * slot
                cl_store64(cell, 2 * seq + 1)
                cl_fence()  # our odd stamp is visible before we re-read the leases
                if not self._leased(base, slot):
                    return slot
                cl_store64(cell, oldest)  # a consumer leased it between our check and our claim
                tried |= (<uint64_t>1) << slot
        finally:
            PyBuffer_Release(&v)

    def abort(self, Py_ssize_t slot):
        cdef Py_buffer v
        cdef uint8_t *base = _map(self.buf, &v, self.o.size)
        self._check(slot)
        cl_store64(base + self.o.stamps + 8 * slot, 0)
        PyBuffer_Release(&v)

    cdef inline int _check(self, Py_ssize_t slot) except -1:
        if not 0 <= slot < self.o.nslots:
            raise IndexError(f"cudalink: slot {slot} outside 0..{self.o.nslots - 1}")
        return 0

    def publish(self, Py_ssize_t slot, uint64_t seq, timestamp_ns, spec, bytes meta):
        """Write the record, stamp the slot even, count it, then fence: the caller next reads who sleeps."""
        cdef Py_buffer v
        cdef Py_ssize_t mlen = PyBytes_GET_SIZE(meta)
        cdef uint64_t ts
        cdef uint8_t *rec
        self._check(slot)
        if mlen > META_MAX:
            raise ProtocolError(f"cudalink: meta is {mlen} bytes; at most {META_MAX} travel with a frame")
        if spec is not self._spec:
            self._spec_raw = _spec_bytes(spec)
            self._spec = spec
        cdef uint8_t *base = _map(self.buf, &v, self.o.size)
        rec = base + self.o.records + RECORD_SIZE * slot
        memcpy(rec + SPEC_AT, PyBytes_AS_STRING(self._spec_raw), SPEC_LEN)
        if mlen:
            rec[META_LEN_AT] = <uint8_t>mlen
            memcpy(rec + META_AT, PyBytes_AS_STRING(meta), mlen)
        ts = _time_ns() if timestamp_ns is None else timestamp_ns
        memcpy(rec, &seq, 8)
        memcpy(rec + 8, &ts, 8)
        cl_store64(base + self.o.stamps + 8 * slot, 2 * seq)
        self.published += 1
        memcpy(base + OFF_PUBLISHED, &self.published, 8)
        memcpy(base + OFF_PUBLISHED + 8, &self.dropped, 8)
        memcpy(base + OFF_PUBLISHED + 16, &ts, 8)
        cl_fence()
        PyBuffer_Release(&v)
        return ts

    def count_drop(self):
        cdef Py_buffer v
        cdef uint8_t *base = _map(self.buf, &v, self.o.size)
        self.dropped += 1
        memcpy(base + OFF_PUBLISHED + 8, &self.dropped, 8)
        PyBuffer_Release(&v)

    def take_fences(self, Py_ssize_t slot):
        """Consumers that left a GPU release fence on ``slot``; the flags are cleared."""
        cdef Py_buffer v
        cdef Py_ssize_t c
        cdef uint8_t *col
        self._check(slot)
        cdef uint8_t *base = _map(self.buf, &v, self.o.size)
        col = base + self.o.fences + 4 * slot * self.o.ncons
        out = []
        for c in range(self.o.ncons):
            if cl_load32(col + 4 * c):
                cl_store32(col + 4 * c, 0)
                out.append(c)
        PyBuffer_Release(&v)
        return out

    cdef int _check_among(self, uint64_t among) except -1:
        if self.o.ncons < 64 and among >> self.o.ncons:
            raise IndexError(
                f"cudalink: consumer mask {among:#x} names consumers outside 0..{self.o.ncons - 1}"
            )
        return 0

    cdef uint64_t _waiting(self, uint64_t among, uint32_t mask, uint32_t value) except? 0:
        """Of the consumers in ``among``, those whose waiting word has ``word & mask == value``."""
        cdef Py_buffer v
        cdef uint64_t out = 0
        cdef Py_ssize_t i
        self._check_among(among)
        cdef uint8_t *base = _map(self.buf, &v, self.o.size)
        cdef uint8_t *words = base + self.o.consumers + OFF_WAITING
        for i in range(self.o.ncons):
            if (among >> i) & 1 and cl_load32(words + self.o.consumer_size * i) & mask == value:
                out |= (<uint64_t>1) << i
        PyBuffer_Release(&v)
        return out

    def sleepers(self, uint64_t among):
        """Of the consumers in ``among`` (bit i: consumer i), those asleep with no wake-up on its way."""
        return self._waiting(among, WAIT_ON, WAIT_ON)

    def wake_ahead(self, uint64_t among):
        """Of the consumers in ``among``, those that asked to be woken ahead; each is marked ``WOKEN_AHEAD``."""
        cdef Py_buffer v
        cdef uint64_t out = 0
        cdef Py_ssize_t i
        cdef uint8_t *word
        self._check_among(among)
        cdef uint8_t *base = _map(self.buf, &v, self.o.size)
        for i in range(self.o.ncons):
            if (among >> i) & 1:
                word = base + self.o.consumers + self.o.consumer_size * i + OFF_WAITING
                if cl_load32(word) == WAIT_AHEAD:
                    cl_store32(word, WOKEN_AHEAD)
                    out |= (<uint64_t>1) << i
        PyBuffer_Release(&v)
        return out

    def woken_ahead(self, uint64_t among):
        """Of the consumers in ``among``, those still marked ``WOKEN_AHEAD``: woken, not yet running."""
        return self._waiting(among, 0xFFFFFFFF, WOKEN_AHEAD)


cdef class ConsumerCore:
    cdef readonly object buf
    cdef readonly object layout
    cdef Offsets o
    cdef readonly Py_ssize_t index
    cdef readonly object capacity
    cdef Py_ssize_t entry
    cdef list _raw, _spec  # per slot: the spec bytes last read there, and their validated FrameSpec

    def __init__(self, buf, layout, Py_ssize_t index, capacity):
        _offsets(&self.o, buf, layout)
        self.buf = buf
        self.layout = layout
        if not 0 <= index < self.o.ncons:
            raise IndexError(f"cudalink: consumer index {index} outside 0..{self.o.ncons - 1}")
        self.index = index
        self.capacity = capacity
        self.entry = self.o.consumers + self.o.consumer_size * index
        self._raw = [None] * self.o.nslots
        self._spec = [None] * self.o.nslots

    cdef object _record(self, const uint8_t *base, Py_ssize_t slot):
        """The slot's record. A slot's spec bytes are compared with the last ones read there (no bytes object,
        no hash): a stream repeats one spec, and anything new goes through ``_read_record``'s validation."""
        cdef Py_ssize_t off = self.o.records + RECORD_SIZE * slot
        cdef uint64_t seq, ts
        cdef Py_ssize_t mlen
        raw = self._raw[slot]
        if raw is None or memcmp(PyBytes_AS_STRING(raw), base + off + SPEC_AT, SPEC_LEN) != 0:
            rec = _read_record(base, off, self.buf, self.capacity)
            self._raw[slot] = PyBytes_FromStringAndSize(<const char *>(base + off + SPEC_AT), SPEC_LEN)
            self._spec[slot] = rec[2]
            return rec
        memcpy(&seq, base + off, 8)
        memcpy(&ts, base + off + 8, 8)
        mlen = base[off + META_LEN_AT]
        if mlen > META_MAX:  # changed since the memcmp above: only a scribbler does that
            raise ProtocolError(f"cudalink: slot record meta length {mlen} > {META_MAX}")
        meta = PyBytes_FromStringAndSize(<const char *>(base + off + META_AT), mlen) if mlen else b""
        return (seq, ts, self._spec[slot], meta)  # a plain tuple: ``take`` names it for Python callers

    cdef bint _older(self, const uint8_t *base, uint64_t lo, uint64_t best):
        """Oldest first: a frame older than ``best`` in a slot our scan passed too early (see
        ``_ring.PyConsumerRing._older``)."""
        cdef Py_ssize_t i
        cdef uint64_t st
        for i in range(self.o.nslots):
            st = cl_load64(base + self.o.stamps + 8 * i)
            if st > lo and st < best and not st & 1:
                return True
        return False

    def take(self, uint64_t after, bint newest):
        """Lease the newest frame after ``after`` (the oldest when ``newest`` is False) and read its record."""
        got = self._take(after, newest)
        if got is not None and type((<tuple>got)[1]) is tuple:
            got = ((<tuple>got)[0], _tuple_new(_SlotRecord, (<tuple>got)[1]))
        return got

    cdef object _take(self, uint64_t after, bint newest):
        cdef Py_buffer v
        cdef uint64_t lo = 2 * after, best, st, seq
        cdef Py_ssize_t i, slot
        cdef uint8_t *lease
        cdef Py_ssize_t tries
        cdef uint8_t *base = _map(self.buf, &v, self.o.size)
        try:
            for tries in range(TAKE_RETRIES):  # bounded: see _ring.PyConsumerRing.take
                slot = -1
                best = 0
                for i in range(self.o.nslots):
                    st = cl_load64(base + self.o.stamps + 8 * i)
                    if st > lo and not st & 1 and (best == 0 or (st > best if newest else st < best)):
                        slot, best = i, st
                if best == 0:
                    return None
                seq = best >> 1
                lease = base + self.o.leases + 8 * (slot * self.o.ncons + self.index)
                cl_store64(lease, seq)
                cl_fence()  # our lease is visible before we re-read the stamp
                if cl_load64(base + self.o.stamps + 8 * slot) == best:
                    try:
                        rec = self._record(base, slot)
                    except BaseException:
                        cl_store64(lease, 0)
                        raise
                    if rec[0] != seq:
                        cl_store64(lease, 0)  # an even stamp that stays put over another frame's record: a lie
                        raise ProtocolError(_stamp_lie(slot, seq, rec[0]))
                    if newest or not self._older(base, lo, best):
                        return slot, rec
                # the producer reclaimed it, or published older frames our scan missed: look again
                cl_store64(lease, 0)
            return None
        finally:
            PyBuffer_Release(&v)

    def forget(self):
        """A forked child's copy (the twin of ``PyConsumerRing.forget``): from now on it reads and writes a
        private blank header, never the shared one whose leases and counts are the parent's."""
        self.buf = bytearray(self.o.size)

    def release(self, Py_ssize_t slot, uint64_t seq, bint fenced):
        """Clear our lease of ``slot`` if it still holds ``seq``; returns the header flags, read after it."""
        return self._release(slot, seq, fenced)

    cdef long long _release(self, Py_ssize_t slot, uint64_t seq, bint fenced) except -1:
        cdef Py_buffer v
        cdef uint8_t *lease
        cdef uint32_t f
        if not 0 <= slot < self.o.nslots:
            raise IndexError(f"cudalink: slot {slot} outside 0..{self.o.nslots - 1}")
        cdef uint8_t *base = _map(self.buf, &v, self.o.size)
        lease = base + self.o.leases + 8 * (slot * self.o.ncons + self.index)
        if cl_load64(lease) == seq:
            if fenced:
                cl_store32(base + self.o.fences + 4 * (slot * self.o.ncons + self.index), 1)
            cl_store64(lease, 0)
            cl_fence()  # the lease is clear before we read FLAG_PRODUCER_WAITING
        f = cl_load32(base + OFF_FLAGS)
        PyBuffer_Release(&v)
        return f

    def flags(self):
        cdef Py_buffer v
        cdef uint8_t *base = _map(self.buf, &v, self.o.size)
        cdef uint32_t f = cl_load32(base + OFF_FLAGS)
        PyBuffer_Release(&v)
        return f

    def set_waiting(self, long state):
        """Announce (``wire.WAIT_ON``/``WAIT_AHEAD``) or withdraw (0) that we sleep; re-check the stamps after."""
        self._set_waiting(state)

    cdef int _set_waiting(self, long state) except -1:
        cdef Py_buffer v
        if not 0 <= state <= WAIT_MAX:
            raise ValueError(f"cudalink: waiting state {state} is not one of 0..{WAIT_MAX}")
        cdef uint8_t *base = _map(self.buf, &v, self.o.size)
        cl_store32(base + self.entry + OFF_WAITING, <uint32_t>state)
        if state:
            cl_fence()
        PyBuffer_Release(&v)
        return 0

    def count(self, uint64_t received, uint64_t skipped):
        cdef Py_buffer v
        cdef uint64_t now = _time_ns()
        cdef uint8_t *base = _map(self.buf, &v, self.o.size)
        memcpy(base + self.entry + OFF_RECEIVED, &received, 8)
        memcpy(base + self.entry + OFF_RECEIVED + 8, &skipped, 8)
        memcpy(base + self.entry + OFF_LAST_RECV, &now, 8)
        PyBuffer_Release(&v)


# ==================================================== a received frame: the twin of link.Receiver._try_take

cdef object _received = None  # Frame._received, looked up at first use (cudalink.frames imports this package)
cdef long long PRODUCER_WAITING = wire.FLAG_PRODUCER_WAITING
cdef object _LEASED = _trace.LEASED, _FRAME_BUILT = _trace.FRAME_BUILT, _WOKEN = _trace.WOKEN


@cython.final
@cython.no_gc_clear  # its death is the frame's release: the cycle collector must never clear it first
cdef class Lease:
    """A received frame's hold (the twin of ``transport.ring_source._Lease``): when the frame and its exports die, the
    lease on its slot ends.

    A frame never exported to a stream (every host frame) releases here, in C, straight on the compiled
    ring; one with GPU reads to fence goes through ``RingAttachment.release``, which records the fence.
    """

    cdef public object owner
    cdef public object ptr
    cdef public list streams
    cdef object att
    cdef ConsumerCore core  # att.ring where it is the compiled ring, else None
    cdef readonly Py_ssize_t slot
    cdef readonly uint64_t seq

    def end(self):
        self._end()

    cdef int _end(self) except -1:
        att = self.att
        if att is None:
            return 0
        self.att = None
        if self.streams or self.core is None:
            att.release(self.slot, self.seq, self.streams)
            return 0
        if self.core._release(self.slot, self.seq, False) & PRODUCER_WAITING:
            try:
                att.client.hint()
            except Exception:
                pass
        live = att.live
        live.discard(self.seq)
        if att.detached and not live:  # detach() saw a frame still live: the last one unmaps
            att._unmap()
        return 0

    def __dealloc__(self):
        try:
            self._end()
        except Exception:  # a finalizer must never raise
            pass


cdef Lease _lease(object att, object core, Py_ssize_t slot, uint64_t seq, object owner, object ptr):
    cdef Lease h = Lease.__new__(Lease)
    h.owner = owner
    h.ptr = ptr
    h.streams = []
    h.att = att
    h.core = core
    h.slot = slot
    h.seq = seq
    return h


# Frame's __slots__ offsets, in _FRAME_SLOTS' order; found at first use (see _frame_type)
_FRAME_SLOTS = (
    "_spec", "_is_cuda", "_device_id", "_seq", "_timestamp_ns", "_meta", "_writable", "_sync", "_hold",
    "_host", "_released", "_cai_exported", "_view", "_export", "generation",
)
DEF NSLOTS = 15
cdef Py_ssize_t _F[NSLOTS]
cdef object _Frame = None  # the class, where every slot was found; else only _received is used


cdef int _frame_type() except -1:
    """Look up ``Frame._received`` and, where ``Frame`` is the plain ``__slots__`` class it should be, the
    offset of each slot ``_received`` sets: ``_frame`` then stores them in C, with no bytecode run."""
    global _received, _Frame
    from cudalink.frames.frame import Frame

    cdef list offs = [cl_slot_offset(Frame, n.encode()) for n in _FRAME_SLOTS]
    plain = type(Frame) is type and Frame.__bases__ == (object,) and Frame.__dictoffset__ == 0
    same = set(Frame.__slots__) - {"__weakref__"} == set(_FRAME_SLOTS)
    if plain and same and len(offs) == NSLOTS and min(offs) > 0:
        for i in range(NSLOTS):
            _F[i] = offs[i]
        _Frame = Frame
    _received = Frame._received
    return 0


cdef object _frame(spec, hold, device, seq, ts, meta, sync, generation, host, export):
    """``Frame._received`` in C: the same slots set to the same values, without running its bytecode.

    Woken on a cold core, that bytecode cost ~6 us on the 2-vCPU VM, most of the frame build."""
    if _Frame is None:
        return _received(spec, hold, device, seq, ts, meta, sync, generation, host, export)
    cdef object no = False  # an object: a bare False here would be C's 0
    cuda = device >= 0
    cdef PyObject *v[NSLOTS]
    v[:] = [<PyObject *>spec, <PyObject *>cuda, <PyObject *>device, <PyObject *>seq, <PyObject *>ts,
            <PyObject *>meta, <PyObject *>no, <PyObject *>sync, <PyObject *>hold, <PyObject *>host,
            <PyObject *>no, <PyObject *>no, <PyObject *>None, <PyObject *>export, <PyObject *>generation]
    f = cl_alloc(_Frame)
    for i in range(NSLOTS):
        cl_slot_init(f, _F[i], v[i])
    return f


def build_frame(spec, hold, device, seq, ts, meta, sync, generation, host=None, export=None):
    """``_frame`` for tests: it must give what ``Frame._received`` gives."""
    if _received is None:
        _frame_type()
    return _frame(spec, hold, device, seq, ts, meta, sync, generation, host, export)


def frame_builder():
    """``"c"`` where received frames are built in C, ``"python"`` where ``Frame._received`` runs."""
    if _received is None:
        _frame_type()
    return "c" if _Frame is not None else "python"


def receive(rx, att):
    """``Receiver._try_take`` compiled: lease the next frame and build it, or None. Same steps, same order."""
    return _receive(rx, att)


cdef object _receive(rx, att):
    ring = att.ring
    core = ring if type(ring) is ConsumerCore else None
    last = rx._last
    got = (<ConsumerCore>core)._take(last, rx.latest) if core is not None else ring.take(last, rx.latest)
    if got is None:
        return None
    slot = <Py_ssize_t>(<tuple>got)[0]
    cdef tuple rec = <tuple>(<tuple>got)[1]
    seq = rec[0]
    if _trace.ON:
        _trace.mark(_LEASED)
    floor = rx._floor
    if last:  # as source.account: the floor stands only until a first frame is taken
        floor = last
    if seq > floor + 1:
        rx.skipped += seq - floor - 1
    rx._last = seq
    rx.received += 1
    att.live.add(seq)
    spec = rec[2]
    cdef list per_slot = att.parts
    parts = per_slot[slot]
    if parts is None or (<tuple>parts)[0] is not spec:  # the ring caches specs: identity is the common case
        try:
            parts = per_slot[slot] = att.view.slot(slot, att.handles[slot], spec)
        except BaseException:
            _lease(att, core, slot, seq, None, 0)._end()
            raise
    cdef tuple p = <tuple>parts
    if _received is None:
        _frame_type()
    frame = _frame(
        spec, _lease(att, core, slot, seq, p[2], p[1]), att.device_id, seq, rec[1], rec[3], p[3], att.generation, p[4], p[5]
    )
    if _trace.ON:
        _trace.mark(_FRAME_BUILT)
    return frame


def sleep_receive(rx, att, double timeout, long waiting, long after):
    """``Receiver._sleep_take`` compiled: the same steps, the same order, and the wait is one ``poll()``
    on ``att.fd`` with the GIL released instead of three Python calls down to ``select.poll``.

    Woken, this process usually runs on the producer's core with every cache line cold: what runs
    between the wake-up and the frame is what the handoff costs beyond the bare wake.
    """
    cdef int fd = att.fd
    cdef int ms, r = 0
    ring = att.ring
    core = ring if type(ring) is ConsumerCore else None
    if core is not None:
        (<ConsumerCore>core)._set_waiting(waiting)
    else:
        ring.set_waiting(waiting)
    try:
        frame = _receive(rx, att)  # a frame published before our flag was visible
        if frame is None:
            if fd < 0:
                att.client.wait_readable(timeout)
            else:
                ms = 0 if timeout <= 0 else (<int>(timeout * 1000 + 0.999) if timeout < 2e6 else 2000000000)
                with nogil:
                    r = cl_poll_in(fd, ms)
                if r == -CL_EINTR:
                    PyErr_CheckSignals()  # a handler's exception (KeyboardInterrupt) is raised here
                elif r < 0:  # what select.poll would raise: the Python wait marks the client gone
                    att.client.wait_readable(0.0)
            if _trace.ON:
                _trace.mark(_WOKEN)
    finally:
        if core is not None:
            (<ConsumerCore>core)._set_waiting(after)
        else:
            ring.set_waiting(after)
    if frame is None:
        frame = _receive(rx, att)
    return frame
