"""A TCP endpoint on 127.0.0.1 that accepts connections and never answers: a stalled proxy, a half-open
connection, a black-holed route, as a storage or hub client meets them.

    proxy = StallingProxy()                        # stalls from the start: reads every request, answers nothing
    proxy = StallingProxy(target=emulator.url)     # forwards to a real server (the GCS emulator, the hub) ...
    proxy.stall()                                  # ... until this: open connections and new ones go silent
    proxy.resume()                                 # forwarding again (held bytes are delivered)
    proxy.url                                      # http://127.0.0.1:<port>, for STORAGE_EMULATOR_HOST etc.
    proxy.stop()

Without a target every byte that arrives is read and dropped, so a client's request goes out whole and it
waits for an answer that never comes. With one, a stall holds what is in flight either way (each direction
stops at the chunk it holds); no connection is closed.
"""

from __future__ import annotations

import socket
import threading
from urllib.parse import urlsplit


class StallingProxy:
    def __init__(self, target: str | None = None):
        self.target = None if target is None else (urlsplit(target).hostname, urlsplit(target).port)
        self.flowing = threading.Event()  # set: forwarding; clear: stalled
        if target is not None:
            self.flowing.set()
        self.closed = threading.Event()
        self.sockets: list[socket.socket] = []
        self.connections = 0  # accepted so far: a test waits for its client to be stalled
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def stall(self) -> None:
        self.flowing.clear()

    def resume(self) -> None:
        if self.target is None:
            raise ValueError("a StallingProxy without a target has nothing to forward to")
        self.flowing.set()

    def stop(self) -> None:
        self.closed.set()
        self.flowing.set()  # releases the held pumps, which then see `closed`
        self.listener.close()
        for sock in list(self.sockets):
            sock.close()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:  # the listener was closed by stop()
                return
            self.connections += 1
            upstream = None if self.target is None else socket.create_connection(self.target)
            self.sockets += [client] + ([upstream] if upstream else [])
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            if upstream is not None:
                threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    def _pump(self, source: socket.socket, destination: socket.socket | None) -> None:
        """Copies `source` to `destination` while flowing; holds each chunk while stalled."""
        while True:
            try:
                data = source.recv(1 << 16)
            except OSError:
                data = b""
            if not data or self.closed.is_set():
                break
            if destination is None:  # nothing to forward to: read and drop
                continue
            self.flowing.wait()
            if self.closed.is_set():
                break
            try:
                destination.sendall(data)
            except OSError:
                break
        for sock in (source, destination):
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:  # already closed by the other pump or by stop()
                    pass
