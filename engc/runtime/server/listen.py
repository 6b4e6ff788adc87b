"""The server's listening socket, in a module free of fastapi and torch: engc run binds it before it spawns
the engine's process or imports the server, so a port in use is one line at once."""
from __future__ import annotations

import errno
import socket

from engc.errors import UserError


def listening_socket(host: str, port: int) -> socket.socket:
    """A bound socket for (host, port), as uvicorn would bind it (SO_REUSEADDR, so a port in TIME_WAIT
    is free); UserError if the address is taken or not this machine's."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise UserError(f"--host {host}: not an address of this machine ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} on {host} is in use: give another with --port, or --port 0 "
                            "for a free one") from None
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror})") from None
    sock.set_inheritable(True)
    return sock
