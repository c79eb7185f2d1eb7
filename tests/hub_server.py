"""A local stand-in for the Hugging Face hub, so tests run huggingface_hub's real client with no network.

It serves the endpoints `snapshot_download` and `hf_hub_download` call, for models and datasets:
the revision info (`/api/{models,datasets}/<repo>/revision/<rev>`), the recursive file tree
(`/api/.../tree/<rev>`) and the files (`[/datasets]/<repo>/resolve/<rev>/<file>`, with the X-Repo-Commit,
ETag and Content-Length headers the client requires). Unknown repositories, revisions and files answer as
the hub does (404 with X-Error-Code), so the client raises its own errors.

    hub = start_hub()                                   # a thread on 127.0.0.1, a free port
    commit = hub.add("model", "owner/name", folder)     # a commit of the folder's files on branch main
    use_hub(monkeypatch, hub.url, tmp_path / "hf")      # this process: env and huggingface_hub.constants
    subprocess.run(..., env={**os.environ, **hub_env(hub.url, home)})   # a subprocess: env only
    hub.stop()
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import pyarrow
import pyarrow.parquet

from comppo_jax.data.datasets import DAPO_TEMPLATE


class HubServer:
    def __init__(self):
        self.repos: dict[tuple[str, str], dict] = {}  # (type, id) -> {"refs": {branch: commit}, "commits": {..}}
        self.requests: list[str] = []  # "METHOD path" of every request, in order
        self.hold_download: tuple[str, int, int] | None = None  # hold()'s (file, HEADs, from request index)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def add(self, repo_type: str, repo_id: str, folder, branch: str = "main") -> str:
        """Commits every file under `folder` to `branch` of repository `repo_id` ("model" or "dataset"
        type); returns the commit's 40-hex sha (the same files give the same commit)."""
        files = {}
        for root, _, names in os.walk(folder):
            for name in names:
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    files[os.path.relpath(path, folder).replace(os.sep, "/")] = f.read()
        digest = hashlib.sha1(repo_id.encode())
        for path in sorted(files):
            digest.update(path.encode() + b"\0" + hashlib.sha1(files[path]).digest())
        commit = digest.hexdigest()
        repo = self.repos.setdefault((repo_type, repo_id), {"refs": {}, "commits": {}})
        repo["commits"][commit], repo["refs"][branch] = files, commit
        return commit

    def hold(self, path: str, heads: int) -> None:
        """From now on a download of `path` waits (up to a minute) until `heads` HEADs of it have arrived
        since this call, so processes fetching it at once overlap however the machine schedules them."""
        self.hold_download = (path, heads, len(self.requests))

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def start_hub() -> HubServer:
    return HubServer()


def write_dapo(folder, problems: int) -> None:
    """A DAPO-Math parquet file in `folder`/data (each problem twice, as the release repeats them) and a card."""
    rows = [
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": DAPO_TEMPLATE.format(problem=f"what is {i} + 1 ?")}],
            "reward_model": {"ground_truth": str(i + 1), "style": "rule-lang"},
        }
        for i in range(problems)
    ]
    os.makedirs(folder / "data")
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows * 2), str(folder / "data" / "dapo-math-17k.parquet"))
    (folder / "README.md").write_text("a dataset card")


def hub_env(url: str, home) -> dict[str, str]:
    """Environment variables pointing a process's huggingface_hub at the server, caching under `home`."""
    return {"HF_ENDPOINT": url, "HF_HOME": str(home), "HF_HUB_CACHE": os.path.join(str(home), "hub")}


def use_hub(monkeypatch, url: str, home, offline: bool = False) -> None:
    """Points this process's huggingface_hub at the server (cache under `home`): it read the environment into
    `huggingface_hub.constants` when first imported, so those are patched as well as the variables."""
    from huggingface_hub import constants

    for name, value in hub_env(url, home).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", os.path.join(str(home), "hub"))
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", os.path.join(str(home), ".agent_harnesses.json"))
    set_offline(monkeypatch, offline)


def set_offline(monkeypatch, offline: bool) -> None:
    """HF_HUB_OFFLINE for this process (variable and constant) and its subprocesses."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)


def _handler(hub: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet: hub.requests records them
            pass

        def do_HEAD(self):
            self._serve(body=False)

        def do_GET(self):
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            hub.requests.append(f"{self.command} {self.path}")
            # Split before unquoting: a revision is quoted whole (refs%2Fpr%2F1 is one segment).
            parts = urlsplit(self.path).path.strip("/").split("/")
            if parts[0] == "api" and len(parts) >= 4 and parts[1] in ("models", "datasets"):
                self._api(parts[1][:-1], f"{parts[2]}/{parts[3]}", parts[4:], body)
                return
            repo_type = "dataset" if parts[0] == "datasets" else "model"
            parts = parts[1:] if repo_type == "dataset" else parts
            if len(parts) >= 5 and parts[2] == "resolve":
                self._file(repo_type, f"{parts[0]}/{parts[1]}", unquote(parts[3]), unquote("/".join(parts[4:])), body)
            else:
                self._reply(404, {"error": "not found"}, body)

        def _commit(self, repo_type: str, repo_id: str, revision: str, body: bool):
            """(commit, files), or None having answered the hub's 404."""
            repo = hub.repos.get((repo_type, repo_id))
            if repo is None:
                self._reply(404, {"error": "Repository not found"}, body, {"X-Error-Code": "RepoNotFound"})
                return None
            commit = revision if revision in repo["commits"] else repo["refs"].get(revision)
            if commit is None:
                self._reply(404, {"error": "Invalid rev id"}, body, {"X-Error-Code": "RevisionNotFound"})
                return None
            return commit, repo["commits"][commit]

        def _api(self, repo_type: str, repo_id: str, rest: list[str], body: bool) -> None:
            revision = unquote(rest[1]) if len(rest) >= 2 else "main"
            found = self._commit(repo_type, repo_id, revision, body)
            if found is None:
                return
            commit, files = found
            if rest and rest[0] == "tree":
                tree = [
                    {"type": "file", "path": path, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for path, data in sorted(files.items())
                ]
                self._reply(200, tree, body)
            else:
                info = {"id": repo_id, "sha": commit, "siblings": [{"rfilename": path} for path in sorted(files)]}
                self._reply(200, info, body)

        def _file(self, repo_type: str, repo_id: str, revision: str, path: str, body: bool) -> None:
            found = self._commit(repo_type, repo_id, revision, body)
            if found is None:
                return
            commit, files = found
            if path not in files:
                headers = {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit}
                self._reply(404, {"error": "Entry not found"}, body, headers)
                return
            data = files[path]
            etag = f'"{hashlib.sha1(data).hexdigest()}"'
            if body:
                if hub.hold_download is not None and path == hub.hold_download[0]:
                    _, heads, since = hub.hold_download
                    deadline = time.time() + 60
                    while time.time() < deadline and self._heads(path, since) < heads:
                        time.sleep(0.01)
            self._send(200, data, body, {"X-Repo-Commit": commit, "ETag": etag}, "application/octet-stream")

        def _heads(self, path: str, since: int) -> int:
            return sum(request.startswith("HEAD ") and request.endswith("/" + path) for request in hub.requests[since:])

        def _reply(self, status: int, payload, body: bool, headers: dict | None = None) -> None:
            self._send(status, json.dumps(payload).encode(), body, headers or {}, "application/json")

        def _send(self, status: int, data: bytes, body: bool, headers: dict, content_type: str) -> None:
            self.send_response(status)
            for name, value in {**headers, "Content-Type": content_type, "Content-Length": str(len(data))}.items():
                self.send_header(name, value)
            self.end_headers()
            if body:
                self.wfile.write(data)

    return Handler
