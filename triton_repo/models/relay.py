"""Cancellation relay from postprocessing to v4_generate.

A Triton ensemble does not cancel a step that is already running (triton-inference-server/server#6739, still so
in 2.51): when a client cancels a stream (gRPC `cancel_requests=True`, or it closes an HTTP generate_stream),
v4_generate's request never reports `is_cancelled()`. The steps the ensemble creates afterwards do: that is the
postprocessing request of v4_generate's next response. So each response carries a key naming its request and the
v4_generate instance that serves it; postprocessing, seeing its request cancelled, sends that key in a datagram
to the instance's abstract UNIX socket (Linux; no file), and the instance cancels the request in its scheduler.
"""
from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Callable


class CancelRelay:
    """The receiving end, one per v4_generate instance: calls `on_cancel(request_key)` on its own thread."""

    def __init__(self, on_cancel: Callable[[str], None]):
        self.name = f"v4engine-cancel-{uuid.uuid4().hex}"
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind("\0" + self.name)
        self._on_cancel = on_cancel
        threading.Thread(target=self._receive, name="v4engine-cancel-relay", daemon=True).start()

    def key(self, request_key: str) -> bytes:
        """What a response carries so that postprocessing can relay its cancellation."""
        return f"{self.name}/{request_key}".encode()

    def _receive(self) -> None:
        while True:
            try:
                data = self._socket.recv(512)
            except OSError:
                return
            if not data:                          # shut down by close()
                return
            self._on_cancel(data.decode())

    def close(self) -> None:
        self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()


def relay_cancel(key: bytes) -> None:
    """Tell the v4_generate instance named in `key` that its request was cancelled (no-op if it is gone)."""
    name, _, request_key = key.decode().partition("/")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        try:
            s.sendto(request_key.encode(), "\0" + name)
        except OSError:
            pass
