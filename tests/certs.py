"""Throw-away certificates for TLS tests, made with the ``openssl`` command.

``Authority(dir, name).create()`` makes a self-signed CA (EC P-256, valid
two days); ``issue(node)`` signs a certificate for a node and returns the
paths of its certificate and key. ``available()`` says whether the
``openssl`` command is here, for a clear skip.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def available() -> str | None:
    return None if shutil.which("openssl") else "the openssl command is not installed"


def _openssl(*args: str, stdin: bytes | None = None) -> bytes:
    return subprocess.run(["openssl", *args], input=stdin, check=True, capture_output=True,
                          timeout=30).stdout


class Authority:
    def __init__(self, directory: Path, name: str) -> None:
        self.dir = directory
        self.name = name
        self.cert = directory / f"{name}-ca.pem"
        self.key = directory / f"{name}-ca.key"

    def create(self) -> Authority:
        self.dir.mkdir(parents=True, exist_ok=True)
        _openssl("req", "-x509", *_KEY, "-keyout", str(self.key), "-out", str(self.cert), "-days", "2",
                 "-subj", f"/CN={self.name} test CA")
        return self

    def issue(self, node: str) -> tuple[Path, Path]:
        """A certificate for ``node`` signed by this CA: (cert path, key path)."""
        cert, key = self.dir / f"{self.name}-{node}.pem", self.dir / f"{self.name}-{node}.key"
        request = _openssl("req", "-new", *_KEY, "-keyout", str(key), "-subj", f"/CN={node}")
        _openssl("x509", "-req", "-CA", str(self.cert), "-CAkey", str(self.key), "-CAcreateserial",
                 "-days", "2", "-out", str(cert), stdin=request)
        return cert, key
