"""Start vLLM engines (tests/vllm/engine_run.py) in subprocesses and read their results.

Every engine is a Python process of its own: vLLM keeps process-wide state
(distributed groups, the KV-transfer agent), so two engines never share one.
An engine that runs in one process (``in_process``, the default) is forked
from a process that has imported vLLM once (benchmarks/engines/preloaded.py:
about 13 s of CPU less an engine); the others start a fresh interpreter.
``start_engine`` returns at once; ``Engine.result()`` waits for the exit and
returns the JSON the script wrote. With ``sync=True`` the engine stops before
each batch after the first until the test calls ``go(i)`` (after
``wait_ready(i)``), so the test can start, stop or kill emsd between batches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.engines import preloaded  # noqa: E402

ENGINE_RUN = Path(__file__).with_name("engine_run.py")


class Engine:
    """One engine process and its files (output JSON, combined stdout/stderr log)."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes] | preloaded.Forked, out: Path, log: Path,
                 sync_dir: Path | None) -> None:
        self.name = name
        self.proc = proc
        self.out = out
        self.log_path = log
        self.sync_dir = sync_dir

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def _tail(self, n: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-n:])

    def wait_ready(self, i: int, timeout: float = 300.0) -> None:
        """Block until the engine waits before batch ``i`` (it finished batch ``i - 1``)."""
        assert self.sync_dir is not None, "start_engine(sync=True) for wait_ready/go"
        deadline = time.monotonic() + timeout
        while not (self.sync_dir / f"ready-{i}").exists():
            if self.proc.poll() is not None:
                raise AssertionError(f"engine {self.name} exited {self.proc.returncode} before batch {i}:\n"
                                     + self._tail())
            if time.monotonic() > deadline:
                raise AssertionError(f"engine {self.name} not at batch {i} after {timeout}s:\n"
                                     + self._tail())
            time.sleep(0.05)

    def go(self, i: int) -> None:
        assert self.sync_dir is not None
        (self.sync_dir / f"go-{i}").touch()

    def result(self, timeout: float = 600.0) -> dict[str, Any]:
        """Wait for the exit (killing the process after ``timeout``); the output JSON.

        Fails with the log's tail when the engine exited non-zero.
        """
        try:
            code = self.proc.wait(timeout)
        except (subprocess.TimeoutExpired, TimeoutError):
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"engine {self.name} still running after {timeout}s:\n"
                                 + self._tail()) from None
        assert code == 0, f"engine {self.name} exited {code}:\n{self._tail()}"
        return dict(json.loads(self.out.read_text()))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start_engine(workdir: Path, name: str, model: Path, batches: list[list[str]], *,
                 connector: dict[str, Any] | None = None, socket_dir: Path | None = None,
                 in_process: bool = True, core: int | None = None, sync: bool = False,
                 max_tokens: int = 12, reset_connector: bool = False) -> Engine:
    """Start ``engine_run.py`` with ``sys.executable`` (the .venv-vllm interpreter).

    ``connector``: the connector's extra config (``None``: no connector).
    ``socket_dir``: emsd's socket directory (``EMS_SOCKET_DIR``).
    ``in_process``: scheduler and worker in the engine process (starts in about
    half the time); ``False`` runs vLLM's default engine-core and worker
    processes. ``core``: pin vLLM's OpenMP threads to this CPU, so two engines
    can run side by side on this 2-core machine. ``reset_connector``: end with
    ``reset_prefix_cache(reset_connector=True)`` (engine_run.py).
    """
    workdir.mkdir(parents=True, exist_ok=True)
    out, log = workdir / f"{name}.json", workdir / f"{name}.log"
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB; bfloat16 would pick AMX kernels that crash this VM
    env["EMS_SDK_LOG"] = str(workdir / f"{name}-sdk")
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    if socket_dir is not None:
        env["EMS_SOCKET_DIR"] = str(socket_dir)
    if in_process:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env["ENGINE_RUN_EXECUTOR"] = "uni"
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    cmd = [sys.executable, str(ENGINE_RUN), "--model", str(model), "--out", str(out),
           "--prompts", json.dumps(batches), "--max-tokens", str(max_tokens)]
    if connector is not None:
        cmd += ["--connector", json.dumps(connector)]
    if reset_connector:
        cmd.append("--reset-connector")
    sync_dir = None
    if sync:
        sync_dir = workdir / f"{name}-sync"
        sync_dir.mkdir()
        cmd += ["--sync", str(sync_dir)]
    proc: subprocess.Popen[bytes] | preloaded.Forked
    if in_process:
        proc = preloaded.start(ENGINE_RUN, cmd[2:], env=env, cwd=ROOT, log=log)
    else:
        with open(log, "wb") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    return Engine(name, proc, out, log, sync_dir)


def token_ids(result: dict[str, Any], batch: int) -> list[list[int]]:
    """The generated token ids of every prompt of one batch."""
    return [o["token_ids"] for o in result["batches"][batch]]
