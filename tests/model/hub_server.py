"""A local stand-in for the Hugging Face Hub's file routes, serving one model repo.

``huggingface_hub.snapshot_download`` (the version installed with the tests, read from
its source: _snapshot_download.py, file_download.py, hf_api.py, utils/_http.py) makes
exactly these requests for a branch or tag revision, and nothing else when no file is
Xet-backed:

1. ``GET /api/models/{repo}/revision/{rev}`` (``HfApi.repo_info``): the JSON's ``sha``
   is the commit the revision points to;
2. ``GET /api/models/{repo}/tree/{commit}?recursive=True&expand=False``
   (``HfApi.list_repo_tree``): a JSON list of ``{"type": "file", "path", "size", "oid",
   "lfs"}``; one page, since no ``Link: rel="next"`` header is sent. The
   ``allow_patterns`` are matched against these paths;
3. ``HEAD /{repo}/resolve/{commit}/{path}`` (``get_hf_file_metadata``): the headers
   ``X-Repo-Commit`` (required), ``ETag`` (required; the blob's name in the cache) and
   ``Content-Length`` (the expected size);
4. ``GET /{repo}/resolve/{commit}/{path}``: the bytes.

Errors are told apart by the ``X-Error-Code`` header (``hf_raise_for_status``):
``RepoNotFound`` (404), ``GatedRepo`` (403) and ``RevisionNotFound`` (404). No
``xetHash`` in the tree and no ``X-Xet-Hash`` header keeps every download on plain HTTP.
So these routes suffice for everything nbengine asks of the Hub. The server records
each request, so a test can assert which files were fetched.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


def _git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubRepo:
    """One model repo: its files (name -> bytes) at one commit, under branch ``main``."""

    def __init__(
        self,
        repo_id: str,
        files: dict[str, bytes],
        commit: str = "c0ffee" * 6 + "beef",
        gated: bool = False,
    ) -> None:
        self.repo_id = repo_id
        self.files = files
        self.commit = commit
        self.gated = gated

    def etag(self, name: str) -> str:
        data = self.files[name]
        lfs = name.endswith((".safetensors", ".bin"))
        return hashlib.sha256(data).hexdigest() if lfs else _git_blob_sha1(data)

    def tree(self) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for name, data in sorted(self.files.items()):
            entry: dict[str, object] = {
                "type": "file",
                "path": name,
                "size": len(data),
                "oid": _git_blob_sha1(data),
            }
            if name.endswith((".safetensors", ".bin")):
                entry["lfs"] = {
                    "oid": hashlib.sha256(data).hexdigest(),
                    "size": len(data),
                    "pointerSize": 134,
                }
            out.append(entry)
        return out


class _Handler(BaseHTTPRequestHandler):
    server: _HubServer

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def _error(self, status: int, code: str) -> None:
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        body = json.dumps({"error": code}).encode()
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj: object) -> None:
        body = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _repo(self, repo_id: str) -> HubRepo | None:
        repo = self.server.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound")
        elif repo.gated:
            self._error(403, "GatedRepo")
            return None
        return repo

    def _commit(self, repo: HubRepo, rev: str) -> str | None:
        if rev in ("main", repo.commit):
            return repo.commit
        self._error(404, "RevisionNotFound")
        return None

    def _handle(self) -> None:
        path = unquote(urlsplit(self.path).path)
        self.server.log.append((self.command, path))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            repo = self._repo("/".join(parts[2:4]))
            if repo is None:
                return
            commit = self._commit(repo, parts[5])
            if commit is None:
                return
            if parts[4] == "revision":
                self._json(
                    {
                        "id": repo.repo_id,
                        "sha": commit,
                        "private": False,
                        "gated": False,
                        "siblings": [{"rfilename": n} for n in repo.files],
                    }
                )
                return
            if parts[4] == "tree":
                self._json(repo.tree())
                return
        if len(parts) >= 5 and parts[2] == "resolve":
            repo = self._repo("/".join(parts[:2]))
            if repo is None:
                return
            commit = self._commit(repo, parts[3])
            if commit is None:
                return
            name = "/".join(parts[4:])
            if name not in repo.files:
                self._error(404, "EntryNotFound")
                return
            data = repo.files[name]
            self.send_response(200)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{repo.etag(name)}"')
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(data)
            return
        self._error(404, "RepoNotFound")

    do_GET = _handle
    do_HEAD = _handle


class _HubServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, repos: dict[str, HubRepo]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.repos = repos
        self.log: list[tuple[str, str]] = []


@contextmanager
def serve_hub(*repos: HubRepo) -> Iterator[_HubServer]:
    """Serve ``repos`` on 127.0.0.1 (a free port) until the block ends; yields the server
    (``server.server_address``, ``server.log`` of ``(method, path)``)."""
    server = _HubServer({r.repo_id: r for r in repos})
    thread = threading.Thread(target=server.serve_forever, name="test-hub", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def repo_from_dir(
    repo_id: str, model_dir: Path, extra: dict[str, bytes] | None = None, **kwargs: object
) -> HubRepo:
    """A HubRepo holding the files of ``model_dir`` plus ``extra`` files."""
    files = {p.name: p.read_bytes() for p in sorted(model_dir.iterdir()) if p.is_file()}
    files.update(extra or {})
    return HubRepo(repo_id, files, **kwargs)  # type: ignore[arg-type]
