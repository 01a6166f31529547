"""Servers the scale-out tests start on localhost (a moto S3 server), and Ray workers
that fail once. Ray workers import this module: tests/ is on their PYTHONPATH."""

from __future__ import annotations

import json
import logging
import os
import signal
import uuid

from cachegraft_cli.encoding.ray.worker import FuseWriter


class LocalS3:
    """moto's S3 server (a real HTTP server, not a client mock) on 127.0.0.1, random port."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request otherwise
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.secret = f"cg-test-secret-{uuid.uuid4().hex}"  # searched for in everything written
        # the usual places credentials and endpoints come from: AWS variables and fsspec's FSSPEC_S3 config
        self.env = {"AWS_ACCESS_KEY_ID": "cg-test-key", "AWS_SECRET_ACCESS_KEY": self.secret,
                    "AWS_DEFAULT_REGION": "us-east-1", "FSSPEC_S3": json.dumps({"endpoint_url": self.endpoint})}

    def stop(self) -> None:
        self.server.stop()


class FailTwice(FuseWriter):
    """The first window an actor writes dies with its process (SIGKILL) just before its segment's
    commit.json: a half-written segment. A later window completes its segment, commit.json and all,
    then its task fails with an IO error: a complete segment that must not be listed twice.
    `<store>.crashed` and `<store>.errored` mark that each failure happened (once per job)."""

    def __init__(self, choice, store_url, options):
        super().__init__(choice, store_url, options)
        self.url = store_url

    def _once(self, what: str) -> bool:
        try:  # exclusive create: across all actors and attempts, once
            os.close(os.open(f"{self.url}.{what}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True

    def write_segment(self, chunks):
        if self._once("crashed"):
            real = self.store.loc.write_json_atomic

            def dying(rel, obj, compact=False):
                if rel.endswith("/commit.json"):
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(rel, obj, compact)

            self.store.loc.write_json_atomic = dying
        entry = super().write_segment(chunks)
        if os.path.exists(f"{self.url}.crashed") and self._once("errored"):
            raise ConnectionResetError("injected: connection reset after the segment was written")
        return entry
