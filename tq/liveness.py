"""Whether a process of this host still runs, told across pid namespaces by a lock it holds on a file.

A storage unit keeps the range of a same-host writer that was paused past its allocation lease for as
long as the writer runs (its copy may still land there). A pid cannot tell that when the two processes
are in different pid namespaces sharing the shared-memory directory (containers of one pod with a
common ``/dev/shm``): the writer's pid names another process of the unit's namespace, or none, so its
range would be freed under it, or held for good. Instead the writer holds a shared ``flock`` on a
file of its own in that directory for as long as it lives, and names the file; the unit asks by
trying an exclusive lock. The kernel drops the lock when the holder exits, however it ends (a child
forked after the file was made holds it too, until both have exited: a range is then held longer,
never freed under a writer). A controller holds its location tables the same way (a controller
starting retires only tables nobody holds: tq.locations.remove_orphans).
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
import time
import uuid
from typing import Callable, Union

from .launch import process_identity, same_process

PREFIX = "tq-live-"
NAME_PATTERN = r"tq-live-[0-9a-f]{32}"  # what a file name a process sends must look like
NAME = re.compile(NAME_PATTERN)
TMP_AGE_S = 60.0  # a file still being made this long after was left by a maker killed meanwhile
SWEEP_S = 60.0  # how often a server unlinks the files of exited processes from its directory (remove_gone)

_lock = threading.Lock()
_own: dict[tuple[int, str], str] = {}  # (pid, directory) -> this process's file there (its fd stays open)

# What tells whether a process of this host still runs (see runs): its liveness file's name, or its
# pid and start time (tq.launch.process_identity) in the asker's pid namespace
Holder = Union[str, tuple[int, int]]


def create_held(path: str, *, mode: int = 0o600, fill: Callable[[int], None] | None = None) -> int:
    """Create the file ``path`` (filled by ``fill(fd)``) and return a read-write descriptor holding a
    shared lock on it: to the processes that ask :func:`holder_alive`, this process runs for as long
    as the descriptor stays open. Made under a temporary name and renamed once locked, so no process
    finds it unlocked at ``path`` while its maker runs; nothing is left behind when that fails."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.tmp")
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, mode)
    try:
        if fill is not None:
            fill(fd)
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.rename(tmp, path)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    return fd


def own_file(directory: str) -> str:
    """The name of this process's liveness file in ``directory``, made (and locked: see
    :func:`create_held`) at the first call of the process. Raises OSError where the directory does
    not allow it."""
    key = (os.getpid(), directory)
    with _lock:
        name = _own.get(key)
        if name is None:
            name = f"{PREFIX}{uuid.uuid4().hex}"
            create_held(os.path.join(directory, name), mode=0o644)  # never closed: held as long as the process
            _own[key] = name
        return name


def holder_alive(directory: str, name: str) -> bool:
    """Whether the process that made liveness file ``name`` of ``directory`` still runs: the file
    is there and locked. A file this process cannot open (another user's) counts as alive."""
    try:
        fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops the exclusive lock, if it was taken
    return False


def identify(pid: int | None, file: str | None) -> Holder | None:
    """What tells whether a process that says it runs on this host still runs: the liveness file it
    named, else its pid's (pid, start time) here; None if it named neither (or that pid runs not)."""
    if file is not None:
        return file
    return process_identity(pid) if pid is not None else None


def own_file_or_none(directory: str | None) -> str | None:
    """:func:`own_file`, or None where no directory is known or none can be made there (the server
    then judges this process by its pid)."""
    try:
        return own_file(directory) if directory else None
    except OSError:
        return None


def runs(holder: Holder | None, directory: str | None) -> bool:
    """Whether the process ``holder`` names still runs: a liveness file's name (in ``directory``), or
    the pid and start time of a process of this pid namespace (:func:`tq.launch.process_identity`)."""
    if isinstance(holder, str):
        return directory is not None and holder_alive(directory, holder)
    return same_process(holder)


def gone(directory: str, pattern: re.Pattern[str] = NAME, keep: Callable[[str], bool] | None = None) -> list[str]:
    """Paths of the files of ``directory`` named as ``pattern`` says (default: liveness files) whose
    makers exited - none holds its lock (:func:`create_held`) - but those ``keep(path)`` says to; and
    of files a maker killed while making one left behind (older than ``TMP_AGE_S``)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    tmp = re.compile(rf"\.(?:{pattern.pattern})\.tmp")
    out, now = [], time.time()
    for name in names:
        path = os.path.join(directory, name)
        try:
            if pattern.fullmatch(name) and not (keep is not None and keep(path)) and not holder_alive(directory, name):
                out.append(path)
            elif tmp.fullmatch(name) and now - os.lstat(path).st_mtime > TMP_AGE_S:
                out.append(path)
        except FileNotFoundError:
            pass
    return out


def remove_gone(
    directory: str,
    pattern: re.Pattern[str] = NAME,
    retire: Callable[[str], None] | None = None,
    keep: Callable[[str], bool] | None = None,
) -> int:
    """Unlink the files :func:`gone` names, calling ``retire(path)`` first on each that is not a
    half-made one; returns how many."""
    removed = 0
    for path in gone(directory, pattern, keep):
        try:
            if retire is not None and pattern.fullmatch(os.path.basename(path)):
                retire(path)
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass
    return removed
