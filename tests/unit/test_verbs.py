"""Loading pyverbs lazily, finding devices, the ``cluster.transport`` setting, and which
device, port and GID the RDMA endpoint uses."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from emsd.config import ClusterConfig, ConfigError, config_from_dict
from emsd.transport import verbs
from emsd.transport.rdma import open_endpoint
from emsd.transport.verbs import GidEntry, RdmaError, choose_gid_index


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


# -- which device, port and GID ------------------------------------------------------

LINK_LOCAL = "fe80:0000:0000:0000:0a1b:2cff:fe3d:4e5f"
V4_MAPPED = "0000:0000:0000:0000:0000:ffff:0a00:0102"  # ::ffff:10.0.1.2
GLOBAL_V6 = "2001:0db8:0000:0000:0000:0000:0000:0001"
ZERO = "0000:0000:0000:0000:0000:0000:0000:0000"


def test_roce_picks_v2_with_an_ipv4_address_as_show_gids_would_suggest() -> None:
    table = [GidEntry(0, LINK_LOCAL, False), GidEntry(1, LINK_LOCAL, True),
             GidEntry(2, V4_MAPPED, False), GidEntry(3, V4_MAPPED, True)]  # a typical mlx5 RoCE port
    assert choose_gid_index(table, ethernet=True) == 3
    assert choose_gid_index(table[:3], ethernet=True) == 1  # no IPv4 address: v2 link-local
    assert choose_gid_index([GidEntry(0, LINK_LOCAL, False), GidEntry(4, GLOBAL_V6, True),
                             GidEntry(5, LINK_LOCAL, True)], ethernet=True) == 4
    assert choose_gid_index(table, ethernet=False) == 0  # InfiniBand: the port GID


def test_a_port_with_only_zero_gids_is_refused_with_what_to_set() -> None:
    with pytest.raises(RdmaError, match="rdma_gid_index"):
        choose_gid_index([GidEntry(0, ZERO, True), GidEntry(1, "garbage", True)], ethernet=True)
    assert choose_gid_index([GidEntry(0, ZERO, True), GidEntry(1, LINK_LOCAL, False)], ethernet=False) == 1


_GIDS = st.sampled_from([LINK_LOCAL, V4_MAPPED, GLOBAL_V6, ZERO, V4_MAPPED.upper(), "::ffff:10.0.1.2",
                         "fe80::a1b:2cff:fe3d:4e5f", "not a gid", "::"])
_ENTRY = st.builds(GidEntry, st.integers(0, 255), _GIDS, st.booleans())


def _rank(e: GidEntry, ethernet: bool) -> int:
    """The rule of the docstring, spelled out differently: lower is better."""
    if not ethernet:
        return 0
    order = {V4_MAPPED: 0, "::ffff:10.0.1.2": 0, GLOBAL_V6: 1, LINK_LOCAL: 2, "fe80::a1b:2cff:fe3d:4e5f": 2}
    return order[e.gid.lower()] if e.roce_v2 else 3


@given(st.lists(_ENTRY, min_size=1, max_size=12, unique_by=lambda e: e.index), st.booleans())
@settings(max_examples=200, deadline=None)
def test_the_chosen_gid_is_nonzero_and_no_entry_ranks_better(table: list[GidEntry], ethernet: bool) -> None:
    usable = [e for e in table if e.gid not in (ZERO, "::", "not a gid")]
    if not usable:
        with pytest.raises(RdmaError):
            choose_gid_index(table, ethernet)
        return
    got = choose_gid_index(table, ethernet)
    assert got == min((_rank(e, ethernet), e.index) for e in usable)[1]


def test_rdma_settings_are_read_and_checked() -> None:
    c = config_from_dict({"cluster": {}}).cluster
    assert (c.rdma_device, c.rdma_port, c.rdma_gid_index) == ("", 1, None)
    c = config_from_dict({"cluster": {"rdma_device": "mlx5_1", "rdma_port": 2, "rdma_gid_index": 3}}).cluster
    assert (c.rdma_device, c.rdma_port, c.rdma_gid_index) == ("mlx5_1", 2, 3)
    assert config_from_dict({"cluster": {"rdma_gid_index": "auto"}}).cluster.rdma_gid_index is None
    for key, bad in (("rdma_gid_index", -1), ("rdma_gid_index", "3"), ("rdma_gid_index", True),
                     ("rdma_port", 0), ("rdma_device", "mlx5 0"), ("rdma_device", 5)):
        with pytest.raises(ConfigError, match=rf"cluster\.{key}: must be"):
            config_from_dict({"cluster": {key: bad}})


def test_open_endpoint_passes_the_chosen_device_port_and_gid_and_names_a_missing_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verbs, "probe", lambda: (["mlx5_0", "mlx5_1"], ""))
    asked: list[tuple[str, int, int | None]] = []

    def refuse(name: str, port: int, gid_index: int | None) -> verbs.VerbsEngine:
        asked.append((name, port, gid_index))
        raise RdmaError("no such port")

    pool = memoryview(bytearray(4096))
    assert open_endpoint(pool, refuse) == (None, "RDMA device mlx5_0: no such port")
    got = open_endpoint(pool, refuse, device="mlx5_1", port=2, gid_index=3)
    assert got == (None, "RDMA device mlx5_1: no such port")
    assert asked == [("mlx5_0", 1, None), ("mlx5_1", 2, 3)]
    endpoint, why = open_endpoint(pool, refuse, device="mlx5_9")
    assert endpoint is None and why == "no RDMA device 'mlx5_9' (found mlx5_0, mlx5_1)"
    assert len(asked) == 2  # a missing device opens nothing
