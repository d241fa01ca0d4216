"""Pluggable transports. ``SharedMemoryTransport`` is the default; ``MemoryTransport`` is for tests."""

from .base import Client, NoProducer, Peer, Reply, Server, ServerHandler, Transport
from .memory import MemoryTransport
from .shm import SharedMemoryTransport

__all__ = [
    "Client",
    "MemoryTransport",
    "NoProducer",
    "Peer",
    "Reply",
    "Server",
    "ServerHandler",
    "SharedMemoryTransport",
    "Transport",
]
