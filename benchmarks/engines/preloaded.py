"""Engine processes forked from one that has imported vLLM already.

Importing vLLM takes about 13 s of CPU on this machine (torch's compiler
stack, transformers, vLLM's config and engine modules), about half of what
a short engine run costs. Every engine must still be a process of its own,
as a server runs it (vLLM keeps process-wide state), so instead of starting
a fresh interpreter per engine, ``start`` asks a fork server (Python's
``multiprocessing`` "forkserver" start method) that imported vLLM once to
fork a child, which then runs the engine script as ``__main__`` with its
own arguments, environment, working directory and log file. No engine is
ever made in the fork server, so each child starts with vLLM imported and
nothing else: its engine, its threads and its KV cache are its own.

Measured on this machine (2026-11-27, two engines of ``benchmarks/engines``'
quick trace): 11.6 and 12.4 s per engine forked against 26-30 s started
fresh, the same outputs token for token and the same TTFT within 0.1 s.

What a child does not share with a fresh interpreter: environment variables
that vLLM reads when it is *imported* take the fork server's values, which
are the first caller's (``VLLM_TARGET_DEVICE`` is set to ``cpu`` here before
the server starts; ``VLLM_LOGGING_LEVEL`` keeps vLLM's default, INFO).
Variables read when an engine is made (``VLLM_ENABLE_V1_MULTIPROCESSING``,
``VLLM_CPU_*``, the connectors' own) take the child's. The fork server runs
with the caller's interpreter (``sys.executable``), so only engines of that
venv can be started here; others need ``subprocess``. Each child imports
the caller's main module again (``multiprocessing``'s rule, as ``__mp_main__``):
a script that calls ``start`` must keep its work under
``if __name__ == "__main__":``, as ``benchmarks.engines.run`` does.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import sys
from multiprocessing.context import ForkServerContext, ForkServerProcess
from pathlib import Path

# What an engine imports before it serves, imported once by the fork server (a module that is
# missing is skipped by multiprocessing: the child then imports what it needs itself).
PRELOAD = ["vllm", "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "vllm.v1.engine.core",
           "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner",
           "vllm.model_executor.models.llama", "vllm.distributed.kv_transfer.kv_connector.factory"]

_context: ForkServerContext | None = None


def _forkserver() -> ForkServerContext:
    """The process's fork-server context, preloading vLLM (started at the first ``start``)."""
    global _context
    if _context is None:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # read at import: the server's value holds
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _context = ctx
    return _context


def _run(script: str, argv: list[str], env: dict[str, str], cwd: str, log: str) -> None:
    """In the forked child: become ``python script *argv`` run in ``cwd`` with ``env``, its
    stdout and stderr in ``log``; exit with the script's code."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)  # start made it empty
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [script, *argv]
    # as an interpreter started with env would: the script's folder first, then PYTHONPATH
    paths = [str(Path(script).parent), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    sys.path[0:0] = [p for p in paths if p not in sys.path]
    code: int | str | None = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code
    finally:
        atexit._run_exitfuncs()  # a multiprocessing child skips them; a script's own may matter
        sys.stdout.flush()
        sys.stderr.flush()
    if code not in (None, 0):
        raise SystemExit(code)


class Forked:
    """A forked engine process, with the part of ``subprocess.Popen``'s interface the launchers
    use: ``pid``, ``poll``, ``wait``, ``kill`` and ``returncode`` (negative: killed by a signal)."""

    def __init__(self, proc: ForkServerProcess) -> None:
        self._proc = proc
        self.pid: int = proc.pid or 0

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def poll(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; ``TimeoutError`` if the process still runs after ``timeout`` s."""
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise TimeoutError(f"process {self.pid} still running after {timeout} s")
        return self._proc.exitcode

    def kill(self) -> None:
        self._proc.kill()


def _nothing() -> None:
    """A child that exits at once (``ready``)."""


def ready() -> None:
    """Start the fork server and return once it has imported vLLM (its first child has run)."""
    proc = _forkserver().Process(target=_nothing)
    proc.start()
    proc.join()


def start(script: Path, argv: list[str], *, env: dict[str, str], cwd: Path, log: Path) -> Forked:
    """Fork ``python script *argv`` from the fork server (started, with vLLM imported, at the
    first call); returns at once. ``env`` is the child's whole environment; ``log`` is made
    empty here, so that it exists once this returns, as it does for ``subprocess.Popen``."""
    Path(log).write_bytes(b"")
    proc = _forkserver().Process(target=_run, args=(str(script), argv, env, str(cwd), str(log)),
                                 name=f"engine {Path(log).stem}")
    proc.start()
    return Forked(proc)
