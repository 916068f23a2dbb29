"""Which transport each peer gets: the selection and fallback state machine."""

from __future__ import annotations

import pytest

from emsd.transport.selection import PeerPath, PeerTransports

ADVERT = object()  # stands for a parsed RdmaDescriptor
OTHER = object()


def test_tcp_mode_never_tries_rdma_and_says_why() -> None:
    t = PeerTransports("tcp", "")
    assert t.should_try_rdma("b", ADVERT) == (False, True)
    st = t.state("b")
    assert (st.path, st.transport, st.kind) == (PeerPath.TCP, "tcp", "config")
    assert "tcp" in st.reason


def test_auto_without_a_local_device_uses_tcp_with_the_local_reason() -> None:
    t = PeerTransports("auto", "no RDMA device (none found)")
    assert t.should_try_rdma("b", ADVERT) == (False, True)
    assert t.state("b").kind == "no_local_device" and "no RDMA device" in t.state("b").reason
    assert t.should_try_rdma("b", ADVERT) == (False, False)  # the same again: no change to log


def test_auto_tries_rdma_only_when_the_peer_advertises_a_good_descriptor() -> None:
    t = PeerTransports("auto", "")
    assert t.should_try_rdma("b", None) == (False, True)
    assert t.state("b").kind == "no_advert"
    assert t.should_try_rdma("c", None, "rdma.gid: bad") == (False, True)
    assert t.state("c").kind == "bad_advert" and "rdma.gid" in t.state("c").reason
    assert t.should_try_rdma("d", ADVERT) == (True, False)


def test_a_connect_failure_is_tcp_for_that_link_and_a_later_dial_retries() -> None:
    t = PeerTransports("auto", "")
    assert t.connect_failed("b", ADVERT, "timeout")
    assert not t.connect_failed("b", ADVERT, "timeout")  # logged once
    assert t.state("b").transport == "tcp" and t.state("b").kind == "connect"
    assert t.should_try_rdma("b", ADVERT)[0]
    assert t.connected("b", ADVERT) and t.uses_rdma("b")


def test_a_failure_mid_transfer_keeps_the_peer_on_tcp_until_its_advertisement_changes() -> None:
    t = PeerTransports("auto", "")
    t.connected("b", ADVERT)
    assert t.transfer_failed("b", "wc status 12")
    assert not t.transfer_failed("b", "wc status 12")
    st = t.state("b")
    assert (st.path, st.transport, st.kind) == (PeerPath.FELL_BACK, "tcp", "transfer")
    assert not t.uses_rdma("b")
    assert t.should_try_rdma("b", ADVERT) == (False, False)
    assert t.should_try_rdma("b", OTHER) == (True, False)  # re-registered (e.g. restarted): try again


def test_snapshot_and_forget() -> None:
    t = PeerTransports("auto", "")
    t.connected("b", ADVERT)
    t.should_try_rdma("c", None)
    assert t.snapshot() == {"b": {"transport": "rdma", "state": "rdma", "reason": ""},
                            "c": {"transport": "tcp", "state": "tcp",
                                  "reason": "the peer advertises no RDMA endpoint"}}
    t.forget("b")
    assert t.state("b").path is PeerPath.UNDECIDED


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="ib"):
        PeerTransports("ib", "")


def test_metrics_show_the_current_transport_and_count_fallbacks_but_not_configured_tcp() -> None:
    from emsd.metrics import Metrics

    m = Metrics()
    m.transport("b", "rdma", "")
    m.transport("b", "tcp", "transfer")
    m.transport("c", "tcp", "config")
    text = m.render().decode()
    assert 'emsd_peer_transport{peer="b",transport="tcp"} 1.0' in text
    assert 'emsd_peer_transport{peer="b",transport="rdma"} 0.0' in text
    assert 'emsd_peer_transport_fallbacks_total{peer="b",reason="transfer"} 1.0' in text
    assert 'emsd_peer_transport{peer="c",transport="tcp"} 1.0' in text
    assert 'peer="c",reason=' not in text
