"""A tiny Hugging Face hub on loopback: the few HTTP routes huggingface_hub's real client uses to resolve a
revision (model_info) and to download a file (HEAD + GET .../resolve/<rev>/<path>), with the hub's headers.

Tests point HF_ENDPOINT at it, so the client code paths (URL building, metadata headers, etag → blob,
snapshot symlinks, error mapping) are the library's own."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeRepo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit sha → path → bytes
    refs: dict[str, str] = field(default_factory=dict)  # branch/tag → commit
    lfs: set[str] = field(default_factory=set)  # paths stored in LFS (the hub reports their sha256)

    def resolve(self, rev: str) -> str | None:
        return rev if rev in self.commits else self.refs.get(rev)


class FakeHub:
    def __init__(self):
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[str] = []
        self.lie_about: dict[str, str] = {}  # path → sha256 the API reports instead of the truth
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub._serve(self, body=False)

            def do_GET(self):
                hub._serve(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def add(self, repo: str, commit: str, files: dict[str, bytes], *, lfs=(), refs=("main",)) -> None:
        entry = self.repos.setdefault(repo, FakeRepo())
        entry.commits[commit] = dict(files)
        entry.lfs |= set(lfs)
        for ref in refs:
            entry.refs[ref] = commit

    # --- routes ---

    def _serve(self, req: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(req.path).path)
        self.requests.append(f"{req.command} {path}")
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "revision":
            return self._model_info(req, "/".join(parts[2:4]), "/".join(parts[5:]), body)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(req, "/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
        self._error(req, 404, "RepoNotFound", "no route")

    def _lookup(self, req, repo: str, rev: str):
        if repo not in self.repos:
            self._error(req, 401, "RepoNotFound", "Repository Not Found")
            return None, None
        commit = self.repos[repo].resolve(rev)
        if commit is None:
            self._error(req, 404, "RevisionNotFound", "Invalid rev id")
            return None, None
        return self.repos[repo], commit

    def _model_info(self, req, repo: str, rev: str, body: bool) -> None:
        entry, commit = self._lookup(req, repo, rev)
        if entry is None:
            return
        siblings = []
        for name, data in sorted(entry.commits[commit].items()):
            sibling = {"rfilename": name, "size": len(data), "blobId": git_blob_id(data)}
            if name in entry.lfs:
                sha = self.lie_about.get(name, hashlib.sha256(data).hexdigest())
                sibling["lfs"] = {"sha256": sha, "size": len(data), "pointerSize": 134}
            siblings.append(sibling)
        payload = json.dumps(
            {
                "_id": "0" * 24,
                "id": repo,
                "modelId": repo,
                "sha": commit,
                "private": False,
                "siblings": siblings,
                "tags": [],
                "downloads": 0,
                "likes": 0,
            }
        ).encode()
        self._send(req, 200, payload, {"Content-Type": "application/json"}, body)

    def _resolve(self, req, repo: str, rev: str, name: str, body: bool) -> None:
        entry, commit = self._lookup(req, repo, rev)
        if entry is None:
            return
        data = entry.commits[commit].get(name)
        if data is None:
            self._error(req, 404, "EntryNotFound", "Entry not found")
            return
        etag = hashlib.sha256(data).hexdigest() if name in entry.lfs else git_blob_id(data)
        headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"', "Content-Type": "application/octet-stream"}
        if name in entry.lfs:
            headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))})
        self._send(req, 200, data, headers, body)

    def _error(self, req, status: int, code: str, message: str) -> None:
        payload = json.dumps({"error": message}).encode()
        self._send(
            req,
            status,
            payload,
            {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"},
            True,
        )

    @staticmethod
    def _send(req, status: int, payload: bytes, headers: dict, body: bool) -> None:
        req.send_response(status)
        for key, value in headers.items():
            req.send_header(key, value)
        req.send_header("Content-Length", str(len(payload)))
        req.end_headers()
        if body:
            req.wfile.write(payload)
