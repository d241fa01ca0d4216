"""Sessions: tests (CPU), gpu, lint, typecheck, bench, soak. ``nox -l`` lists them."""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True


@nox.session
def tests(session: nox.Session) -> None:
    """The CI suite: everything that runs without a GPU (GPU tests skip themselves)."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", *session.posargs)
    session.run("python", "-m", "pytest", *session.posargs, env={"CUDALINK_PURE_PYTHON": "1"})


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """GPU tests, in the current environment (the GPU machine's python has torch/cupy/jax)."""
    session.run("python", "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install("-e", ".[dev]")
    session.run("mypy")


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks with peers side by side; pass --quick for the short CPU run. The ucx extra brings the remote
    rows' engine floor (``--remote``). Peers that need torch or cupy are skipped here (this venv has neither): on
    a GPU machine, run ``python -m cudalink bench`` in the environment that has them."""
    session.install("-e", ".[ucx]")
    session.run("python", "-m", "cudalink", "bench", *session.posargs)


@nox.session
def soak(session: nox.Session) -> None:
    """Long reliability runs (chaos, torn-read soak, resource flatness)."""
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", "-m", "slow", "-o", "addopts=", *session.posargs)
