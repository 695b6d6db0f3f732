"""Crash-safe file writes: the one implementation of "a file holds its old content or
the complete new one, also after a power loss" (a temporary name beside the target,
fsync, rename, directory fsync), and the fsyncs it is built from. Every checkpoint,
export, marker and pointer file of ds_pfc is written through here."""
from __future__ import annotations

import contextlib
import io
import os
import stat
import uuid

import torch

__all__ = ["atomic_file", "atomic_write", "atomic_torch_save", "fsync_file", "fsync_dir"]


def fsync_file(path: str) -> None:
    """Flush ``path``'s data to stable storage (errors propagate: the data is not safe)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str) -> None:
    """Make renames and new entries in ``directory`` durable (best effort where a
    filesystem or platform cannot fsync directories)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:   # e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: str):
    """Yields a temporary name next to ``path`` (``.<name>.tmp-<pid>-<hex>``) to write; on
    success fsyncs it, renames it to ``path`` and fsyncs the directory; on any error
    removes it. ``path`` is therefore either the old file or the complete new one, never
    a torn one. The file gets the mode of any new file under the process umask (0644 by
    default), also when the writer creates its own file: safetensors' ``save_file``
    writes a private (0600) temporary file and renames it over the name it is given."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        mode = stat.S_IMODE(os.stat(tmp).st_mode)
        yield tmp
        if stat.S_IMODE(os.stat(tmp).st_mode) != mode:
            os.chmod(tmp, mode)
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(directory)


def atomic_write(path: str, data: bytes) -> None:
    """``path`` holds ``data`` or its previous content, also after a power loss."""
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def atomic_torch_save(obj, path: str) -> None:
    """``torch.save`` with :func:`atomic_write`'s guarantees (for small objects: it is
    serialised in memory first)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    atomic_write(path, buffer.getvalue())
