"""A real S3 API for tests: a moto server on 127.0.0.1 (the ``s3`` fixture in conftest.py), and a
proxy in front of it that cuts every connection after a given number of bytes."""

from __future__ import annotations

import logging
import socket
import threading
import uuid

import pytest


class S3:
    def __init__(self, server, endpoint: str, options: dict):
        self.server, self.endpoint, self.options = server, endpoint, options
        import s3fs

        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)

    def bucket(self) -> str:
        name = f"b-{uuid.uuid4().hex[:12]}"
        self.fs.mkdir(name)
        return name


def start_moto():
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def stop_moto(server) -> None:
    server.stop()
    server._server.server_close()  # stop() leaves the listening socket open


def s3_options(endpoint: str) -> dict:
    return {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}


class CutProxy:
    """A TCP proxy in front of the S3 server that dies (stops listening and drops every
    connection) once ``limit`` more request bytes went through: the server vanishing mid-save."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.limit = float("inf")
        self.sent = 0
        self.dead = threading.Event()
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def arm(self, more_bytes: int) -> None:
        with self._lock:
            self.limit = self.sent + more_bytes

    def _accept(self) -> None:
        while not self.dead.is_set():
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.port))
            with self._lock:
                self._conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if upstream:
                    with self._lock:
                        self.sent += len(data)
                        over = self.sent > self.limit
                    if over:
                        self.kill()
                        return
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def kill(self) -> None:
        self.dead.set()
        self.sock.close()
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass
