"""Start the Triton Inference Server that the nvidia-pytriton wheel bundles, on a model repository.

The wheel `nvidia-pytriton==0.7.0` carries a complete tritonserver 2.51 with only the Python backend, which is
what our repository needs on a CPU. It lives in a serving environment of its own (`.venv-triton`, made by
`make triton-env`) because the 2.51 Python-backend stub needs numpy < 2. Serving from it takes four things, all
done here so that the tests and the example start the server the same way:
- a backend folder holding the wheel's Python backend plus the stub built for that environment's Python
  (links, not copies; PyTriton does the same);
- LD_LIBRARY_PATH with the wheel's bundled libraries and the environment's libpython folder, and PATH with the
  environment's bin folder first: the stub's embedded interpreter finds its environment through PATH;
- HTTP, gRPC and metrics on free loopback ports chosen here (Triton refuses port 0);
- `--exit-timeout-secs`, so that a stop does not wait 30 s for a request still open.

A server leaves nothing running and nothing in /dev/shm once stopped, however its launcher ends:
- it runs in a process group of its own with its Python-backend stubs; stop() sends SIGTERM, and the whole
  group gets SIGKILL if tritonserver outlives its exit timeout, or a stub outlives tritonserver, by 10 s;
- its stubs' shared-memory regions carry a prefix of this server's own (the Python backend's
  `shm-region-prefix-name`), so stop() removes what a killed stub left in /dev/shm, and only that;
- tritonserver gets SIGTERM when the thread that started it dies (PR_SET_PDEATHSIG), even by SIGKILL: start a
  server from a thread that lives as long as it, the main thread in a launcher; a tritonserver that then exits
  with streams still live leaves its stubs behind, and each stub ends itself and the group when it sees its
  parent gone, removing the server's regions and temporary folder first (`die_with_server`); a stub does the
  same when the launcher has been gone for the exit timeout and 10 s more (a tritonserver stuck in its shutdown,
  which stop() would have killed then);
- its temporary files, the cancel relay's socket among them (models/relay.py), go to a 0700 folder of its own
  in the system's temporary folder (not under work_dir: a UNIX socket's path must fit in 107 bytes), removed at
  stop (a launcher killed outright leaves it behind, with tritonserver's `.ses` file, the relay's socket gone).

    with TritonServer("out/triton-repo", env=".venv-triton") as server:
        print(server.http_url, server.grpc_url, server.metrics_url)
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import re
import secrets
import select
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from v4engine.contract.errors import V4EngineError

HOST = "127.0.0.1"
SHM = Path("/dev/shm")
SHM_PREFIX_ENV = "V4ENGINE_SHM_PREFIX"  # the stubs learn the server's shared-memory prefix from it
LAUNCHER_ENV = "V4ENGINE_LAUNCHER"      # "<pid> <seconds>": the launcher, and how long a stub outlives it at most
TEMP_PREFIX = "v4engine-triton-"        # of a server's own temporary folder (its TMPDIR)
SHM_PREFIX = re.compile(r"v4engine-triton-[0-9a-f]{16}-")   # a server's shared-memory prefix, as __init__ makes it
PR_SET_PDEATHSIG = 1                    # <linux/prctl.h>
LIBC = ctypes.CDLL(None, use_errno=True)   # loaded here: the child between fork and exec only calls it


def _own_temp_folder(folder: Path) -> bool:
    """Whether `folder` is a server's own temporary folder as start() makes it: a real folder named TEMP_PREFIX...,
    this user's, mode 0700 (so a TMPDIR pointing anywhere else is never removed)."""
    try:
        info = folder.lstat()
    except OSError:
        return False
    return (folder.name.startswith(TEMP_PREFIX) and stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
            and stat.S_IMODE(info.st_mode) == 0o700)


def die_with_server(poll: float = 0.5) -> None:
    """End this model process, and every other of its server's, once tritonserver is gone, however it went.

    tritonserver stopped with streams still live (its launcher killed outright: serve.py under `kill -9`, whose
    PR_SET_PDEATHSIG gives tritonserver SIGTERM) exits after its exit timeout without its stubs, which would then
    run for good, reparented, with their shared memory. A thread here watches the parent: when it changes, it
    removes the server's regions in /dev/shm and its private temporary folder, and SIGKILLs the process group
    (tritonserver's, which its stubs share). It does the same once the launcher named in LAUNCHER_ENV has been
    gone for the seconds named there (tritonserver stuck in its shutdown, waiting on its stubs)."""
    server = os.getppid()
    launcher_ended, grace = _launcher()

    def watch() -> None:
        launcher_gone = None
        while os.getppid() == server:
            if launcher_gone is None and launcher_ended():
                launcher_gone = time.monotonic()
            if launcher_gone is not None and time.monotonic() - launcher_gone > grace:
                break
            time.sleep(poll)
        prefix = os.environ.get(SHM_PREFIX_ENV, "")
        if SHM_PREFIX.fullmatch(prefix):                     # only names TritonServer makes, only in /dev/shm
            for region in SHM.iterdir():
                if region.name.startswith(prefix) and not region.is_dir():
                    region.unlink(missing_ok=True)
        temp = Path(tempfile.gettempdir())
        if _own_temp_folder(temp):
            shutil.rmtree(temp, ignore_errors=True)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, name="die-with-server", daemon=True).start()


def _launcher() -> tuple[Callable[[], bool], float]:
    """Whether the launcher LAUNCHER_ENV names has ended (asked of a pidfd, not of a pid another process may take
    later), and the seconds a stub outlives it at most; a launcher never ended where it names none."""
    try:
        pid, seconds = os.environ[LAUNCHER_ENV].split()
        grace = float(seconds)
        pidfd = os.pidfd_open(int(pid))
    except ProcessLookupError:                        # ended before this stub started
        return (lambda: True), grace
    except (KeyError, ValueError, OSError):
        return (lambda: False), 0.0
    return (lambda: bool(select.select([pidfd], [], [], 0)[0])), grace


class ServerError(V4EngineError):
    """The serving environment is incomplete, or the server did not become ready (the message ends with its log)."""


@dataclass(frozen=True)
class ServingEnv:
    """Where the serving environment keeps what the server needs, as its own Python reports it."""

    python: Path
    server_dir: Path            # pytriton/tritonserver: bin/, backends/python/, caches/, python_backend_stubs/
    libs: Path                  # nvidia_pytriton.libs: libtritonserver and the libraries it links
    libpython_dir: str
    python_version: str         # "3.11": picks the matching stub

    @classmethod
    def find(cls, env: str | Path) -> "ServingEnv":
        python = Path(env) / "bin" / "python"
        if not python.is_file():
            raise ServerError(f"{env}: no bin/python; make the serving environment with `make triton-env`")
        probe = ("import json, os, sys, sysconfig, pytriton; d = os.path.dirname(pytriton.__file__); "
                 "print(json.dumps([d, sysconfig.get_config_var('LIBDIR'), '%d.%d' % sys.version_info[:2]]))")
        found = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=60)
        if found.returncode != 0:
            raise ServerError(f"{env}: cannot import pytriton (pip install nvidia-pytriton==0.7.0 there): "
                              f"{found.stderr.strip().splitlines()[-1] if found.stderr.strip() else ''}")
        package, libdir, version = json.loads(found.stdout)
        return cls(python, Path(package) / "tritonserver", Path(package).parent / "nvidia_pytriton.libs",
                   libdir, version)


def free_ports(count: int) -> list[int]:
    """Ports the kernel hands out now on the loopback address (all held at once, so they differ)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def group_processes(group: int) -> dict[int, str]:
    """pid -> command line of every live process in a process group (zombies, which no signal can end, left out)."""
    found = {}
    for status in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = status.read_text().rsplit(")", 1)[1].split()    # after "pid (comm)": state, ppid, pgrp, ...
            if int(fields[2]) == group and fields[0] != "Z":
                found[int(status.parent.name)] = (status.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):                     # it ended while being read
            continue
    return found


def _child_setup(parent: int) -> None:
    """preexec_fn of tritonserver: SIGTERM when the thread that started it dies."""
    if LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:                    # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


class TritonServer:
    """A tritonserver process on `repository`, ready when `start()` (or `with`) returns; stopped by `stop()`.

    The log goes to `work_dir/server.log`; a server that exits or is not ready within `startup_timeout`
    seconds raises ServerError ending with the log's last lines."""

    def __init__(self, repository: str | Path, env: str | Path, *, work_dir: str | Path | None = None,
                 http_port: int | None = None, startup_timeout: float = 120.0, exit_timeout: int = 5,
                 log_verbose: int = 0):
        self.repository = Path(repository).resolve()
        self.env = ServingEnv.find(env)
        self.work_dir = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="tritonserver-"))
        self.startup_timeout, self.exit_timeout, self.log_verbose = startup_timeout, exit_timeout, log_verbose
        self.log_path = self.work_dir / "server.log"
        self.temp_dir: Path | None = None              # made by start()
        self.shm_prefix = f"v4engine-triton-{secrets.token_hex(8)}-"
        self.process: subprocess.Popen | None = None
        self.asked_http_port = http_port                 # None: a free one, chosen by start() as the others are
        self.http_port = self.grpc_port = self.metrics_port = 0      # chosen by start(), with the URLs
        self.http_url = self.grpc_url = self.metrics_url = ""

    def _backends(self) -> Path:
        """backends/python/: the wheel's backend files and the stub for the environment's Python, as links."""
        python = self.work_dir / "backends" / "python"
        python.mkdir(parents=True, exist_ok=True)
        source = self.env.server_dir / "backends" / "python"
        stub = self.env.server_dir / "python_backend_stubs" / self.env.python_version / "triton_python_backend_stub"
        if not stub.is_file():
            raise ServerError(f"{stub}: no Python-backend stub for Python {self.env.python_version} in the wheel")
        for target in [*source.iterdir(), stub]:
            link = python / target.name
            if not link.exists():
                link.symlink_to(target)
        return python.parent

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(self.env.libs), self.env.libpython_dir, env.get("LD_LIBRARY_PATH")) if p)
        env["PATH"] = os.pathsep.join(p for p in (str(self.env.python.parent), env.get("PATH")) if p)
        env["TMPDIR"] = str(self.temp_dir)
        env[SHM_PREFIX_ENV] = self.shm_prefix             # die_with_server, in each model process
        env[LAUNCHER_ENV] = f"{os.getpid()} {self.exit_timeout + 10}"
        return env

    def command(self) -> list[str]:
        return [str(self.env.server_dir / "bin" / "tritonserver"), f"--model-repository={self.repository}",
                f"--backend-directory={self._backends()}", f"--cache-directory={self.env.server_dir / 'caches'}",
                f"--http-address={HOST}", f"--http-port={self.http_port}",
                f"--grpc-address={HOST}", f"--grpc-port={self.grpc_port}",
                f"--metrics-address={HOST}", f"--metrics-port={self.metrics_port}", "--allow-gpu-metrics=false",
                f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
                f"--exit-timeout-secs={self.exit_timeout}", f"--log-verbose={self.log_verbose}"]

    def start(self) -> "TritonServer":
        """Start the server and wait until it is ready; on any failure, or an interrupt, it is stopped again."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.temp_dir = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX))
        self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        self.http_port = self.asked_http_port or self.http_port
        self.http_url, self.grpc_url = f"{HOST}:{self.http_port}", f"{HOST}:{self.grpc_port}"
        self.metrics_url = f"http://{HOST}:{self.metrics_port}/metrics"
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                            env=self._environment(), start_new_session=True,
                                            preexec_fn=functools.partial(_child_setup, os.getpid()))
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"tritonserver exited with code {self.process.returncode} while starting:\n"
                                  f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        raise ServerError(f"tritonserver was not ready after {self.startup_timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"

    def processes(self) -> dict[int, str]:
        """pid -> command line of tritonserver and its stubs while they live."""
        return {} if self.process is None else group_processes(self.process.pid)

    def stop(self) -> None:
        """SIGTERM; the whole process group gets SIGKILL if tritonserver outlives the exit timeout by 10 s, or a
        stub outlives tritonserver by 10 s. Then what a killed stub left in /dev/shm is removed, and the
        temporary folder."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(self.exit_timeout + 10)
            except subprocess.TimeoutExpired:
                self._kill_group()
        if not self._group_ended(within=10):
            self._kill_group()
            self._group_ended(within=10)
        self.process.wait()
        for region in SHM.glob(self.shm_prefix + "*"):
            region.unlink(missing_ok=True)
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):        # the group lives while a member does: ours
            os.killpg(self.process.pid, signal.SIGKILL)

    def _group_ended(self, within: float) -> bool:
        deadline = time.monotonic() + within
        while self.processes():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
