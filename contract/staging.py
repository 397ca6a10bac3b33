"""Folders that appear whole or not at all, and replace only what is ours: engines, model repositories, checkpoints.

- Everything is written into a staging folder beside the destination (`.NAME.TAG-XXXX`), which is renamed into
  place only when the block succeeds: an error, a full disk, Ctrl-C, SIGTERM or SIGHUP in the middle leaves no
  half-written output (the command lines turn those signals into exceptions, see `signals_as_exceptions`).
- A lock beside the destination (`.NAME.lock`, flock: released by the kernel when its holder dies) makes a second
  writer into the same destination refuse at once, instead of silently replacing the first one's work.
- Each staging folder records its owner (host, pid and the process's start time); a staging folder whose owner is
  dead (SIGKILL, a power cut) is removed by the next writer into the same destination.
- An existing destination is replaced only with `force`, only when it is a folder of the kind we write and holds
  nothing else (`Ours`: its marker, and only entries of ours), and only once the new one is complete: the old one
  is renamed aside, the new one renamed in, then the old one deleted. A writer killed between those renames leaves
  the old one aside, and the next writer puts it back.
"""
from __future__ import annotations

import errno
import fcntl
import glob
import json
import os
import shutil
import signal
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from .errors import V4EngineError

OWNER = ".owner.json"


class StagingError(V4EngineError):
    """The destination cannot be written: it exists and is not ours, or another process is writing it."""


class Interrupted(BaseException):
    """SIGTERM or SIGHUP arrived (SIGINT stays KeyboardInterrupt); like it, not an Exception, so that nothing
    catches it by accident, and every `finally` on the way out cleans up."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def signals_as_exceptions() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise Interrupted in the main thread (as SIGINT raises
    KeyboardInterrupt), so staging folders are cleaned on every signal a terminal or a supervisor sends."""
    def handler(signum: int, _frame) -> None:
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


@dataclass(frozen=True)
class Ours:
    """What a folder of one kind that we write looks like: `what` it is, the `marker` file that says we wrote it
    (with `marked`, a test of its content), and the entries it may hold (`allowed`, given each path relative to the
    folder; OWNER always may). A folder with anything else in it was touched by someone: --force leaves it alone."""

    what: str
    marker: str
    allowed: Callable[[PurePosixPath], bool]
    marked: Callable[[Path], bool] = lambda _: True

    def problem(self, folder: Path) -> str | None:
        """Why `folder` is not one of ours, or None when it is."""
        if not (folder / self.marker).is_file() or not self.marked(folder / self.marker):
            return f"is not {self.what}"
        for root, dirs, files in os.walk(folder):
            for name in sorted(dirs + files):
                entry = PurePosixPath(Path(root, name).relative_to(folder).as_posix())
                if str(entry) != OWNER and not self.allowed(entry):
                    return f"holds {entry}, which is not part of {self.what}"
        return None


NOTHING = Ours("a folder written by v4engine", "\0", lambda _: False)


def check_destination(out: Path, force: bool, ours: Ours) -> None:
    """Refuse (StagingError, one line) a destination that exists unless `force` is given and it is one of ours
    holding nothing else; also a destination that is a symlink or a file, which nothing here ever replaces."""
    if not os.path.lexists(out):
        return
    if not force:
        raise StagingError(f"{out}: already exists (pass --force to replace it)")
    if out.is_symlink() or not out.is_dir():
        raise StagingError(f"{out}: exists and is not a folder; --force only replaces {ours.what}")
    problem = ours.problem(out)
    if problem is not None:
        raise StagingError(f"{out}: exists and {problem}; --force only replaces {ours.what} as written, so it is "
                           "left alone")


@contextmanager
def staged_folder(out: Path, tag: str, force: bool = False, ours: Ours = NOTHING) -> Iterator[Path]:
    """Yield `.{out.name}.{tag}-XXXX` beside `out`; on success it becomes `out` (world-readable), replacing an
    existing `out` only as check_destination allows."""
    out = Path(out)
    with _lock(out):
        remove_dead_staging(out)
        check_destination(out, force, ours)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{tag}-", dir=out.parent))
        try:
            (tmp / OWNER).write_text(json.dumps(_me()))
            yield tmp
            tmp.chmod(0o755)                                  # mkdtemp made it private
            _replace(out, tmp, ours)
            (out / OWNER).unlink()                            # owned until it is in place: never an orphan
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)


def _replace(out: Path, new: Path, ours: Ours) -> None:
    """`new` in place of `out`. The old `out` is set aside first and checked again there, where no one adds to it:
    a file someone put into it since check_destination keeps it from being deleted."""
    if not os.path.lexists(out):
        new.rename(out)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.replaced-", dir=out.parent))
    (aside / OWNER).write_text(json.dumps(_me()))        # removed by a later writer if this one dies mid-way
    out.rename(aside / "old")
    try:
        problem = ours.problem(aside / "old")
        if problem is not None:
            raise StagingError(f"{out}: {problem} (added while this one was written), so it is left alone and the "
                               "new one is not put in its place")
        new.rename(out)
    except BaseException:                                # interrupted between the renames: the old one goes back
        (aside / "old").rename(out)
        raise
    finally:
        shutil.rmtree(aside / "old", ignore_errors=True)  # the owner record last: a writer killed here leaves a
        shutil.rmtree(aside, ignore_errors=True)          # folder that the next one sees as dead and removes


def remove_dead_staging(out: Path) -> list[Path]:
    """Remove the staging folders of `out` (`.{out.name}.*-*`) whose owner process is gone, and `out` itself if
    it still carries a dead owner (a writer killed after its last rename); a replaced `out` that such a writer had
    set aside, while `out` is missing, goes back in place. Returns what it removed. Call it holding the lock."""
    if (out / OWNER).is_file() and _owner_is_dead(out):
        (out / OWNER).unlink()                               # complete: only the owner's mark was left to remove
    removed = []
    for folder in out.parent.glob(f".{glob.escape(out.name)}.*-*"):
        if not folder.is_dir() or folder.is_symlink() or not _owner_is_dead(folder):
            continue
        if ".replaced-" in folder.name and (folder / "old").is_dir() and not os.path.lexists(out):
            (folder / "old").rename(out)
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}


def _owner_is_dead(folder: Path) -> bool:
    """True only when we can tell: the folder names an owner on this host that is no longer running (or a
    process started since under the same pid), or it is an empty folder that never got an owner."""
    try:
        owner = json.loads((folder / OWNER).read_text())
        host, pid, start = owner["host"], int(owner["pid"]), owner["start"]
    except FileNotFoundError:
        return not any(folder.iterdir())
    except (OSError, ValueError, KeyError, TypeError):
        return False
    if host != socket.gethostname():
        return False
    return _start_time(pid) != start


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, from /proc), None when there is no such process.
    Tells a live owner from a later process that got the same pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:                          # no /proc here: alive or not is all we can tell
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "alive"
    return stat.rsplit(")", 1)[1].split()[19]


@contextmanager
def _lock(out: Path) -> Iterator[None]:
    """Hold `.{out.name}.lock` beside `out` for the block; StagingError at once if another process holds it."""
    path = out.parent / f".{out.name}.lock"
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except FileNotFoundError:
            raise StagingError(f"{out.parent}: the folder for {out.name} does not exist") from None
        except OSError as e:
            raise StagingError(f"{path}: cannot take the lock ({e.strerror})") from None
        info = os.fstat(fd)
        wrong = "not a regular file" if not stat.S_ISREG(info.st_mode) else \
            "a hard link" if info.st_nlink != 1 else None       # never truncate what another name reaches
        if wrong:
            os.close(fd)
            raise StagingError(f"{path}: is {wrong}, not a lock file of ours; remove it and build again")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise StagingError(f"{path}: cannot take the lock ({e.strerror})") from None
            raise StagingError(f"{out}: another process is writing it now (it holds {path}); refused") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            same = False
        if same:                             # not a lock file its last holder unlinked while we opened it
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        os.unlink(path)                      # while still held: a waiting opener sees another inode and retries
        os.close(fd)
