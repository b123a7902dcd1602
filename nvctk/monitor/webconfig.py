"""`nvctk monitor --web-config-file`: TLS and basic auth as Prometheus exporters configure
them (prometheus/exporter-toolkit's web configuration file), so the same file and the
same Prometheus scrape config (`scheme: https`, `tls_config`, `basic_auth`) serve both.

    tls_server_config:
      cert_file: /etc/nvctk/tls.crt        # PEM; with key_file, the monitor speaks HTTPS only
      key_file: /etc/nvctk/tls.key
      client_auth_type: RequireAndVerifyClientCert   # optional: NoClientCert (default),
      client_ca_file: /etc/nvctk/ca.crt              # VerifyClientCertIfGiven, or this
      min_version: TLS12                   # optional: TLS10..TLS13 (default TLS12)
    basic_auth_users:                      # user: bcrypt hash (htpasswd -nBC 10 "" | tr -d ':')
      prometheus: $2y$10$...

Read once at start: anything wrong (an unknown key, a missing or unreadable file, a hash
that is not bcrypt) is one line naming the file and the key, before the port is served.
`http_server_config` (HTTP/2, extra headers) is not supported and is refused, not ignored.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from nvctk.base.errors import NvctkError

TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
# exporter-toolkit's client_auth_type -> ssl's; RequestClientCert and RequireAnyClientCert
# (a certificate asked for, not verified) are refused: Python's TLS verifies any it asks for
CLIENT_AUTH = {"NoClientCert": ssl.CERT_NONE, "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
               "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
TLS_KEYS = {"cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version"}
MAX_CACHED = 64  # credentials checked once, then remembered (a bcrypt check is ~0.1 s)


@dataclass
class WebConfig:
    tls: ssl.SSLContext | None = None
    users: dict[str, bytes] = field(default_factory=dict)  # user -> bcrypt hash
    _ok: set[bytes] = field(default_factory=set)  # sha256 of "user:password" that passed

    def known(self, header: str) -> bool | None:
        """True: no user is listed, or the header's pair passed before; False: not a
        listed user's basic credentials; None: a bcrypt check decides (authorized)."""
        if not self.users:
            return True
        pair = _basic(header)
        if pair is None or pair[0] not in self.users:
            return False
        return True if _key(*pair) in self._ok else None

    def authorized(self, header: str) -> bool:
        """Whether an Authorization header carries a listed user's password (True when
        no user is listed). Blocks for a bcrypt check the first time a pair is seen."""
        seen = self.known(header)
        if seen is not None:
            return seen
        import bcrypt  # start time: only where basic auth is configured

        pair = _basic(header)
        assert pair is not None
        user, password = pair
        if not bcrypt.checkpw(password.encode(), self.users[user]):
            return False
        key = _key(user, password)
        if len(self._ok) >= MAX_CACHED:
            self._ok.clear()
        self._ok.add(key)
        return True


def _basic(header: str) -> tuple[str, str] | None:
    scheme, _, cred = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, sep, password = base64.b64decode(cred.strip(), validate=True).decode("utf-8").partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return (user, password) if sep else None


def _key(user: str, password: str) -> bytes:
    return hashlib.sha256(f"{user}:{password}".encode()).digest()


def load(path: str) -> WebConfig:
    """The web config file at path; NvctkError naming the file and what is wrong."""
    where = f"--web-config-file {path}"
    try:
        doc: Any = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise NvctkError(f"{where}: cannot read it ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise NvctkError(f"{where}: not YAML ({str(e).splitlines()[0]})") from None
    if doc is None:
        return WebConfig()
    if not isinstance(doc, dict):
        raise NvctkError(f"{where}: not a mapping of tls_server_config, basic_auth_users")
    unknown = set(doc) - {"tls_server_config", "basic_auth_users"}
    if unknown:
        raise NvctkError(f"{where}: {sorted(unknown)[0]}: not supported (tls_server_config, basic_auth_users)")
    out = WebConfig()
    users = doc.get("basic_auth_users") or {}
    if not isinstance(users, dict):
        raise NvctkError(f"{where}: basic_auth_users: not a mapping of user: bcrypt hash")
    for user, hashed in users.items():
        if not (isinstance(user, str) and isinstance(hashed, str) and hashed[:4] in ("$2a$", "$2b$", "$2y$")):
            raise NvctkError(f"{where}: basic_auth_users.{user}: not a bcrypt hash ($2y$...)")
        out.users[user] = hashed.encode()
    tls = doc.get("tls_server_config")
    if tls is not None:
        out.tls = _tls(where, tls)
    return out


def _tls(where: str, tls: Any) -> ssl.SSLContext:
    if not isinstance(tls, dict):
        raise NvctkError(f"{where}: tls_server_config: not a mapping")
    unknown = set(tls) - TLS_KEYS
    if unknown:
        raise NvctkError(f"{where}: tls_server_config.{sorted(unknown)[0]}: not supported")
    for key in ("cert_file", "key_file"):
        if not tls.get(key):
            raise NvctkError(f"{where}: tls_server_config.{key}: missing")
    auth = tls.get("client_auth_type", "NoClientCert")
    if auth not in CLIENT_AUTH:
        raise NvctkError(f"{where}: tls_server_config.client_auth_type: {auth!r}, not one of "
                         f"{', '.join(CLIENT_AUTH)}")
    version = tls.get("min_version", "TLS12")
    if version not in TLS_VERSIONS:
        raise NvctkError(f"{where}: tls_server_config.min_version: {version!r}, not one of "
                         f"{', '.join(TLS_VERSIONS)}")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = TLS_VERSIONS[version]
    try:
        ctx.load_cert_chain(tls["cert_file"], tls["key_file"])
    except (OSError, ssl.SSLError) as e:
        raise NvctkError(f"{where}: tls_server_config.cert_file/key_file: {e}") from None
    ctx.verify_mode = CLIENT_AUTH[auth]
    if auth != "NoClientCert":
        if not tls.get("client_ca_file"):
            raise NvctkError(f"{where}: tls_server_config.client_ca_file: needed by {auth}")
        try:
            ctx.load_verify_locations(tls["client_ca_file"])
        except (OSError, ssl.SSLError) as e:
            raise NvctkError(f"{where}: tls_server_config.client_ca_file: {e}") from None
    return ctx
