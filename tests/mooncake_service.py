"""A Mooncake store for tests: ``mooncake_master`` with its HTTP metadata server on free
loopback ports, started by a test and ended by its pid.

``require_mooncake`` skips the calling test when the Mooncake wheel cannot be imported
here (the reason in the skip), unless ``HIRADIX_REQUIRE_ENGINES`` names ``mooncake``:
then it fails, as ``engine_env.require`` does for an engine an environment was built for.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from hiradix.storage.mooncake import MooncakeUnavailable, master_binary

START_TIMEOUT_S = 20.0
STARTED: list[int] = []  # every master pid these tests started, to count what outlives them


def require_mooncake() -> Path:
    """The ``mooncake_master`` binary; skips (or fails, when required) otherwise."""
    required = set(filter(None, os.environ.get("HIRADIX_REQUIRE_ENGINES", "").split(",")))
    try:
        return master_binary()
    except MooncakeUnavailable as unavailable:
        if "mooncake" in required:
            pytest.fail(f"{unavailable} [HIRADIX_REQUIRE_ENGINES={','.join(sorted(required))}]",
                        pytrace=False)
        pytest.skip(str(unavailable))


def _die_with_parent() -> None:
    """In the master's process before exec: the kernel kills it when the test process
    ends, however that ends (PR_SET_PDEATHSIG), so no master outlives a killed run."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
    except OSError:
        return False
    return True


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (``kill`` reaps, so an ended master is gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class MooncakeService:
    """One master (RPC, HTTP metadata and metrics ports on 127.0.0.1). ``kill`` ends it
    by its pid at once (SIGKILL, a crash); ``start`` again restarts it on the same ports
    with no objects (a master keeps its metadata in memory only)."""

    def __init__(self, binary: Path) -> None:
        self.binary = binary
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.log = Path(tempfile.mkstemp(prefix="mooncake-master-", suffix=".log")[1])
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def start(self) -> None:
        assert self.process is None, "already running"
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [str(self.binary), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
                 "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                 f"--http_metadata_server_port={self.http_port}",
                 "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        STARTED.append(self.process.pid)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(_listening(port) for port in (self.rpc_port, self.http_port,
                                                      self.metrics_port)):
            if self.process.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text(errors="replace")[-2000:]
                self.kill()
                raise RuntimeError(f"mooncake_master did not start on {self.master}:\n{tail}")
            time.sleep(0.02)

    def kill(self) -> None:
        """End the master by its pid (SIGKILL) and reap it. Idempotent."""
        if self.process is None:
            return
        pid, self.process = self.process.pid, None
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)

    def restart(self) -> None:
        self.kill()
        self.start()

    def wait_capacity(self, segment_bytes: int, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until the clients have mounted ``segment_bytes`` in all (after a restart
        a client mounts its segment again at its next heartbeat)."""
        deadline = time.monotonic() + timeout_s
        while self.metrics().get("master_total_capacity_bytes", 0) < segment_bytes:
            assert time.monotonic() < deadline, f"no {segment_bytes} bytes mounted"
            time.sleep(0.05)

    def metrics(self) -> dict[str, float]:
        """The master's unlabelled metrics (``master_key_count``, ``master_allocated_bytes``,
        ...) from its metrics endpoint."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as answer:
            text = answer.read().decode()
        values: dict[str, float] = {}
        for line in text.splitlines():
            parts = line.split()
            if len(parts) == 2 and not line.startswith("#") and "{" not in parts[0]:
                values[parts[0]] = float(parts[1])
        return values


@contextmanager
def mooncake_service() -> Iterator[MooncakeService]:
    """A running master, ended by its pid when the block ends, whatever ends it."""
    service = MooncakeService(require_mooncake())
    try:
        service.start()
        yield service
    finally:
        service.kill()
        service.log.unlink(missing_ok=True)
