"""``[cluster]`` options read from the config (those without a module's own test file)."""

from __future__ import annotations

import pytest

from emsd.config import ConfigError, config_from_dict


@pytest.mark.parametrize("field", ["handoff", "direct_reads"])
def test_a_switch_is_on_by_default_and_must_be_a_bool(field: str) -> None:
    assert getattr(config_from_dict({}).cluster, field) is True
    assert getattr(config_from_dict({"cluster": {field: False}}).cluster, field) is False


@pytest.mark.parametrize("field", ["handoff", "direct_reads"])
@pytest.mark.parametrize("bad", [1, 0, "yes", "false", None])
def test_a_switch_that_is_not_a_bool_names_the_key(field: str, bad: object) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"cluster": {field: bad}})
    assert err.value.key == f"cluster.{field}"
