"""Cancellation relay from postprocessing to v4_generate.

A Triton ensemble does not cancel a step that is already running (triton-inference-server/server#6739, still so
in 2.51): when a client cancels a stream (gRPC `cancel_requests=True`, or it closes an HTTP generate_stream),
v4_generate's request never reports `is_cancelled()`. The steps the ensemble creates afterwards do: that is the
postprocessing request of v4_generate's next response. So each response carries a cancel key naming its request
and the v4_generate instance that serves it; postprocessing, seeing its request cancelled, sends the key's secret
in a datagram to the instance's socket, and the instance cancels the request in its scheduler.

The channel is the server's own, not the machine's:
- the socket is a file in a folder that only the server's user may enter (mkdtemp makes it 0700), not a name in
  the abstract namespace, which any local process can reach;
- a request's secret is 128 random bits, so a process that reaches the socket anyway cannot guess one; the key
  is an internal tensor of the ensemble (a client that calls v4_generate directly sees its own requests' keys);
- whatever arrives (empty, oversized, not UTF-8, unknown), the receiving thread drops it and goes on reading;
- the sender never waits: a receiver whose queue is full, or that is gone, loses the datagram, not the model.
"""
from __future__ import annotations

import logging
import re
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

FOLDER_PREFIX = "v4engine-cancel-"
FOLDER_NAME = re.compile(rb"v4engine-cancel-[a-z0-9_]{1,32}")     # what mkdtemp makes; nothing else is sent to
SOCKET_NAME = "socket"
MAX_SOCKET_PATH = 107            # sun_path holds 108 bytes with the terminating NUL
SECRET_BYTES = 16
DATAGRAM_BYTES = 256             # more than a secret; a longer datagram arrives cut and matches nothing

log = logging.getLogger(__name__)


def socket_path(folder_name: str, temp_dir: str | None = None) -> Path:
    """Where the instance whose folder is `folder_name` listens; every process of one server shares TMPDIR."""
    return Path(temp_dir or tempfile.gettempdir()) / folder_name / SOCKET_NAME


class CancelRelay:
    """The receiving end, one per v4_generate instance: a request registered with `listening(on_cancel)` gets a
    cancel key, and a datagram holding that key's secret calls `on_cancel()` on the relay's thread."""

    def __init__(self, temp_dir: str | None = None):
        self.folder = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX, dir=temp_dir))
        self.path = socket_path(self.folder.name, str(self.folder.parent))
        if len(str(self.path).encode()) > MAX_SOCKET_PATH:
            self.folder.rmdir()
            raise OSError(f"{self.path}: longer than the {MAX_SOCKET_PATH} bytes a UNIX socket path may have; "
                          f"set TMPDIR to a shorter folder")
        self._callbacks: dict[bytes, Callable[[], None]] = {}
        self._closed = False
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind(str(self.path))
        self._thread = threading.Thread(target=self._receive, name="v4engine-cancel-relay", daemon=True)
        self._thread.start()

    @contextmanager
    def listening(self, on_cancel: Callable[[], None]) -> Iterator[bytes]:
        """The cancel key of a request in flight (a response carries it), valid until the `with` ends."""
        secret = secrets.token_hex(SECRET_BYTES).encode()
        self._callbacks[secret] = on_cancel
        try:
            yield self.folder.name.encode() + b"/" + secret
        finally:
            del self._callbacks[secret]

    def _receive(self) -> None:
        while True:
            try:
                data = self._socket.recv(DATAGRAM_BYTES)
            except OSError:
                if self._closed:
                    return
                time.sleep(0.05)                 # a lasting error must not spin this thread
                continue
            if self._closed:
                return
            callback = self._callbacks.get(data)
            if callback is None:                 # unknown, late (the request ended) or malformed: nothing to do
                continue
            try:
                callback()
            except Exception as e:               # noqa: BLE001 - one bad cancellation must not end the relay
                log.warning("v4engine cancel relay: %s: %s", type(e).__name__, e)

    def close(self) -> None:
        """Stop the thread, close the socket and remove its folder."""
        self._closed = True
        self._socket.shutdown(socket.SHUT_RDWR)   # wakes the thread's recv
        self._thread.join(5)
        self._socket.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def relay_cancel(key: bytes, temp_dir: str | None = None) -> bool:
    """Tell the v4_generate instance named in `key` that its request was cancelled; True if the datagram left.

    Never blocks and never raises: a key that does not name a relay folder is not sent anywhere, and a receiver
    that is gone or whose queue is full loses the datagram."""
    folder, _, secret = key.partition(b"/")
    if not FOLDER_NAME.fullmatch(folder) or not secret:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.setblocking(False)
        try:
            s.sendto(secret, str(socket_path(folder.decode(), temp_dir)))
        except OSError:                          # BlockingIOError: full; FileNotFoundError, ConnectionRefused: gone
            return False
    return True
