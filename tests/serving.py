"""A ``meshplan serve`` job started by a test: ``mpiexec -n N meshplan serve PLAN --port 0``,
its address read from its first line; its processes carry a mark (``tests.jobs``), by which
the test finds what is left of it and ends it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
import uuid

from tests.conftest import REPO
from tests.jobs import command, end, marked_environment

START_SECONDS = 90


class Served:
    def __init__(self, plan_dir, ranks: int = 2, *args, failure: str | None = None, env: dict | None = None,
                 wait: bool = True):
        """``failure``: one of ``failing_command.py``'s, put in; ``wait``: for the address."""
        self.mark = uuid.uuid4().hex
        self.process = subprocess.Popen(command(ranks, "serve", plan_dir, "--port", "0", *args, failure=failure),
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        env=marked_environment(self.mark, **(env or {})), cwd=REPO,
                                        start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url = None
        self.pids: dict[int, int] = {}
        if not wait:
            return
        began = time.monotonic()
        while time.monotonic() - began < START_SECONDS:
            text = "\n".join(self.lines)
            found = re.search(r" on (http://\S+) ", text)
            if found and len(re.findall(r"^rank \d+: pid", text, re.M)) == ranks:
                self.url = found.group(1)
                self.pids = {int(r): int(p) for r, p in re.findall(r"^rank (\d+): pid (\d+)", text, re.M)}
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise AssertionError("the server did not start:\n" + "\n".join(self.lines))

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60, **kwargs)

    def metric(self, name: str, labels: str = "") -> float:
        import urllib.request

        text = urllib.request.urlopen(self.url + "/metrics", timeout=10).read().decode()
        found = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    def wait(self, timeout: float = 60) -> int:
        code = self.process.wait(timeout)
        self._reader.join(5)
        return code

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)
        end(self.mark)   # the ranks, in sessions of their own

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
