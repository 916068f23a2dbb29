"""Loading pyverbs lazily, finding devices, and the ``cluster.transport`` setting."""

from __future__ import annotations

import sys

import pytest

from emsd.config import ClusterConfig, ConfigError, config_from_dict
from emsd.transport import verbs


def test_transport_defaults_to_auto_and_accepts_the_three_modes() -> None:
    assert ClusterConfig().transport == "auto"
    for mode in ("auto", "rdma", "tcp"):
        assert config_from_dict({"cluster": {"transport": mode}}).cluster.transport == mode


@pytest.mark.parametrize("bad", ["RDMA", "ib", "", 1, True])
def test_an_unknown_transport_is_a_config_error_naming_the_key(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"cluster\.transport: must be \"auto\", \"rdma\" or \"tcp\""):
        config_from_dict({"cluster": {"transport": bad}})


def test_probe_never_raises_and_explains_an_empty_list() -> None:
    devices, why = verbs.probe()
    assert isinstance(devices, list)
    assert (why == "") == bool(devices)


def test_a_device_list_that_raises_means_no_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        verbs.load_pyverbs()
    except verbs.RdmaError as exc:
        pytest.skip(f"pyverbs is not installed here: {exc}")
    import pyverbs.device

    def boom() -> list[object]:
        raise RuntimeError("Failed to get devices list")  # what PyverbsRDMAError says without devices

    monkeypatch.setattr(pyverbs.device, "get_device_list", boom)
    assert verbs.list_devices() == []
    assert verbs.probe() == ([], "no RDMA device (pyverbs.device.get_device_list() found none)")


def test_pyverbs_comes_from_its_own_package_without_putting_its_directory_on_sys_path() -> None:
    try:
        module = verbs.load_pyverbs()
    except verbs.RdmaError as exc:
        pytest.skip(f"pyverbs is not installed here: {exc}")
    assert module.__name__ == "pyverbs"
    assert str(verbs.DEBIAN_DIST) not in sys.path


def test_a_missing_pyverbs_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    monkeypatch.setattr(verbs, "_pyverbs", None)
    monkeypatch.delitem(sys.modules, "pyverbs", raising=False)
    monkeypatch.setattr(verbs.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(verbs.RdmaError, match="apt-get install python3-pyverbs"):
        verbs.load_pyverbs(dist=tmp_path)  # type: ignore[arg-type]
