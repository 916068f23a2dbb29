"""``[cluster]`` options read from the config (those without a module's own test file)."""

from __future__ import annotations

import pytest

from emsd.config import ConfigError, config_from_dict


def test_handoff_is_on_by_default_and_must_be_a_bool() -> None:
    assert config_from_dict({}).cluster.handoff is True
    assert config_from_dict({"cluster": {"handoff": False}}).cluster.handoff is False


@pytest.mark.parametrize("bad", [1, 0, "yes", "false", None])
def test_a_handoff_that_is_not_a_bool_names_the_key(bad: object) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"cluster": {"handoff": bad}})
    assert err.value.key == "cluster.handoff"
