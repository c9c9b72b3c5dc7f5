"""A Hugging Face Hub stand-in on 127.0.0.1 for the tests: the endpoints ``huggingface_hub``
calls to download (repo info, the tree listing, ``resolve`` with HEAD and ranged GET), with
the headers it checks (X-Repo-Commit, ETag, Content-Length, Content-Range, X-Error-Code).
It counts every request, can cut one response short, and serves gated repos to one token."""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    files: dict[str, bytes]
    sha: str = ""
    gated_token: str | None = None  # set: only "Bearer <token>" may read it

    def __post_init__(self):
        digest = hashlib.sha1()
        for name in sorted(self.files):
            digest.update(name.encode() + hashlib.sha256(self.files[name]).digest())
        self.sha = digest.hexdigest()


@dataclass
class HubServer:
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    cut_once: set[str] = field(default_factory=set)  # files whose next GET stops half-way

    def __enter__(self) -> "HubServer":
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub._answer(self, body=False)

            def do_GET(self):
                hub._answer(self, body=True)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # -- request handling -------------------------------------------------------------------
    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((h.command, path, h.headers.get("Range")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"]:
            return self._api(h, parts[2:])
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._file(h, "/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
        return self._error(h, 404, "EntryNotFound")

    def _repo(self, h, repo_id: str, rev: str) -> Repo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._error(h, 401, "RepoNotFound")  # as the Hub answers without a token
        if repo.gated_token and h.headers.get("Authorization") != f"Bearer {repo.gated_token}":
            return self._error(h, 401, "GatedRepo")
        if rev not in ("main", repo.sha):
            return self._error(h, 404, "RevisionNotFound")
        return repo

    def _api(self, h, rest: list[str]) -> None:
        repo_id, tail = "/".join(rest[:2]), rest[2:]
        rev = tail[1] if len(tail) >= 2 and tail[0] in ("revision", "tree") else "main"
        repo = self._repo(h, repo_id, rev)
        if repo is None:
            return
        if tail[:1] == ["tree"]:
            data = [{"type": "file", "path": name, "size": len(blob),
                     "oid": hashlib.sha1(blob).hexdigest()} for name, blob in repo.files.items()]
        else:
            data = {"id": repo_id, "sha": repo.sha, "private": False,
                    "siblings": [{"rfilename": name} for name in repo.files]}
        self._send(h, 200, json.dumps(data).encode(), {"Content-Type": "application/json"})

    def _file(self, h, repo_id: str, rev: str, name: str, body: bool) -> None:
        repo = self._repo(h, repo_id, rev)
        if repo is None:
            return
        if name not in repo.files:
            return self._error(h, 404, "EntryNotFound", {"X-Repo-Commit": repo.sha})
        blob = repo.files[name]
        headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{hashlib.sha256(blob).hexdigest()}"',
                   "Accept-Ranges": "bytes"}
        start = 0
        wanted = h.headers.get("Range")
        if body and wanted and wanted.startswith("bytes="):
            start = int(wanted[6:].split("-")[0])
            headers["Content-Range"] = f"bytes {start}-{len(blob) - 1}/{len(blob)}"
        if not body:
            return self._send(h, 200, b"", {**headers, "Content-Length": str(len(blob))},
                              head=True)
        part = blob[start:]
        if name in self.cut_once and start == 0:
            self.cut_once.discard(name)  # promise the whole file, send half, hang up
            return self._send(h, 200, part[:len(part) // 2], headers, length=len(part))
        self._send(h, 206 if start else 200, part, headers)

    @staticmethod
    def _error(h, status: int, code: str, extra: dict | None = None) -> None:
        HubServer._send(h, status, json.dumps({"error": code}).encode(),
                        {"X-Error-Code": code, "Content-Type": "application/json",
                         **(extra or {})})

    @staticmethod
    def _send(h, status: int, data: bytes, headers: dict, length: int | None = None,
              head: bool = False) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        if not head:
            h.send_header("Content-Length", str(len(data) if length is None else length))
        h.send_header("Connection", "close")
        h.end_headers()
        if not head:
            h.wfile.write(data)
        h.close_connection = True
