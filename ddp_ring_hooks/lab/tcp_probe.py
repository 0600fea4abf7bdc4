"""Tiny TCP probes that the lab runs inside its namespaces (a script: it imports nothing of the
package, so it starts in milliseconds instead of loading torch)::

    python tcp_probe.py reachable 10.100.0.1 10.100.0.2   # prints the addresses that do not answer
    python tcp_probe.py receive 5001 4194304              # prints "ready", then takes 4 MiB
    python tcp_probe.py send 10.100.0.2 5001 4194304      # prints the seconds until all arrived

An address *answers* when a TCP connection to a closed port is refused (the host's kernel sent
a reset) or accepted; it does not when the attempt times out or the host is unreachable.
``send`` counts from the connection to the receiver's one-byte acknowledgement, sent once all
bytes arrived, so the time covers the whole transfer and not just filling the send buffer.
"""

from __future__ import annotations

import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor

_CLOSED_PORT = 9  # discard: nothing listens on it in a lab host
_CHUNK = 1 << 16


def answers(address: str, timeout: float = 1.0) -> bool:
    try:
        socket.create_connection((address, _CLOSED_PORT), timeout=timeout).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return True


def receive(port: int, nbytes: int) -> None:
    with socket.create_server(("", port)) as server:
        print("ready", flush=True)
        connection, _ = server.accept()
        with connection:
            left = nbytes
            while left > 0:
                data = connection.recv(min(_CHUNK, left))
                if not data:
                    raise SystemExit(f"the sender stopped with {left} of {nbytes} bytes still to come")
                left -= len(data)
            connection.sendall(b"!")
    print(f"received {nbytes}", flush=True)


def send(address: str, port: int, nbytes: int) -> None:
    payload = bytes(_CHUNK)
    start = time.perf_counter()
    with socket.create_connection((address, port), timeout=60) as connection:
        left = nbytes
        while left > 0:
            sent = connection.send(payload[: min(_CHUNK, left)])
            left -= sent
        if connection.recv(1) != b"!":
            raise SystemExit("the receiver closed before acknowledging")
    print(f"{time.perf_counter() - start:.6f}", flush=True)


def main(argv: list[str]) -> None:
    command, *arguments = argv
    if command == "reachable":
        with ThreadPoolExecutor(max_workers=max(1, len(arguments))) as pool:
            for address, ok in zip(arguments, pool.map(answers, arguments)):
                if not ok:
                    print(address)
    elif command == "receive":
        receive(int(arguments[0]), int(arguments[1]))
    elif command == "send":
        send(arguments[0], int(arguments[1]), int(arguments[2]))
    else:
        raise SystemExit(f"unknown probe {command!r}; use reachable, receive or send")


if __name__ == "__main__":
    main(sys.argv[1:])
