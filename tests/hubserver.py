"""A local stand-in for the Hugging Face hub: the endpoints huggingface_hub (and specllm) call.

`GET /api/models/{repo}[/revision/{rev}]` answers like `model_info(files_metadata=True)` (siblings
with `size`, `blobId` and `lfs: {sha256, size}`); `HEAD/GET /{repo}/resolve/{rev}/{path}` serves the
bytes with `X-Repo-Commit`, `ETag`, `X-Linked-Size` and Range support. Faults are per file: serve
other bytes than advertised (`corrupt`), fewer bytes (`truncate`), or break the connection after
some bytes (`drop`, for the next n answers). Listens on 127.0.0.1 only; `stop()` ends it.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Faults:
    corrupt: set[str] = field(default_factory=set)
    truncate: dict[str, int] = field(default_factory=dict)  # path -> bytes actually served
    drop: dict[str, tuple[int, int]] = field(default_factory=dict)  # path -> (after bytes, answers left)


class LocalHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, bytes]] = {}
        self.lfs: dict[tuple[str, str], bool] = {}
        self.faults = Faults()
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.authorizations: list[str | None] = []  # the Authorization header of each request
        self.gated: set[str] = set()
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        # shutdown() waits for the loop's next poll: at the default 0.5 s that was half a second per test
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,), name="local-hub", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def add(self, repo: str, path: str, data: bytes, *, lfs: bool = True) -> None:
        self.repos.setdefault(repo, {})[path] = data
        self.lfs[(repo, path)] = lfs

    def downloads(self, suffix: str = "") -> list[tuple[str, str, str | None]]:
        return [r for r in self.requests if r[0] == "GET" and "/resolve/" in r[1] and r[1].endswith(suffix)]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    # ---------------------------------------------------------------- answers

    def info(self, repo: str) -> dict:
        siblings = []
        for path, data in sorted(self.repos[repo].items()):
            sibling = {"rfilename": path, "size": len(data), "blobId": _git_blob_id(data)}
            if self.lfs[(repo, path)]:
                sibling["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            siblings.append(sibling)
        return {"id": repo, "modelId": repo, "sha": COMMIT, "private": False, "siblings": siblings}

    def served_bytes(self, repo: str, path: str) -> bytes:
        data = self.repos[repo][path]
        if path in self.faults.corrupt:
            data = data[:-1] + bytes([data[-1] ^ 0xFF])
        if path in self.faults.truncate:
            data = data[: self.faults.truncate[path]]
        return data

    def take_drop(self, path: str) -> int | None:
        with self.lock:
            after, left = self.faults.drop.get(path, (0, 0))
            if left <= 0:
                return None
            self.faults.drop[path] = (after, left - 1)
            return after


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _handler(hub: LocalHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self._answer(head=True)

        def do_GET(self) -> None:
            self._answer(head=False)

        def _answer(self, head: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Range")))
            hub.authorizations.append(self.headers.get("Authorization"))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                repo = "/".join(parts[2:4])
                if repo not in hub.repos:
                    return self._error(404, "RepoNotFound")
                if repo in hub.gated:
                    return self._error(403, "GatedRepo")
                if len(parts) >= 6 and parts[4] == "revision" and parts[5] not in ("main", COMMIT):
                    return self._error(404, "RevisionNotFound")
                return self._send(200, json.dumps(hub.info(repo)).encode(), {"Content-Type": "application/json"}, head)
            if len(parts) >= 5 and parts[2] == "resolve":
                repo, file = "/".join(parts[:2]), "/".join(parts[4:])
                if repo not in hub.repos:
                    return self._error(404, "RepoNotFound")
                if file not in hub.repos[repo]:
                    return self._error(404, "EntryNotFound")
                return self._file(repo, file, head)
            self._error(404, None)

        def _file(self, repo: str, file: str, head: bool) -> None:
            data = hub.served_bytes(repo, file)
            advertised = hub.repos[repo][file]
            headers = {
                "X-Repo-Commit": COMMIT,
                "ETag": f'"{hashlib.sha256(advertised).hexdigest()}"',
                "X-Linked-Size": str(len(advertised)),
                "Accept-Ranges": "bytes",
                "Content-Type": "application/octet-stream",
            }
            start, status = 0, 200
            wanted = self.headers.get("Range")
            if wanted and wanted.startswith("bytes=") and wanted.endswith("-"):
                start = int(wanted[len("bytes=") : -1])
                if start >= len(data):
                    headers["Content-Range"] = f"bytes */{len(data)}"
                    return self._send(416, b"", headers, head)
                status = 206
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            body = data[start:]
            drop = None if head else hub.take_drop(file)
            if drop is None:
                return self._send(status, body, headers, head)
            self.send_response(status)  # promise the whole body, send part of it, hang up
            for key, value in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body[: max(0, drop - start)])
            self.wfile.flush()
            self.close_connection = True

        def _error(self, status: int, code: str | None) -> None:
            headers = {"Content-Type": "application/json"}
            if code:
                headers["X-Error-Code"] = code
            self._send(status, json.dumps({"error": code or "not found"}).encode(), headers, False)

        def _send(self, status: int, body: bytes, headers: dict[str, str], head: bool) -> None:
            self.send_response(status)
            for key, value in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(key, value)
            self.end_headers()
            if not head:
                self.wfile.write(body)

    return Handler
