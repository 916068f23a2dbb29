"""``[pool]`` eviction and admission keys: defaults and one-line errors."""

from __future__ import annotations

import pytest

from emsd.config import ConfigError, config_from_dict


def test_eviction_defaults_to_prefix_and_admission_to_off() -> None:
    pool = config_from_dict({}).pool
    assert (pool.eviction, pool.admit_after, pool.admit_after_namespaces) == ("prefix", 1, ())


def test_the_read_cache_share_defaults_to_a_sixteenth_and_is_read() -> None:
    assert config_from_dict({}).pool.read_cache_share == 1 / 16
    assert config_from_dict({"pool": {"read_cache_share": 0}}).pool.read_cache_share == 0.0
    assert config_from_dict({"pool": {"read_cache_share": 0.25}}).pool.read_cache_share == 0.25


def test_eviction_and_admission_are_read() -> None:
    pool = config_from_dict({"pool": {"eviction": "lru", "admit_after": 2,
                                      "admit_after_namespaces": {"*chat*": 3, "*": 1}}}).pool
    assert pool.eviction == "lru" and pool.admit_after == 2
    assert pool.admit_after_namespaces == (("*chat*", 3), ("*", 1))


@pytest.mark.parametrize(("pool", "key"), [
    ({"eviction": "lfu"}, "pool.eviction"),
    ({"admit_after": 0}, "pool.admit_after"),
    ({"admit_after": True}, "pool.admit_after"),
    ({"admit_after_namespaces": {"x": 300}}, "pool.admit_after_namespaces.x"),
    ({"admit_after_namespaces": ["x"]}, "pool.admit_after_namespaces"),
    ({"read_cache_share": 0.6}, "pool.read_cache_share"),
    ({"read_cache_share": -0.1}, "pool.read_cache_share"),
    ({"read_cache_share": True}, "pool.read_cache_share"),
    ({"read_cache_share": "5%"}, "pool.read_cache_share"),
])
def test_bad_values_name_the_key(pool: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"pool": pool})
    assert err.value.key == key


def test_the_issue_25_limits_default_and_read() -> None:
    cfg = config_from_dict({})
    assert (cfg.pool.connection_uncommitted, cfg.metrics.namespace_labels, cfg.tenants.max_namespaces) == \
        (0, False, 1024)
    cfg = config_from_dict({"pool": {"connection_uncommitted": "1GiB"}, "metrics": {"namespace_labels": True},
                            "tenants": {"max_namespaces": 16}})
    assert (cfg.pool.connection_uncommitted, cfg.metrics.namespace_labels, cfg.tenants.max_namespaces) == \
        (1 << 30, True, 16)


@pytest.mark.parametrize(("table", "key", "value"), [
    ("pool", "connection_uncommitted", -1), ("metrics", "namespace_labels", "yes"),
    ("tenants", "max_namespaces", 0), ("tenants", "max_namespaces", 1 << 20),
])
def test_bad_issue_25_limits_name_the_key(table: str, key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"{table}.{key}"):
        config_from_dict({table: {key: value}})
