"""Pytest setup for tests/vllm: the ``vllm`` marker, and where the engine tests run.

The daemon fixtures (``emsd_factory``, ``emsd``, ``sdk_env``) come from
tests/conftest.py, which pytest loads for every test under tests/.

Tests marked ``vllm`` start real vLLM engines (in subprocesses, one engine per
process) and need vLLM importable in the interpreter running pytest, i.e. the
separate ``.venv-vllm`` (scripts/setup-vllm.sh, scripts/test-vllm.sh). Under
any other interpreter (the main ``.venv`` of scripts/test.sh) they are
skipped with that reason; the connector's unit tests in this folder run
everywhere and skip nothing.
"""

from __future__ import annotations

import importlib.util

import pytest


def _have_vllm() -> bool:
    """vLLM importable as a real package (this folder, also named vllm, is on sys.path as a
    namespace package under pytest; its spec has no origin)."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


HAVE_VLLM = _have_vllm()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "vllm: starts real vLLM engines; needs .venv-vllm (run scripts/test-vllm.sh)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_VLLM:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed in this interpreter: run scripts/test-vllm.sh")
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)
