"""deploy/systemd: the units pass ``systemd-analyze verify`` and agree with emsd and its sample config."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from emsd.config import load_config

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "deploy" / "systemd"
EMSD_BIN = "/opt/emsd/bin/emsd"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    ANALYZE is None,
    reason="systemd-analyze is not installed (scripts/setup-deploy-checks.sh installs Debian's systemd)",
)


def unit_entries(path: Path) -> dict[str, list[tuple[str, str]]]:
    """Section -> [(key, value)] of a unit file (keys may repeat, unlike configparser's)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
        else:
            key, _, value = line.partition("=")
            current.append((key.strip(), value.strip()))
    return sections


def one(path: Path, section: str, key: str) -> str:
    values = [v for k, v in unit_entries(path)[section] if k == key]
    assert len(values) == 1, f"{path.name}: [{section}] {key} appears {len(values)} times"
    return values[0]


def verify(unit: Path) -> list[str]:
    """``systemd-analyze verify`` of ``unit``: its exit status must be 0; returns the lines naming it."""
    assert ANALYZE is not None
    run = subprocess.run([ANALYZE, "verify", "--man=no", "--generators=no", str(unit)],
                         capture_output=True, text=True, timeout=60)
    lines = [ln for ln in (run.stdout + run.stderr).splitlines() if unit.name in ln or "emsd" in ln]
    assert run.returncode == 0, f"systemd-analyze verify {unit.name} exited {run.returncode}:\n" + \
        run.stdout + run.stderr
    return lines


def staged(tmp_path: Path, name: str) -> Path:
    """A copy of deploy/systemd/NAME whose emsd binary is a stub (verify wants it executable)."""
    stub = tmp_path / "bin" / "emsd"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    text = (SYSTEMD / name).read_text()
    assert name != "emsd.service" or EMSD_BIN in text
    unit = tmp_path / name
    unit.write_text(text.replace(EMSD_BIN, str(stub)))
    return unit


@needs_analyze
@pytest.mark.parametrize("name", ["emsd.service", "emsd-hugepages.service"])
def test_units_pass_systemd_analyze_verify(tmp_path: Path, name: str) -> None:
    assert verify(staged(tmp_path, name)) == []


@needs_analyze
def test_verify_reports_a_misspelled_key(tmp_path: Path) -> None:
    """The check above can fail: a typo in a key is reported on a line naming the unit."""
    unit = staged(tmp_path, "emsd.service")
    unit.write_text(unit.read_text().replace("LimitMEMLOCK=", "LimitMEMLOK="))
    assert any("LimitMEMLOK" in line for line in verify(unit))


def test_emsd_service_essentials() -> None:
    unit = SYSTEMD / "emsd.service"
    assert one(unit, "Service", "Type") == "simple"
    assert one(unit, "Service", "User") == "emsd"
    assert one(unit, "Service", "Restart") == "on-failure"
    assert 1 <= int(one(unit, "Service", "RestartSec").removesuffix("s")) <= 30
    assert one(unit, "Service", "LimitMEMLOCK") == "infinity"
    assert one(unit, "Install", "WantedBy") == "multi-user.target"
    assert shlex.split(one(unit, "Service", "ExecStart")) == [EMSD_BIN, "--config", "/etc/emsd/emsd.toml"]


def test_socket_directory_is_the_sample_configs() -> None:
    """ExecStartPre creates node.socket_dir of the sample config for emsd, closed to others."""
    pre = shlex.split(one(SYSTEMD / "emsd.service", "Service", "ExecStartPre"))
    assert pre[0] == "+/usr/bin/install", "must run as root to create and chown the directory"
    assert pre[1:8] == ["-d", "-o", "emsd", "-g", "emsd", "-m", "0750"]
    assert Path(pre[8]) == load_config(SYSTEMD / "emsd.toml").node.socket_dir


def test_restart_prevent_status_is_emsds_config_error_status(tmp_path: Path) -> None:
    """RestartPreventExitStatus names the status emsd exits with for a bad config."""
    bad = tmp_path / "bad.toml"
    bad.write_text('[pool]\nsize = "lots"\n')
    run = subprocess.run([sys.executable, "-m", "emsd", "--config", str(bad)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert "pool.size" in run.stderr
    assert str(run.returncode) == one(SYSTEMD / "emsd.service", "Service", "RestartPreventExitStatus")


def test_hugepage_reservation_matches_the_sample_pool() -> None:
    env = one(SYSTEMD / "emsd-hugepages.service", "Service", "Environment")
    pages = int(env.removeprefix("EMSD_HUGEPAGES="))
    assert pages * (2 << 20) == load_config(SYSTEMD / "emsd.toml").pool.size
    assert one(SYSTEMD / "emsd-hugepages.service", "Unit", "Before") == "emsd.service"
    assert one(SYSTEMD / "emsd-hugepages.service", "Install", "WantedBy") == "emsd.service"


@pytest.mark.parametrize(("before", "after"), [(0, 2048), (100, 2048), (4096, 4096)])
def test_hugepage_script_only_raises(tmp_path: Path, before: int, after: int) -> None:
    """Run the oneshot's shell as systemd would ($$ -> $), on a stand-in for nr_hugepages."""
    exec_start = one(SYSTEMD / "emsd-hugepages.service", "Service", "ExecStart").replace("$$", "$")
    argv = shlex.split(exec_start)
    assert argv[:2] == ["/bin/sh", "-c"] and len(argv) == 3
    knob = tmp_path / "nr_hugepages"
    knob.write_text(f"{before}\n")
    script = argv[2].replace("/proc/sys/vm/nr_hugepages", str(knob))
    run = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=10,
                         env={**os.environ, "EMSD_HUGEPAGES": "2048"})
    assert run.returncode == 0, run.stderr
    assert int(knob.read_text()) == after
    assert f"vm.nr_hugepages={after}" in run.stdout
