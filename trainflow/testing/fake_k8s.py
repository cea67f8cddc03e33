"""A fake Kubernetes API server on loopback: just enough of ``/api/v1`` pods (create, list
by label, read, log, patch, delete) for the cncf-kubernetes provider's
``KubernetesPodOperator`` to run a pod to its end. There is no cluster on these machines;
this stands in for the API server only, and records every call for the tests.

A created pod is reported finished at once: ``Succeeded`` with exit code 0, or ``Failed``
with ``exit_code`` when one is set.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse


class FakeKubernetesAPI:
    def __init__(self, *, exit_code: int = 0, log: str = "node agent finished\n") -> None:
        self.exit_code, self.log = exit_code, log
        self.pods: dict[str, dict] = {}
        self.calls: list[tuple[str, str, object]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                return

            def _send(self, code: int, obj, ctype: str = "application/json") -> None:
                body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _body(self):
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n)) if n else None

            def do_GET(self) -> None:
                url = urlparse(self.path)
                api.calls.append(("GET", url.path, url.query))
                name = url.path.rstrip("/").split("/")[-1]
                if url.path.endswith("/log"):
                    return self._send(200, api.log.encode(), "text/plain")
                if name == "pods":
                    return self._send(
                        200,
                        {
                            "kind": "PodList",
                            "apiVersion": "v1",
                            "metadata": {},
                            "items": [api._status(n) for n in api.pods],
                        },
                    )
                if name in api.pods:
                    return self._send(200, api._status(name))
                return self._send(404, {"kind": "Status", "code": 404, "reason": "NotFound"})

            def do_POST(self) -> None:
                body = self._body()
                api.calls.append(("POST", self.path, body))
                body.setdefault("metadata", {})["uid"] = f"uid-{len(api.pods)}"
                api.pods[body["metadata"]["name"]] = body
                return self._send(201, body)

            def do_PATCH(self) -> None:
                body = self._body()
                api.calls.append(("PATCH", self.path, body))
                name = urlparse(self.path).path.rstrip("/").split("/")[-1]
                labels = ((body or {}).get("metadata") or {}).get("labels") or {}
                api.pods[name]["metadata"].setdefault("labels", {}).update(labels)
                return self._send(200, api._status(name))

            def do_DELETE(self) -> None:
                api.calls.append(("DELETE", self.path, None))
                api.pods.pop(urlparse(self.path).path.rstrip("/").split("/")[-1], None)
                return self._send(200, {"kind": "Status", "status": "Success"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def _status(self, name: str) -> dict:
        pod = self.pods[name]
        ok = self.exit_code == 0
        container = pod["spec"]["containers"][0]["name"]
        pod["status"] = {
            "phase": "Succeeded" if ok else "Failed",
            "startTime": "2026-12-03T10:00:00Z",
            "containerStatuses": [
                {
                    "name": container,
                    "ready": False,
                    "restartCount": 0,
                    "image": "x",
                    "imageID": "x",
                    "state": {
                        "terminated": {
                            "exitCode": self.exit_code,
                            "reason": "Completed" if ok else "Error",
                            "startedAt": "2026-12-03T10:00:00Z",
                            "finishedAt": "2026-12-03T10:00:05Z",
                        }
                    },
                }
            ],
        }
        return pod

    def kubeconfig(self, path: Path) -> Path:
        port = self.server.server_address[1]
        path.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "fake",
                    "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                    "users": [{"name": "fake", "user": {"token": "fake"}}],
                    "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                }
            )
        )
        return path

    def __enter__(self) -> "FakeKubernetesAPI":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
