"""Attacks on the Triton cancel relay (triton_repo/models/relay.py) and on the server's lifetime.

Spoofing: a local process that finds the relay's socket and sends it the keys an old relay used (counters, the
abstract name) cancels nothing. Poisoning: datagrams that are empty, oversized, not UTF-8 or unknown leave the
relay reading, and a real cancellation still works. Flooding: a receiver that stops reading never blocks the
sender. Stopping: however serve.py ends, and even when tritonserver ignores SIGTERM, tritonserver and its stubs
end and /dev/shm holds nothing of them.
Each test also checks that nothing was written outside the folders it gave: the system temporary folder gains
no relay folder, and /dev/shm keeps nothing of a stopped server.
"""
from __future__ import annotations

import http.client
import json
import os
import queue
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from test_triton_server import ENV, metric, server, wait_for  # noqa: F401 - server is the module's fixture
from v4engine.runtime.generator import Generator
from v4engine.triton_repo import render
from v4engine.triton_repo.models.relay import CancelRelay, relay_cancel
from v4engine.triton_repo.server import (LAUNCHER_ENV, SHM, SHM_PREFIX, SHM_PREFIX_ENV, TEMP_PREFIX, TritonServer,
                                         group_processes)

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.xdist_group("triton-server")
GARBAGE = [b"", b"\xff\xfe\xfd", b"0", b"1", b"2", b"x" * 60_000, b"\x00" * 32, "ключ".encode(),
           b"v4engine-cancel-0/0"]


def abstract_names() -> list[str]:
    """Abstract UNIX socket names bound on this machine (shown with a leading @ in /proc/net/unix)."""
    return [line.split()[-1] for line in Path("/proc/net/unix").read_text().splitlines()[1:]
            if line.split()[-1].startswith("@")]


def relay_folders() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith("v4engine-cancel-")}


@pytest.fixture
def untouched():
    """Fails the test if a relay folder appeared in, or went from, the system temporary folder."""
    before = relay_folders()
    yield
    assert relay_folders() == before


class Cancelled:
    """A callback for CancelRelay.listening that counts its calls and can be made to block."""

    def __init__(self, block: threading.Event | None = None):
        self.calls, self.event, self.block = 0, threading.Event(), block

    def __call__(self) -> None:
        self.calls += 1
        self.event.set()
        if self.block is not None:
            self.block.wait()


def send(path: Path, data: bytes) -> None:
    """A datagram as an attacker sends it: waiting while the relay's queue (10 datagrams) is full."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(data, str(path))


def read_so_far(relay: CancelRelay, canary: Cancelled, canary_key: bytes) -> None:
    """Return once the relay has read every datagram sent before: it reads in order, the canary's comes last."""
    send(relay.path, canary_key.partition(b"/")[2])
    assert canary.event.wait(30)


# ---------------------------------------------------------------------- the relay alone
def test_the_socket_is_a_file_in_a_private_folder_and_goes_with_the_relay(tmp_path, untouched):
    relay = CancelRelay(temp_dir=str(tmp_path))
    try:
        assert relay.folder.parent == tmp_path and stat.S_IMODE(relay.folder.stat().st_mode) == 0o700
        assert stat.S_ISSOCK(relay.path.stat().st_mode)
        assert not [name for name in abstract_names() if "v4engine" in name]
    finally:
        relay.close()
    assert not any(tmp_path.iterdir()), "the relay's folder is removed when it closes"


def test_a_temporary_folder_too_deep_for_a_socket_is_one_line_and_leaves_nothing(tmp_path, untouched):
    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    with pytest.raises(OSError, match="longer than the 107 bytes a UNIX socket path may have; set TMPDIR") as error:
        CancelRelay(temp_dir=str(deep))
    assert "\n" not in str(error.value) and not any(deep.iterdir())


def test_guessed_keys_cancel_nothing_and_the_real_key_cancels(tmp_path, untouched):
    relay = CancelRelay(temp_dir=str(tmp_path))
    victim, canary = Cancelled(), Cancelled()
    try:
        with relay.listening(victim) as key, relay.listening(canary) as canary_key:
            folder = key.partition(b"/")[0]
            for guess in [b"0", b"1", b"2", folder + b"/0", folder + b"/1"]:
                relay_cancel(guess, temp_dir=str(tmp_path))
            read_so_far(relay, canary, canary_key)
            assert victim.calls == 0
            assert relay_cancel(key, temp_dir=str(tmp_path)) and victim.event.wait(30)
    finally:
        relay.close()


def test_garbage_datagrams_leave_the_relay_reading(tmp_path, untouched):
    relay = CancelRelay(temp_dir=str(tmp_path))
    victim, canary, late = Cancelled(), Cancelled(), Cancelled()
    raised = threading.Event()

    def explode() -> None:
        raised.set()
        raise ZeroDivisionError("a callback that fails")

    try:
        with relay.listening(victim) as key, relay.listening(canary) as canary_key:
            secret = key.partition(b"/")[2]
            for data in GARBAGE + [secret + b"x", b"x" + secret, secret * 20]:
                send(relay.path, data)
            with relay.listening(explode) as explosive:
                send(relay.path, explosive.partition(b"/")[2])
                assert raised.wait(30)
            with relay.listening(late) as late_key:
                pass
            send(relay.path, late_key.partition(b"/")[2])                 # a request that already ended
            read_so_far(relay, canary, canary_key)
            assert victim.calls == late.calls == 0
            assert relay_cancel(key, temp_dir=str(tmp_path)) and victim.event.wait(30)
    finally:
        relay.close()


def test_keys_that_name_no_relay_folder_are_sent_nowhere(tmp_path, untouched):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(tmp_path / "socket"))                      # a datagram socket a key could try to reach
    listener.setblocking(False)
    try:
        for key in [b"../socket/abc", b"/" + str(tmp_path).encode() + b"/abc", b"\0v4engine-cancel-x/abc",
                    b"v4engine-cancel-../abc", b"v4engine-cancel-ab/", b"no-slash", b""]:
            assert relay_cancel(key, temp_dir=str(tmp_path)) is False, key
        with pytest.raises(BlockingIOError):
            listener.recv(64)
    finally:
        listener.close()


def test_a_receiver_that_stops_reading_never_blocks_the_sender(tmp_path, untouched):
    relay = CancelRelay(temp_dir=str(tmp_path))
    release = threading.Event()
    stuck, later = Cancelled(block=release), Cancelled()
    try:
        with relay.listening(stuck) as key:
            relay_cancel(key, temp_dir=str(tmp_path))
            assert stuck.event.wait(30)                                 # the relay's thread is now held
            sent: list[bool] = []
            sender = threading.Thread(target=lambda: sent.extend(relay_cancel(key, temp_dir=str(tmp_path))
                                                                 for _ in range(1000)))
            sender.start()
            sender.join(60)
            assert not sender.is_alive(), "relay_cancel blocked on a full receiver"
            assert len(sent) == 1000 and not all(sent), "a full queue drops datagrams"
            release.set()
            wait_for(lambda: stuck.calls == 1 + sum(sent), what="the relay to read every datagram it queued")
        with relay.listening(later) as key:
            assert relay_cancel(key, temp_dir=str(tmp_path)) and later.event.wait(30), "the relay reads again"
    finally:
        release.set()
        relay.close()
    assert relay_cancel(key, temp_dir=str(tmp_path)) is False, "a closed relay: dropped, no error"


# ---------------------------------------------------------------------- the relay of a real server
class Generation:
    """One streaming request to v4_generate, called directly (it is decoupled, so over a gRPC stream); its
    first response gives the cancel key that postprocessing would relay."""

    def __init__(self, server, prompt: list[int], max_tokens: int):
        def tensor(name, values, dtype):
            t = grpcclient.InferInput(name, [len(values)], dtype)
            t.set_data_from_numpy(np.array(values, dtype=bool if dtype == "BOOL" else np.int32))
            return t

        self.answers: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.client.start_stream(callback=lambda result, error: self.answers.put((result, error)))
        self.client.async_stream_infer(
            "v4_generate", [tensor("prompt_ids", prompt, "INT32"), tensor("max_tokens", [max_tokens], "INT32"),
                            tensor("stream", [True], "BOOL"), tensor("ignore_eos", [True], "BOOL")],
            enable_empty_final_response=True)
        self.tokens, self.final, self.key = 0, False, b""
        self.read(until=1)

    def read(self, until: int | None = None) -> None:
        """Read responses until `until` tokens came or the final response did; without `until`, those here."""
        while not self.final and (self.tokens < until if until is not None else not self.answers.empty()):
            result, error = self.answers.get(timeout=120)
            assert error is None, error
            response = result.get_response()
            if response.outputs:
                self.tokens += len(result.as_numpy("output_ids"))
                [self.key] = result.as_numpy("cancel_key").tolist()
            self.final = response.parameters["triton_final_response"].bool_param

    def close(self) -> None:
        self.client.stop_stream(cancel_requests=True)


def test_a_served_relay_is_private_and_survives_spoofing_and_poisoning(server, trained_engine):
    sockets = [line.split()[-1] for line in Path("/proc/net/unix").read_text().splitlines()[1:]
               if line.split()[-1].startswith(str(server.temp_dir))]
    assert len(sockets) == 1 and not [name for name in abstract_names() if "v4engine" in name]
    path = Path(sockets[0])
    assert stat.S_IMODE(path.parent.stat().st_mode) == stat.S_IMODE(server.temp_dir.stat().st_mode) == 0o700

    prompt, budget = Generator.from_engine_dir(trained_engine).encode("def fibonacci(n):"), 4000
    victim = canary = None
    try:
        victim, canary = Generation(server, prompt, budget), Generation(server, prompt, budget)
        for data in GARBAGE + [victim.key, victim.key.partition(b"/")[2] + b"x"]:   # the key is not the secret
            send(path, data)
        for old in ("v4engine-cancel-0", "v4engine-cancel"):           # where the old relay listened: nobody
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s, pytest.raises(ConnectionRefusedError):
                s.sendto(b"0", "\0" + old)
        send(path, canary.key.partition(b"/")[2])      # datagrams are read in order: once the canary
        canary.read(until=budget)                      # ends, all before it were read
        assert canary.final and canary.tokens < budget
        wait_for(lambda: metric(server, "v4_pending_requests") == 1, what="the canary to leave, not the victim")
        victim.read()                              # what came so far; a cancelled victim's end is at most a
        victim.read(until=victim.tokens + 100)     # step behind, so it cannot give 100 tokens more
        assert not victim.final, "a spoofed or malformed datagram cancelled the request"
        assert relay_cancel(victim.key, temp_dir=str(server.temp_dir))
        victim.read(until=budget)
        assert victim.final and victim.tokens < budget, "a real cancellation still works"
    finally:
        for generation in (victim, canary):
            if generation is not None:
                generation.close()
    wait_for(lambda: metric(server, "v4_pending_requests") == 0, what="both requests to leave the serving loop")
    assert metric(server, "v4_cache_bytes") == 0


# ---------------------------------------------------------------------- stopping serve.py
def shm_regions(prefix: str) -> list[str]:
    return [p.name for p in SHM.iterdir() if p.name.startswith(prefix)]


# A stand-in tritonserver: a process group of its own, deaf to SIGTERM (as one stuck in its shutdown), and one
# model process that watches it (die_with_server). It prints its pid and the model process's.
WATCHED = """
import os, signal, subprocess, sys, time
os.setpgrp()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
stub = subprocess.Popen([sys.executable, "-c", "from v4engine.triton_repo.server import die_with_server; "
                         "import time; die_with_server(0.1); print('watching', flush=True); time.sleep(600)"],
                        stdout=subprocess.PIPE, text=True)
assert stub.stdout.readline() == "watching\\n"
print(os.getpid(), stub.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("hostile", [False, True], ids=["its own", "an environment pointing elsewhere"])
def test_a_model_process_whose_server_is_gone_removes_its_memory_and_ends_its_group(tmp_path, hostile):
    """However tritonserver went, a model process that outlives it (reparented) removes the server's /dev/shm
    regions and temporary folder and SIGKILLs the group: nothing runs on for good (server.die_with_server). It
    removes only names a server makes: a prefix or TMPDIR of another form leaves every file alone."""
    prefix = f"v4engine-triton-{os.getpid():016x}-"
    region, temp = SHM / f"{prefix}region", tmp_path / f"{TEMP_PREFIX}x"
    region.write_bytes(b"held")
    temp.mkdir(mode=0o700)
    keep = tmp_path / "outside.txt"
    keep.write_text("precious")
    if hostile:                                        # a prefix that walks out of /dev/shm, a TMPDIR not 0700
        prefix, temp = f"../{tmp_path.name}/", tmp_path
    env = {**os.environ, SHM_PREFIX_ENV: prefix, "TMPDIR": str(temp)}
    server = subprocess.Popen([sys.executable, "-c", WATCHED], stdout=subprocess.PIPE, text=True, env=env)
    try:
        _, stub = map(int, server.stdout.readline().split())
        server.kill()                                   # tritonserver gone, without a word to its stubs
        server.wait()
        wait_for(lambda: not alive(stub), what="the model process to end itself", timeout=30)
        assert region.exists() == hostile and temp.exists() == hostile and keep.read_text() == "precious"
    finally:
        region.unlink(missing_ok=True)
        if alive(stub):
            os.kill(stub, signal.SIGKILL)


LAUNCHER = """
import os, subprocess, sys
server = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True,
                          env={**os.environ, sys.argv[2]: f"{os.getpid()} 1"})   # as TritonServer names itself
print(server.stdout.readline(), end="", flush=True)
server.wait()
"""


def test_a_server_stuck_in_its_shutdown_is_ended_by_its_stubs_when_its_launcher_is_gone():
    """tritonserver that does not end after its launcher's death (stuck in its shutdown, say) still has a parent, so
    its stubs' parent watch sees nothing: the stubs also watch the launcher (LAUNCHER_ENV, set by TritonServer)
    and end the group once it has been gone for the exit timeout and 10 s more (here 1 s)."""
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, WATCHED, LAUNCHER_ENV], stdout=subprocess.PIPE,
                                text=True, env={**os.environ, SHM_PREFIX_ENV: ""})
    server = stub = 0
    try:
        server, stub = map(int, launcher.stdout.readline().split())
        assert alive(server) and alive(stub)
        launcher.kill()
        launcher.wait()
        wait_for(lambda: not alive(server) and not alive(stub), what="the stuck server and its stub to end",
                 timeout=30)
    finally:
        for pid in (server, stub):
            if pid and alive(pid):
                os.kill(pid, signal.SIGKILL)


def live_stream(http_url: str) -> http.client.HTTPConnection:
    """A streaming request that has begun answering and would go on for a long while."""
    connection = http.client.HTTPConnection(http_url, timeout=60)
    connection.request("POST", "/v2/models/ensemble/generate_stream",
                       json.dumps({"text_input": "def fib(n):", "max_tokens": 1500, "ignore_eos": True,
                                   "stream": True}))
    answer = connection.getresponse()
    assert answer.status == 200 and answer.readline().startswith(b"data:")
    return connection


@pytest.mark.parametrize("stop, streams", [(signal.SIGTERM, 0), (signal.SIGINT, 0), (signal.SIGHUP, 0),
                                           (signal.SIGKILL, 0), (signal.SIGKILL, 2)],
                         ids=["SIGTERM", "SIGINT", "SIGHUP", "SIGKILL", "SIGKILL-under-load"])
def test_stopping_serve_py_ends_every_child_and_frees_shared_memory(trained_engine, tmp_path, stop, streams,
                                                                   untouched):
    """Under load, tritonserver (SIGTERM from its launcher's death) exits after its exit timeout without its stubs,
    which then end themselves and the group (models/io.py die_with_server)."""
    if not (ENV / "bin" / "python").is_file():
        pytest.fail(f"{ENV}: no serving environment; `make triton-env` makes it (`make test` does)")
    launcher = subprocess.Popen([sys.executable, str(ROOT / "examples" / "triton" / "serve.py"), str(trained_engine),
                                 "--work", str(tmp_path), "--env", str(ENV)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert launcher.stdout.readline().startswith("serving "), launcher.stdout.read()
        assert json.loads((tmp_path / "server.json").read_text())["http"]
        [server] = map(int, Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split())
        command = Path(f"/proc/{server}/cmdline").read_bytes().split(b"\0")
        [prefix] = [arg.decode().rpartition("=")[2] for arg in command if b"shm-region-prefix-name" in arg]
        [temp_dir] = [Path(v[len(b"TMPDIR="):].decode()) for v in Path(f"/proc/{server}/environ").read_bytes()
                      .split(b"\0") if v.startswith(b"TMPDIR=")]
        assert len(group_processes(server)) == 4, "tritonserver and the stubs of its three Python models"
        assert len(shm_regions(prefix)) == 3
        http_url = json.loads((tmp_path / "server.json").read_text())["http"]
        connections = [live_stream(http_url) for _ in range(streams)]
        launcher.send_signal(stop)
        launcher.wait(120)
        wait_for(lambda: not group_processes(server), timeout=60,
                 what=lambda: f"tritonserver and its stubs to end (left: {group_processes(server)})")
        assert shm_regions(prefix) == []
        if stop == signal.SIGKILL:          # tritonserver's own stop (or its stubs) removed the relay's socket;
            assert not list(temp_dir.glob("v4engine-cancel-*"))   # the folder only the stubs of a loaded one
            shutil.rmtree(temp_dir, ignore_errors=True)
        for connection in connections:
            connection.close()
        assert launcher.returncode == (-stop if stop == signal.SIGKILL else 0) and not temp_dir.exists()
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_a_server_deaf_to_sigterm_is_killed_with_its_stubs_and_their_shared_memory_removed(trained_engine, tmp_path):
    if not (ENV / "bin" / "python").is_file():
        pytest.fail(f"{ENV}: no serving environment; `make triton-env` makes it (`make test` does)")
    repo = render(trained_engine, tmp_path / "repo")
    server = TritonServer(repo, ENV, work_dir=tmp_path / "server", exit_timeout=1).start()
    members = server.processes()
    try:
        assert len(members) == 4 and len(shm_regions(server.shm_prefix)) == 3
        assert SHM_PREFIX.fullmatch(server.shm_prefix), "the form die_with_server removes"
        os.kill(server.process.pid, signal.SIGSTOP)     # SIGTERM now does nothing: stop() must kill the group
    finally:
        server.stop()
    assert server.process.returncode == -signal.SIGKILL
    assert not group_processes(server.process.pid), "every stub was killed with tritonserver"
    assert shm_regions(server.shm_prefix) == [], "what the killed stubs left in /dev/shm is removed"
    assert not server.temp_dir.exists()
