"""``check_private``: which modes a file holding credentials (cluster secret, tenants) may have."""

from __future__ import annotations

import os

import pytest

from emsd.config import ConfigError, check_private


@pytest.mark.parametrize(("mode", "own_group", "refused"), [
    (0o600, True, False), (0o400, True, False), (0o600, False, False),
    (0o640, True, False), (0o440, True, False),  # the daemon's own group: a Kubernetes secret volume
    (0o640, False, True), (0o604, True, True), (0o644, True, True), (0o666, True, True), (0o601, True, True),
])
def test_a_credentials_file_is_private_to_the_daemons_user(mode: int, own_group: bool, refused: bool) -> None:
    gid = os.getegid() if own_group else os.getegid() + 1
    st = os.stat_result((0o100000 | mode, 0, 0, 1, os.geteuid(), gid, 32, 0, 0, 0))
    if refused:
        with pytest.raises(ConfigError, match=f"chmod 600; it is {mode:04o}"):
            check_private("cluster.secret_file (x)", st)
    else:
        check_private("cluster.secret_file (x)", st)
