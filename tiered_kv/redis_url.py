"""Redis URLs: checked without any network, and shown without a password.

Below the tiers (it imports nothing of tiered_kv): the config checks ``tiers.remote.url`` with it
and the remote tier's connections use the same parsing.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

SCHEMES = ("redis", "rediss", "unix")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}")


def redact(url: str) -> str:
    """The URL with any password replaced by ``***`` (for logs and error messages)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def url_problem(url: str) -> str:
    """Why this URL cannot name a Redis server ("" when it can); the reason never quotes a password."""
    if not url or any(c.isspace() or not c.isprintable() for c in url):
        return "is empty or holds whitespace or control characters"
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError for a port that is not a number in 0..65535
    except ValueError as e:
        return f"does not parse ({e})"
    if parts.scheme not in SCHEMES:
        return f"has scheme {parts.scheme!r}; use redis://, rediss:// or unix://"
    if parts.password is not None or (parts.query and "password=" in parts.query):
        return ("holds a password: never put one in the config file; put it in an environment variable "
                "and name that variable in tiers.remote.password_env")
    if parts.scheme == "unix":
        return "" if parts.path.startswith("/") else "needs an absolute socket path (unix:///run/redis.sock)"
    if not parts.hostname:
        return "names no host"
    if port == 0:
        return "has port 0"
    db = parts.path.strip("/")
    if db and not db.isdigit():
        return f"has database {db!r}, which is not a number"
    return ""


def url_db(url: str) -> int:
    db = urlsplit(url).path.strip("/")
    return int(db) if db.isdigit() else 0


def node_problem(node: str) -> str:
    """Why ``host:port`` is not a cluster seed node ("" when it is)."""
    host, sep, port = node.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"{node[:80]!r} is not host:port"
    return ""


def split_node(node: str) -> tuple[str, int]:
    host, _, port = node.rpartition(":")
    return host.strip("[]"), int(port)


def env_name_problem(name: str) -> str:
    return "" if _ENV_NAME.fullmatch(name) else f"{name[:80]!r} is not an environment variable name"
