"""Contract with cuda.core's private IPC descriptor APIs, checked without a GPU (so CI runs it).

``cudalink/cuda`` moves IPC handles through shared memory as plain bytes: it reads a descriptor's
payload through ``__reduce__()`` and rebuilds one with the private ``_init``. pyproject bounds
cuda-core below 2; if a release inside that bound changes either API, these tests fail by name
instead of the GPU suite failing somewhere deep in an attach.
"""

from __future__ import annotations

import re

import pytest

core = pytest.importorskip("cuda.core")


def test_cuda_core_is_inside_the_declared_bound() -> None:
    major = int(re.match(r"(\d+)", core.__version__).group(1))  # type: ignore[union-attr]
    assert major == 1, f"pyproject says cuda-core>=1.2,<2; found {core.__version__}"


def test_buffer_descriptor_round_trips_through_init_and_reduce() -> None:
    from cuda.core._memory._ipc import IPCBufferDescriptor

    payload = bytes(range(64))
    d = IPCBufferDescriptor._init(payload, 1 << 20)
    got_payload, got_size = d.__reduce__()[1][:2]  # what PoolExporter writes into the header
    assert (bytes(got_payload), int(got_size)) == (payload, 1 << 20)
    from cudalink.cuda import driver

    ours = driver.buffer_descriptor(payload, 1 << 20)  # what PoolImporter maps a slot from
    assert isinstance(ours, IPCBufferDescriptor)
    assert [bytes(ours.__reduce__()[1][0]), int(ours.__reduce__()[1][1])] == [payload, 1 << 20]


def test_event_descriptor_round_trips_and_our_glue_reads_it() -> None:
    from cuda.core._event import IPCEventDescriptor

    from cudalink.cuda import driver

    raw = bytes(range(64, 128))
    d = IPCEventDescriptor._init(raw, True)

    class _FakeEvent:  # event_handle() needs only an object with the descriptor property
        ipc_descriptor = d

    assert driver.event_handle(_FakeEvent()) == (raw, 1)


def test_public_entry_points_we_call_exist() -> None:
    from cuda.core import Buffer, DeviceMemoryResource, Event
    from cuda.core.utils import StridedMemoryView

    for owner, name in (
        (Buffer, "from_ipc_descriptor"),
        (Buffer, "from_handle"),
        (Event, "from_ipc_descriptor"),
        (DeviceMemoryResource, "from_allocation_handle"),
        (StridedMemoryView, "from_buffer"),
        (StridedMemoryView, "from_dlpack"),
        (StridedMemoryView, "from_cuda_array_interface"),
    ):
        assert callable(getattr(owner, name, None)), f"cuda.core lost {owner.__name__}.{name}"
