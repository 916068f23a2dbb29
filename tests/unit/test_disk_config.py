"""``[disk]`` in the daemon's config: off by default, every key checked with a one-line error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from emsd.config import ConfigError, config_from_dict


def test_off_by_default() -> None:
    assert not config_from_dict({}).disk.enabled


def test_a_tier_is_read_with_sizes() -> None:
    d = config_from_dict({"disk": {"dir": "/var/lib/emsd", "size": "4GiB", "queue": "64MiB",
                                   "readers": 4}}).disk
    assert d.enabled and d.dir == Path("/var/lib/emsd") and d.size == 4 << 30
    assert d.queue == 64 << 20 and d.readers == 4 and d.writers == 2


@pytest.mark.parametrize(("table", "key"), [
    ({"dir": "relative"}, "disk.dir"),
    ({"dir": "/x", "size": "1MiB"}, "disk.size"),
    ({"dir": "/x", "size": "1GiB", "extent": "3MiB"}, "disk.extent"),
    ({"dir": "/x", "size": "1GiB", "readers": 0}, "disk.readers"),
    ({"dir": "/x", "size": "1GiB", "writers": "2"}, "disk.writers"),
    ({"dir": "/x", "size": "1GiB", "queue": 5}, "disk.queue"),
    ({"dir": "/x", "size": "1GiB", "bogus": 1}, "disk.bogus"),
])
def test_bad_values_name_their_key(table: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as exc:
        config_from_dict({"disk": table})
    assert str(exc.value).startswith(key)
