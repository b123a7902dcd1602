"""A self-signed certificate for a test server on 127.0.0.1 (openssl)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def make_cert(tmp: Path, cn: str = "127.0.0.1") -> tuple[Path, Path]:
    """tmp/tls.crt for 127.0.0.1 (its subjectAltName) and its key, tmp/tls.key."""
    tmp.mkdir(parents=True, exist_ok=True)
    crt, key = tmp / "tls.crt", tmp / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", f"/CN={cn}", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(crt)], check=True, capture_output=True)
    return crt, key
