"""Files no other local user can swap or plant: the place check, exclusive unpredictable temp files, safe locks."""

from __future__ import annotations

import errno
import os
import secrets
import stat

# Only a trusted owner: this process's user, or root (who can change anything anyway).
_TRUSTED_UIDS = frozenset({0, os.geteuid()})
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
TEMP_ATTEMPTS = 8  # names drawn before giving up; a clash of 64 random bits means something is planting names
# Created anew, never through a link, never an existing file; closed in any child process.
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePlace(ValueError):
    """A private file's place (its directory, an ancestor, or the file itself) another local user can change."""


class PrivateFileError(Exception):
    """A private file could not be written, locked or read safely (the message names the file and why)."""


def _why(e: OSError) -> str:
    return "a symbolic link is there (refused)" if e.errno == errno.ELOOP else (e.strerror or type(e).__name__)


def private_path(path: str) -> str:
    """`path` with its directory's symbolic links resolved: every later open goes through the directory that was
    checked, not through a link someone could point elsewhere. The file's own name stays as given."""
    path = os.path.abspath(path)
    return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))


def check_private_place(path: str, what: str, companions: tuple[str, ...] = ()) -> None:
    """UnsafePlace naming the problem unless no other local user can replace `path` or write into its directory.

    The rule: the directory holding the file is owned by this user or root and writable by its owner only
    (sticky or not: in a sticky directory another user can still create the file's name, or its lock's, before
    this process does). Every ancestor is owned by this user or root and either writable by its owner only or
    sticky (as /tmp: others may add entries there but never rename or remove one they do not own). The file
    and each of `companions` (its lock, ...), where they exist, are regular files (not links) owned by this user
    or root and writable by their owner only. `path` is the result of private_path.
    """
    directory = os.path.dirname(path)
    try:
        _check_dir(directory, what, path, sticky_ok=False)
        parent = os.path.dirname(directory)
        while parent != directory:
            directory, parent = parent, os.path.dirname(parent)
            _check_dir(directory, what, path, sticky_ok=True)
        for name in (path, *companions):
            _check_existing(name, what, path)
    except PermissionError as e:
        raise UnsafePlace(f"{what} {path}: cannot inspect {e.filename}: {e.strerror}") from None


def _check_dir(directory: str, what: str, path: str, *, sticky_ok: bool) -> None:
    try:
        st = os.stat(directory)
    except FileNotFoundError:
        raise UnsafePlace(f"{what} {path}: directory {directory} does not exist") from None
    if st.st_uid not in _TRUSTED_UIDS:
        raise UnsafePlace(f"{what} {path}: directory {directory} belongs to another user (uid {st.st_uid}), who "
                          "could replace the file; use a directory of this user's or root's")
    mode = stat.S_IMODE(st.st_mode)
    if mode & _OTHERS_WRITE and not (sticky_ok and mode & stat.S_ISVTX):
        raise UnsafePlace(f"{what} {path}: directory {directory} can be written by other users (mode "
                          f"{mode:04o}), who could plant or replace the file; make it writable by its owner only "
                          f"(chmod go-w {directory}) or choose a private directory")


def _check_existing(name: str, what: str, path: str) -> None:
    try:
        st = os.lstat(name)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePlace(f"{what} {path}: {name} is not a regular file (a symbolic link or another kind); remove it")
    if st.st_uid not in _TRUSTED_UIDS:
        raise UnsafePlace(f"{what} {path}: {name} belongs to another user (uid {st.st_uid}); remove it")
    if stat.S_IMODE(st.st_mode) & _OTHERS_WRITE:
        raise UnsafePlace(f"{what} {path}: {name} can be written by other users; chmod 600 {name}")


def temp_name(path: str) -> str:
    # Unpredictable, so nobody can have put anything at the name before it is made.
    return f"{path}.{secrets.token_hex(8)}.tmp"


def _new_temp(path: str) -> tuple[int, str]:
    for _ in range(TEMP_ATTEMPTS):
        tmp = temp_name(path)
        try:
            return os.open(tmp, _NEW_FILE, 0o600), tmp
        except FileExistsError:
            continue  # something is there already (a clash, or planted): never opened, another name is drawn
        except OSError as e:
            raise PrivateFileError(f"cannot write {path}: {_why(e)}") from None
    raise PrivateFileError(f"cannot write {path}: {TEMP_ATTEMPTS} temporary names beside it were taken")


def write_private(path: str, payload: bytes, *, sync: bool = True, mtime_ns: int | None = None) -> None:
    """Replace `path` whole with an owner-only (0600) file: written aside under a fresh unpredictable name
    (exclusive, never through a link), synced, renamed over `path` (which replaces a link there rather than
    following it), then the directory synced. PrivateFileError with the reason; `path` is unchanged then, unless
    only the directory's sync failed (the new file is in place, its rename may not survive a crash)."""
    fd, tmp = _new_temp(path)
    try:
        try:
            os.fchmod(fd, 0o600)  # exactly owner-only, whatever the umask
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            if mtime_ns is not None:
                os.utime(fd, ns=(mtime_ns, mtime_ns))
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        if sync:
            d = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(d)  # the rename itself survives a crash
            finally:
                os.close(d)
    except OSError as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass  # renamed already: only the directory's sync failed
        except OSError:
            raise PrivateFileError(f"cannot write {path}: {_why(e)}; {tmp} is left") from None
        raise PrivateFileError(f"cannot write {path}: {_why(e)}") from None


def open_lock(path: str) -> int:
    """A descriptor on the lock file `path` (made owner-only if new), never through a link, and only if it is a
    regular file of this user's: another user's lock could be held by them for ever. PrivateFileError if not."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise PrivateFileError(f"cannot open {path}: {_why(e)}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise PrivateFileError(f"cannot use {path}: not a regular file of this user's")
    return fd


def read_private(path: str) -> tuple[bytes, os.stat_result] | None:
    """The bytes and status of the regular file `path`, opened never through a link; None if it does not exist.
    PrivateFileError when it cannot be read, is a link or is not a regular file."""
    try:
        # O_NONBLOCK: a FIFO put there must not block the open; a regular file ignores the flag.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise PrivateFileError(f"cannot read {path}: {_why(e)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PrivateFileError(f"cannot read {path}: not a regular file")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
    except PrivateFileError:
        raise
    except OSError as e:
        raise PrivateFileError(f"cannot read {path}: {_why(e)}") from None
    finally:
        os.close(fd)
    return b"".join(chunks), st
