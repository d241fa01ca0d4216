"""ucx:// without UCXX installed (these run everywhere): the errors name the extra to install."""

from __future__ import annotations

import os
import sys
import time

import pytest

import cudalink
from cudalink.transport import ucx_engine


def unique(tag: str) -> str:
    return f"ucx{tag}{os.getpid()}{time.monotonic_ns() % 10**7}"


def test_an_address_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ucx_engine, "_ucxx", None)
    monkeypatch.setitem(sys.modules, "ucxx", None)
    with pytest.raises(cudalink.LinkError, match=r'pip install "cudalink\[ucx\]"'):
        cudalink.Receiver("ucx://127.0.0.1:5000/cam", timeout=0.1)


def test_sender_serve_without_the_extra_fails_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "ucxx" else real(n, *a))
    with pytest.raises(cudalink.LinkError, match=r"cudalink\[ucx\]"):
        cudalink.Sender(unique("x"), shape=(4, 4), serve="ucx://127.0.0.1:5000")
    with pytest.raises(cudalink.LinkError, match="ucx://HOST:PORT"):
        cudalink.Sender(unique("x"), shape=(4, 4), serve="tcp://nope")


def test_the_key_file_is_made_private_once_and_then_reused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]
) -> None:
    monkeypatch.delenv("CUDALINK_KEY", raising=False)
    path = os.path.join(str(tmp_path), "sub", "ucx.key")
    monkeypatch.setenv("CUDALINK_KEY_FILE", path)
    with pytest.raises(cudalink.LinkError, match="no ucx key"):
        ucx_engine.load_key()
    key, made = ucx_engine.load_key(create=True)
    assert made == path and len(key) == 32
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert ucx_engine.load_key(create=True) == (key, None)  # the same key, not a new one
    monkeypatch.setenv("CUDALINK_KEY", key.hex())
    assert ucx_engine.load_key() == (key, None)
    monkeypatch.setenv("CUDALINK_KEY", "not hex")
    with pytest.raises(cudalink.LinkError, match="not hex"):
        ucx_engine.load_key()
