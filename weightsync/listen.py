"""listen: the host:port addresses servers listen on — checked as settings, and bound with an error
that names the setting.

    split_listen(value, setting)        (host, port) of "host:port" (IPv6 in brackets), or
                                        ValueError saying how to write it
    agent_target(value)                 "host:port" to dial an agent at; AGENT_PORT when the
                                        address gives none (gRPC would dial 443)
    is_host(value)                      whether a setting is an address or host name (no port)
    check_bindable(host, port, setting) ListenError naming the setting when the port is taken,
                                        the host is not this machine's, or the port is privileged

A server library that fails to bind says little (gRPC logs a C-level line and raises a bare
RuntimeError; an HTTP server raises "[Errno 98] Address already in use" without the address), so
callers check with a plain socket first, and turn a failure of their own bind into the same
error (`listen_error`).

Not here: the servers themselves (agents/server.py, `metrics.py`).
"""

from __future__ import annotations

import errno
import ipaddress
import re
import socket

from weightsync.errors import ListenError

AGENT_PORT = 7070
"""The port agents listen on in every example and deployment (README, deploy/): what an agent
address without a port means. (An agent's own `listen` default is any free port on loopback; its
ready line says which.)"""

_WHY = {
    errno.EADDRINUSE: "the port is taken (another process listens there)",
    errno.EADDRNOTAVAIL: "that address is not one of this machine's",
    errno.EACCES: "ports below 1024 need privileges",
}


def is_host(value: str) -> bool:
    """An IP address (v4 or v6) or a host name: what a server binds, without a port."""
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return bool(re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252}[A-Za-z0-9])?", str(value)))


def split_listen(value: str, setting: str) -> tuple[str, int]:
    """(host, port) of a "host:port" setting; ValueError naming the setting for anything else."""
    host, sep, port = str(value).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(
            f'{setting} must be host:port with a port in 0..65535 (0: any free port), got {value!r}; e.g. "0.0.0.0:7070"'
        )
    return host.strip("[]"), int(port)


def agent_target(value: str) -> str:
    """An agent address to dial: `value` when it names a port, else `value:AGENT_PORT`. gRPC
    reads a bare host name as port 443 (its HTTPS default), which is never an agent."""
    text = str(value).strip()
    if text.startswith("["):  # [IPv6] or [IPv6]:port
        return text if "]:" in text else f"{text}:{AGENT_PORT}"
    if text.count(":") > 1:  # a bare IPv6 address
        return f"[{text}]:{AGENT_PORT}"
    return text if ":" in text else f"{text}:{AGENT_PORT}"


def listen_error(setting: str, address: str, error: OSError, *, flag: str | None = None) -> ListenError:
    """The ListenError for a failed bind of `address`, naming the setting (and its flag) to change."""
    why = _WHY.get(error.errno, error.strerror or str(error))
    change = f"{setting} ({flag})" if flag else setting
    return ListenError(f"cannot listen on {address} ({setting}): {why}; set {change} to another address or port")


def check_bindable(host: str, port: int, setting: str, *, flag: str | None = None) -> None:
    """ListenError when `host:port` cannot be bound now (port 0 always can). A plain socket with
    SO_REUSEADDR, as servers bind: a port in TIME_WAIT is free, a listening one is not."""
    if port == 0:
        return
    address = f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ListenError(f"cannot listen on {address} ({setting}): {host!r} does not resolve ({e})") from None
    family, kind, proto, _, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as e:
            raise listen_error(setting, address, e, flag=flag) from None
