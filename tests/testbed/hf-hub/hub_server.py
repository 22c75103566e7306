"""TEST STAND-IN for the Hugging Face Hub: serves one private model repository to ``snapshot_download``.

The testbed cannot reach huggingface.co, yet the vllm role must be tested downloading weights at a pinned
revision with a token. This server implements only the HTTP calls ``huggingface_hub`` 2.4.0 (the version
pinned in tests/testbed/engine/requirements.txt, i.e. inside the engine image whose ``hf download`` the
role runs) makes for ``snapshot_download(repo_id, revision=<40-hex commit>)``, read from that version's
source (``_snapshot_download.py``, ``file_download.py``, ``hf_api.py``, ``utils/_http.py``):

* ``GET /api/models/{repo}/tree/{revision}?recursive=True&expand=False`` -> JSON list of
  ``{"type": "file", "path", "size", "oid", "lfs"?}`` (``RepoFile``; one page, no ``Link`` header).
  With a commit hash as revision, snapshot_download skips ``repo_info`` and lists the tree directly.
* ``GET /api/models/{repo}/revision/{revision}`` -> ``{"id", "sha", "siblings", "private"}``
  (``repo_info``; used when the revision is a branch name such as ``main``).
* ``HEAD|GET /{repo}/resolve/{revision}/{path}`` -> the file, with ``X-Repo-Commit``, ``ETag`` (git blob
  sha1; for LFS files the sha256, also in ``X-Linked-Etag``/``X-Linked-Size``) and ``Content-Length``
  (``get_hf_file_metadata``); ``Range: bytes=N-`` is honoured (``http_get`` resumes with it).
* Errors the client maps to exceptions through ``X-Error-Code``: no or wrong token -> 401
  ``RepoNotFound`` (a private repo), unknown revision -> 404 ``RevisionNotFound``, unknown file -> 404
  ``EntryNotFound``.

Every Hub call requires ``Authorization: Bearer <token>``, the token being the content of
``--token-file`` (read on every request, compared in constant time). Xet storage is not offered: no
``xetHash`` in the tree and no ``X-Xet-Hash`` header, so the client falls back to plain HTTP downloads.
``GET /_testbed/stats`` (no token) returns request counters so tests can prove that nothing was fetched.
Logs one line per request on stderr, never a header value.

Usage: hub_server.py --root DIR --repo OWNER/NAME --revision SHA40 --token-file PATH [--port 80]
  DIR/OWNER/NAME/ holds the repository's files (flat or nested).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import re
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

# Files git-lfs tracks on the real Hub (its default .gitattributes covers *.safetensors, *.bin, ...).
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx")
CHUNK = 1 << 20


def git_blob_sha1(data: bytes) -> str:
    """Git's object id of a blob: sha1 of ``b"blob <len>\\0" + data`` (git's object format)."""
    return hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    """The git-lfs pointer file git stores instead of a large file (git-lfs spec v1)."""
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


class Repo:
    """One repository at one commit: path -> metadata, computed once at start-up."""

    def __init__(self, root: Path, repo_id: str, revision: str) -> None:
        if not re.fullmatch(r"[0-9a-f]{40}", revision):
            raise SystemExit(f"--revision must be a 40-hex commit id, got {revision!r}")
        self.repo_id = repo_id
        self.revision = revision
        self.dir = (root / repo_id).resolve()
        if not self.dir.is_dir():
            raise SystemExit(f"no repository directory {self.dir}")
        self.files: dict[str, dict] = {}
        for path in sorted(p for p in self.dir.rglob("*") if p.is_file()):
            rel = path.relative_to(self.dir).as_posix()
            data = path.read_bytes()
            entry: dict = {"type": "file", "path": rel, "size": len(data), "local": path}
            if rel.endswith(LFS_SUFFIXES):
                sha256 = hashlib.sha256(data).hexdigest()
                pointer = lfs_pointer(sha256, len(data))
                entry["oid"] = git_blob_sha1(pointer)
                entry["lfs"] = {"oid": sha256, "size": len(data), "pointerSize": len(pointer)}
                entry["etag"] = sha256
            else:
                entry["oid"] = entry["etag"] = git_blob_sha1(data)
            self.files[rel] = entry

    def resolve(self, revision: str) -> str | None:
        """The commit a revision names: the commit itself or the default branch ``main``."""
        return self.revision if revision in (self.revision, "main") else None

    def tree(self) -> list[dict]:
        """The recursive tree listing: every file (folders omitted; snapshot_download keeps files only)."""
        return [{k: v for k, v in e.items() if k not in ("local", "etag")} for e in self.files.values()]


class Handler(BaseHTTPRequestHandler):
    """Routes the Hub API subset above; one instance per request."""

    server_version = "teamserve-testbed-hf-hub/1"
    repo: Repo
    token_file: Path
    stats: dict[str, int]
    lock = threading.Lock()

    # --- plumbing ------------------------------------------------------------------------------------
    def log_message(self, format: str, *args) -> None:  # noqa: A002 - BaseHTTPRequestHandler's signature
        sys.stderr.write(f"hf-hub {self.address_string()} {format % args}\n")

    def count(self, key: str) -> None:
        with self.lock:
            self.stats[key] = self.stats.get(key, 0) + 1

    def send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
             content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def error(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        self.send(status, json.dumps({"error": message}).encode(),
                  {"X-Error-Code": code, "X-Error-Message": message, **(headers or {})})

    def authorized(self) -> bool:
        """True when the request carries the expected bearer token (401 sent otherwise)."""
        expected = self.token_file.read_text().strip()
        header = self.headers.get("Authorization", "")
        given = header[7:].strip() if header.lower().startswith("bearer ") else ""
        if expected and given and hmac.compare_digest(given.encode(), expected.encode()):
            return True
        self.count("unauthorized")
        if given:
            # The Hub's wording for a bad token; huggingface_hub does not map it to RepoNotFound.
            self.send(HTTPStatus.UNAUTHORIZED, b'{"error": "Invalid credentials in Authorization header"}',
                      {"X-Error-Message": "Invalid credentials in Authorization header"})
        else:
            self.error(HTTPStatus.UNAUTHORIZED, "RepoNotFound",
                       "Repository not found (a private repository needs a token)")
        return False

    # --- routes --------------------------------------------------------------------------------------
    def do_HEAD(self) -> None:  # noqa: N802 - http.server naming
        self.route()

    def do_GET(self) -> None:  # noqa: N802
        self.route()

    def route(self) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        if path == "/_testbed/stats":
            with self.lock:
                body = json.dumps(self.stats, sort_keys=True).encode()
            self.send(HTTPStatus.OK, body)
            return
        repo = self.repo.repo_id
        api = re.fullmatch(r"/api/models/(.+?)/(tree|revision)/([^/]+)(/.*)?", path)
        resolve = re.fullmatch(r"/(.+?)/resolve/([^/]+)/(.+)", path)
        if api and api.group(1) == repo:
            if not self.authorized():
                return
            commit = self.repo.resolve(api.group(3))
            if commit is None:
                self.error(HTTPStatus.NOT_FOUND, "RevisionNotFound", f"Invalid rev id: {api.group(3)}")
            elif api.group(2) == "tree":
                self.count("tree")
                prefix = (api.group(4) or "").strip("/")
                entries = [e for e in self.repo.tree() if not prefix or e["path"].startswith(prefix + "/")]
                if parse_qs(url.query).get("recursive", ["false"])[0].lower() != "true":
                    entries = [e for e in entries if "/" not in e["path"][len(prefix) + 1 if prefix else 0:]]
                self.send(HTTPStatus.OK, json.dumps(entries).encode())
            else:
                self.count("repo_info")
                info = {"id": repo, "modelId": repo, "sha": commit, "private": True,
                        "siblings": [{"rfilename": p} for p in self.repo.files]}
                self.send(HTTPStatus.OK, json.dumps(info).encode())
        elif resolve and resolve.group(1) == repo:
            if not self.authorized():
                return
            self.serve_file(resolve.group(2), resolve.group(3))
        else:
            self.count("not_found")
            self.error(HTTPStatus.NOT_FOUND, "RepoNotFound", f"Repository not found: {path}")

    def serve_file(self, revision: str, filename: str) -> None:
        commit = self.repo.resolve(revision)
        if commit is None:
            self.error(HTTPStatus.NOT_FOUND, "RevisionNotFound", f"Invalid rev id: {revision}")
            return
        entry = self.repo.files.get(filename)
        if entry is None:
            self.error(HTTPStatus.NOT_FOUND, "EntryNotFound", f"{filename} does not exist at {commit}",
                       {"X-Repo-Commit": commit})
            return
        size = entry["size"]
        headers = {"X-Repo-Commit": commit, "ETag": f'"{entry["etag"]}"', "Accept-Ranges": "bytes"}
        if "lfs" in entry:
            headers.update({"X-Linked-Etag": f'"{entry["etag"]}"', "X-Linked-Size": str(size)})
        start = 0
        match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
        if match and int(match.group(1)) < size:
            start = int(match.group(1))
            headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
        self.count("head" if self.command == "HEAD" else "download")
        self.send_response(HTTPStatus.PARTIAL_CONTENT if start else HTTPStatus.OK)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(size - start))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command == "HEAD":
            return
        with entry["local"].open("rb") as fh:
            fh.seek(start)
            while chunk := fh.read(CHUNK):
                self.wfile.write(chunk)


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, index the repository and serve until killed."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--repo", required=True)
    parser.add_argument("--revision", required=True)
    parser.add_argument("--token-file", type=Path, required=True)
    parser.add_argument("--port", type=int, default=80)
    args = parser.parse_args(argv)
    Handler.repo = Repo(args.root, args.repo, args.revision)
    Handler.token_file = args.token_file
    Handler.stats = {}
    if not args.token_file.read_text().strip():
        raise SystemExit(f"{args.token_file} is empty")
    server = ThreadingHTTPServer(("", args.port), Handler)
    sys.stderr.write(f"hf-hub serving {args.repo}@{args.revision} ({len(Handler.repo.files)} files) "
                     f"on :{args.port}\n")
    server.serve_forever()


if __name__ == "__main__":
    main()
