"""A bulk TCP transfer from host 0 to host 1: what rate the lab's link really carries.

Run by the lab on every host as a script (no JAX, no jaxcomp import: it starts in ~50 ms):
``python _xfer.py BYTES OUT.json``. Host 1 listens on its link address, host 0 connects, sends
``BYTES`` and waits for host 1's one-byte acknowledgement of the last one; host 0 writes
``{"bytes", "seconds", "bit_s"}`` (payload bits per second: TCP/IP and Ethernet headers, ~4% at
MTU 1500, cross the link too and are not counted). Hosts 2 and up do nothing.
"""

import json
import os
import socket
import sys
import time

PORT = 29518
CHUNK = 1 << 20


def _receive(address: str, nbytes: int) -> None:
    with socket.create_server((address, PORT)) as server:
        server.settimeout(60)
        conn, _ = server.accept()
        with conn:
            got = 0
            while got < nbytes:
                data = conn.recv(CHUNK)
                if not data:
                    raise RuntimeError(f"the sender closed after {got} of {nbytes} bytes")
                got += len(data)
            conn.sendall(b"k")


def _send(address: str, nbytes: int) -> float:
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = socket.create_connection((address, PORT), timeout=60)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with conn:
        block = b"\0" * CHUNK
        t0 = time.perf_counter()
        left = nbytes
        while left:
            left -= conn.send(block[: min(left, CHUNK)])
        if conn.recv(1) != b"k":
            raise RuntimeError("no acknowledgement from the receiver")
        return time.perf_counter() - t0


def main(argv) -> int:
    nbytes, out = int(argv[0]), argv[1]
    host = int(os.environ["JAX_PROCESS_ID"])
    addresses = os.environ["JAXCOMP_LAB_ADDRESSES"].split(",")
    if host == 1:
        _receive(addresses[1], nbytes)
    elif host == 0:
        seconds = _send(addresses[1], nbytes)
        with open(out, "w") as f:
            json.dump({"bytes": nbytes, "seconds": seconds, "bit_s": nbytes * 8 / seconds}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
