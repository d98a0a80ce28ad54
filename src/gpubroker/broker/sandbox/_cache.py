"""The tenant's compile cache inside the sandbox: a size-limited tmpfs, seeded from the host directory at the
worker's start and saved back, bounded, by the launcher once the worker has exited.

The worker never writes the host disk: whatever it writes lands in a tmpfs of ``cache_max_bytes`` (and
``nr_inodes`` in proportion), which the kernel refuses to grow (ENOSPC; RLIMIT_FSIZE refuses a single larger file
with EFBIG). Where the worker has a cgroup, those pages are charged to it like any of its memory.

The launcher (outside the worker's filter, inside its user and mount namespaces) mounts the tmpfs over the host
path before it forks the worker, so the worker's bind of that path is the tmpfs, and keeps a descriptor of each.
Seeding copies the newest files up to half the bound, leaving the other half for the worker's new compiles (a
full cache would fail every later compile: CuPy and PoCL treat a failed cache write as a failed build). Saving
makes the host directory the tmpfs's contents, under the same bound: it first deletes what the tmpfs no longer
holds (or holds changed), then copies what is new while the total stays within the bound, so the host directory
never holds more than ``cache_max_bytes``, even mid-save. The worker is gone by then, so nothing changes under
the copy; every name is opened relative to a directory descriptor with ``O_NOFOLLOW``, so neither a link planted
in the tmpfs nor one left in the host directory by an older broker leads the copy anywhere else. Saves of one
tenant's workers are serialised with ``flock`` on the host directory; the last one's view wins (a cache: the
other's kernels are compiled again).

Only the standard library: this runs on every worker's start and exit.
"""

from __future__ import annotations

import fcntl
import os
import stat

__all__ = ["CacheView", "ENTRY_BYTES", "MAX_DEPTH", "inodes_for"]

ENTRY_BYTES = 4096  # what a directory or an empty file counts against the bound (a block, an inode)
MAX_DEPTH = 32  # deeper entries are neither seeded nor saved (PoCL's and CUDA's caches are 3-5 deep)
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CHUNK = 1 << 20
TEMP_PREFIX = ".gpb-copy-"

Files = dict[str, os.stat_result]


class CacheView:
    """The tmpfs mounted over one tenant's host cache directory, and a descriptor of each."""

    def __init__(self, host_fd: int, view_fd: int, limit: int) -> None:
        self.host_fd = host_fd
        self.view_fd = view_fd
        self.limit = limit

    def seed(self) -> int:
        """Copy the host's newest files into the tmpfs, up to half the bound; the bytes copied."""
        fcntl.flock(self.host_fd, fcntl.LOCK_SH)
        host, view = _Dirs(self.host_fd, create=False), _Dirs(self.view_fd, create=True)
        try:
            files, _, _ = _walk(self.host_fd)
            total = 0
            for rel, st in sorted(files.items(), key=lambda item: -item[1].st_mtime_ns):
                if rel.rsplit("/", 1)[-1].startswith(TEMP_PREFIX):
                    continue  # (a copy a killed launcher left behind; the next save removes it)
                cost = _cost(st)
                if total + cost > self.limit // 2:
                    break
                try:
                    _copy(host, view, rel, st)
                except OSError:
                    break  # (the tmpfs is full: ENOSPC)
                total += cost
            return total
        finally:
            host.close()
            view.close()
            fcntl.flock(self.host_fd, fcntl.LOCK_UN)

    def give_to(self, uid: int, gid: int) -> None:
        """Make the tmpfs and all in it (the launcher seeded it as itself) the worker's, where the worker runs as
        another user than the launcher: it must write its compiles there. Links are changed, never followed."""
        os.fchown(self.view_fd, uid, gid)
        for _, dirs, files, fd in os.fwalk(".", dir_fd=self.view_fd, follow_symlinks=False):
            for name in (*dirs, *files):
                os.chown(name, uid, gid, dir_fd=fd, follow_symlinks=False)

    def save(self) -> int:
        """Make the host directory what the tmpfs holds, within the bound; the bytes copied."""
        fcntl.flock(self.host_fd, fcntl.LOCK_EX)
        src, dst = _Dirs(self.view_fd, create=False), _Dirs(self.host_fd, create=True)
        try:
            view, view_dirs, _ = _walk(self.view_fd)
            host, host_dirs, others = _walk(self.host_fd)
            # What the worker removed or changed goes first, so the bound holds at every step of the save.
            for rel in [*others, *(r for r, st in host.items() if not _same(st, view.get(r)))]:
                _unlink(dst, rel)
            gone = set(host_dirs) - set(view_dirs)
            dst.close()  # (descriptors of directories about to go)
            for rel in sorted(gone, key=lambda r: -r.count("/")):
                _unlink(dst, rel, directory=True)
                dst.close()
            kept = {r for r, st in host.items() if _same(st, view.get(r))}
            total = sum(_cost(view[r]) for r in kept) + ENTRY_BYTES * len(view_dirs)
            copied = 0
            for rel in sorted(view):
                if rel in kept:
                    continue
                cost = _cost(view[rel])
                if total + cost > self.limit:
                    continue
                try:
                    copied += _copy(src, dst, rel, view[rel])
                except OSError:
                    continue  # (a name the host has as a directory, a full disk: that file is not cached)
                total += cost
            return copied
        finally:
            src.close()
            dst.close()
            fcntl.flock(self.host_fd, fcntl.LOCK_UN)

    def close(self) -> None:
        for fd in (self.host_fd, self.view_fd):
            try:
                os.close(fd)
            except OSError:
                pass


def inodes_for(size: int) -> int:
    """A tmpfs's inode limit for ``size`` bytes: inodes are kernel memory that its size does not count."""
    return max(1024, size // 16384)


def _cost(st: os.stat_result) -> int:
    return max(st.st_size, 0) + ENTRY_BYTES


def _same(a: os.stat_result | None, b: os.stat_result | None) -> bool:
    return a is not None and b is not None and a.st_size == b.st_size and a.st_mtime_ns == b.st_mtime_ns


def _walk(root_fd: int) -> tuple[Files, list[str], list[str]]:
    """Regular files (relative path -> stat), directories, and anything else (links, fifos) below ``root_fd``."""
    files: Files = {}
    dirs: list[str] = []
    others: list[str] = []

    def visit(fd: int, prefix: str, depth: int) -> None:
        with os.scandir(fd) as entries:
            for entry in entries:
                rel = prefix + entry.name
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    if depth >= MAX_DEPTH:
                        continue
                    dirs.append(rel)
                    try:
                        sub = os.open(entry.name, _DIR, dir_fd=fd)
                    except OSError:
                        continue
                    try:
                        visit(sub, rel + "/", depth + 1)
                    finally:
                        os.close(sub)
                elif stat.S_ISREG(st.st_mode):
                    files[rel] = st
                else:
                    others.append(rel)

    visit(root_fd, "", 0)
    return files, dirs, others


class _Dirs:
    """Descriptors of the directories below one root, opened (and with ``create``, made) once per operation."""

    def __init__(self, root_fd: int, create: bool) -> None:
        self.fds: dict[str, int] = {"": root_fd}
        self.create = create

    def parent(self, rel: str) -> tuple[int, str]:
        """A descriptor of ``rel``'s directory (not to be closed: close() does), and its last name."""
        head, _, name = rel.rpartition("/")
        return self._get(head), name

    def _get(self, rel: str) -> int:
        fd = self.fds.get(rel)
        if fd is None:
            head, _, name = rel.rpartition("/")
            parent = self._get(head)
            if self.create:
                try:
                    os.mkdir(name, 0o700, dir_fd=parent)
                except FileExistsError:
                    pass
            fd = self.fds[rel] = os.open(name, _DIR, dir_fd=parent)
        return fd

    def close(self) -> None:
        for rel, fd in self.fds.items():
            if rel:  # (the root's descriptor is the caller's)
                os.close(fd)
        self.fds = {"": self.fds[""]}


def _unlink(dirs: _Dirs, rel: str, *, directory: bool = False) -> None:
    try:
        fd, name = dirs.parent(rel)
        os.rmdir(name, dir_fd=fd) if directory else os.unlink(name, dir_fd=fd)
    except OSError:
        pass  # (a directory still holding what did not fit, a name gone already)


def _copy(src_dirs: _Dirs, dst_dirs: _Dirs, rel: str, st: os.stat_result) -> int:
    """Copy one regular file, keeping its mode and mtime, through a temporary name renamed into place."""
    src_dir, name = src_dirs.parent(rel)
    src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src_dir)
    try:
        if not stat.S_ISREG(os.fstat(src).st_mode):
            raise OSError("not a regular file")
        dst_dir, name = dst_dirs.parent(rel)
        tmp = f"{TEMP_PREFIX}{os.getpid()}"
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                      stat.S_IMODE(st.st_mode) & 0o700 or 0o600, dir_fd=dst_dir)
        try:
            copied = 0
            while copied < st.st_size:  # (never past the size seen: the bound counted that)
                sent = os.sendfile(dst, src, copied, min(_CHUNK, st.st_size - copied))
                if sent <= 0:
                    break
                copied += sent
            os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(dst)
        try:
            os.rename(tmp, name, src_dir_fd=dst_dir, dst_dir_fd=dst_dir)
        except OSError:
            os.unlink(tmp, dir_fd=dst_dir)
            raise
    finally:
        os.close(src)
    return copied
