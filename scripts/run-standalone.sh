#!/usr/bin/env bash
# Install emsd and run one daemon on the embedded default (no ZooKeeper: a one-node pool).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/emsd --config "${EMSD_CONFIG:-deploy/emsd.standalone.toml}" "$@"
