"""Checkpoint directories: which tags are complete, which one a run resumes, how a
save becomes a tag, and what a crash can leave behind.

A checkpoint directory (``save_dir``) holds one sub-directory per tag, a ``latest``
file naming the tag to resume, and nothing a run needs besides. A tag is *complete*
when its ``ds_pfc_complete.json`` marker is there; the marker records the optimizer
step (``global_steps``), the world size, the heads and the size of every file
DeepSpeed wrote, so tags are ordered by step (never by file times) and checked
before anything is loaded from them.

A save never writes into a tag directory: every rank writes into a fresh staging
directory ``<tag>.tmp-<hex>`` (DeepSpeed saves with that name as its tag: its files
do not record the tag, so the directory loads under its final name), fsyncs what it
wrote, and after a barrier rank 0 writes the marker there, renames the directory to
``<tag>``, fsyncs ``save_dir`` and points ``latest`` at the tag (a file replaced
atomically, directory fsynced). Files of an earlier save of the same tag (another
world size, a killed attempt) therefore never mix into it.
A crash leaves either no new tag or a complete one; a crash between the rename and
``latest`` leaves ``latest`` one tag behind, and :func:`choose_tag` then resumes the
newer complete tag. Leftovers (staging directories, ``*.tmp-*`` files, tags being
removed, marker-less tag directories of older steps) are deleted by
:func:`clean_leftovers` after the next save.

Collectives here (:func:`on_rank0`, :func:`agree`, :func:`check_shared_directory`)
use the default process group unless given one, and run locally without one.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import socket
import time
import uuid
import zipfile
from dataclasses import dataclass

import torch.distributed as dist

from . import shards as ckpt
from .files import atomic_write, fsync_dir, fsync_file

__all__ = ["COMPLETE_MARKER", "LATEST", "SUPERSEDED", "CheckpointError", "CheckpointIncompleteError",
           "CheckpointCorruptError", "SharedDirectoryError", "TagInfo", "Choice", "check_tag_name", "read_marker",
           "scan", "complete_tags", "read_latest", "write_latest", "verify_tag", "newest_intact", "choose_tag",
           "with_fallback", "commit_staged", "remove_tag", "clean_leftovers", "prune", "supersede", "engine_files",
           "atomic_write", "rank_state_name", "fsync_file", "fsync_dir", "on_rank0", "agree",
           "check_shared_directory", "content_files", "check_content", "verify_share"]

COMPLETE_MARKER = "ds_pfc_complete.json"
LATEST = "latest"
SUPERSEDED = "superseded"
"""Sub-directory that keeps the tags of a run rolled back with an explicit resume tag."""
TMP_INFIX = ".tmp-"
"""In the name of every staging directory, temporary file and tag being removed."""
PROBE_PREFIX = ".ds_pfc-probe-"

_RANK_STATE = re.compile(r"rank_state-\d{5}-of-\d{5}\.pt")
_ANY_SHARD = re.compile(r".+-rank\d{5}-of-\d{5}\.safetensors")
_ENGINE_FILE = re.compile(r".*(model_states|optim_states)\.pt")
_NAME_STEP = re.compile(r"\D*?(\d+)")
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_MAGIC = b"\x80"


# ------------------------------------------------------------------------ errors
class CheckpointError(RuntimeError):
    """A checkpoint cannot be used. ``path`` is the file or directory at fault;
    ``fallback`` the newest intact tag of the same directory, if any."""

    def __init__(self, message: str, *, path: str | None = None, fallback: str | None = None):
        super().__init__(message)
        self.path, self.fallback = path, fallback

    def __reduce__(self):       # keep path and fallback across ranks (pickled by the collectives)
        return _rebuild_error, (type(self), str(self), self.path, self.fallback)


def _rebuild_error(cls, message, path, fallback):
    return cls(message, path=path, fallback=fallback)


class CheckpointIncompleteError(CheckpointError):
    """A checkpoint tag directory lacks the completion marker (a save was interrupted)."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is missing, truncated or unreadable."""


class SharedDirectoryError(CheckpointError):
    """Some ranks do not see the checkpoint directory rank 0 writes to."""


# ------------------------------------------------------------------------ files
def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def check_tag_name(tag) -> str:
    """``tag`` if it can name a tag directory (ValueError naming the problem otherwise)."""
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"tag must be a non-empty string, got {tag!r}")
    if tag != tag.strip() or not tag.isprintable():
        raise ValueError(f"tag must be printable without surrounding white space, got {tag!r}")
    if "/" in tag or "\\" in tag or tag.startswith("."):
        raise ValueError(f"tag must be a plain directory name (no '/', not hidden), got {tag!r}")
    if TMP_INFIX in tag:
        raise ValueError(f"tag must not contain {TMP_INFIX!r} (names of staging directories), got {tag!r}")
    if tag in (LATEST, SUPERSEDED):
        raise ValueError(f"tag {tag!r} is reserved in a checkpoint directory")
    return tag


# ------------------------------------------------------------------------ markers and tags
def read_marker(tag_dir: str) -> dict:
    """The completion marker of ``tag_dir``: CheckpointIncompleteError when absent,
    CheckpointCorruptError when it is not a valid marker."""
    path = os.path.join(tag_dir, COMPLETE_MARKER)
    if not os.path.isfile(path):
        raise CheckpointIncompleteError(f"{tag_dir} has no {COMPLETE_MARKER}: its save did not finish",
                                        path=tag_dir)
    try:
        with open(path, "rb") as f:
            marker = json.loads(f.read().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointCorruptError(f"{path} is not a readable marker ({err})", path=path) from None
    problem = None
    if not isinstance(marker, dict):
        problem = f"a JSON {type(marker).__name__}, not an object"
    else:
        for key in ("world_size", "global_steps"):
            value = marker.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if key == "world_size" else 0):
                problem = f"{key}={value!r}"
        heads = marker.get("heads")
        if not isinstance(heads, list) or not all(isinstance(h, str) for h in heads):
            problem = f"heads={heads!r}"
        files = marker.get("engine_files")
        if files is not None and not (isinstance(files, dict) and all(
                isinstance(k, str) and isinstance(v, int) for k, v in files.items())):
            problem = "engine_files is not a map of names to sizes"
    if problem is not None:
        raise CheckpointCorruptError(f"{path} is not a valid marker ({problem})", path=path)
    return marker


@dataclass
class TagInfo:
    """A sub-directory of a checkpoint directory that may be a tag."""

    name: str
    path: str
    marker: dict | None = None
    """The marker if present and valid."""
    error: CheckpointError | None = None
    """Why the marker is unusable (absent: CheckpointIncompleteError)."""

    @property
    def complete(self) -> bool:
        return self.marker is not None

    @property
    def steps(self) -> int | None:
        """``global_steps`` from the marker, else the number the name ends with."""
        if self.marker is not None:
            return int(self.marker["global_steps"])
        m = _NAME_STEP.fullmatch(self.name)
        return int(m.group(1)) if m else None


def _is_special(name: str) -> bool:
    return TMP_INFIX in name or name.startswith(".") or name in (LATEST, SUPERSEDED)


def scan(save_dir: str) -> list[TagInfo]:
    """Every candidate tag directory of ``save_dir`` (staging directories, hidden
    entries and ``superseded`` excluded), in name order."""
    if not os.path.isdir(save_dir):
        return []
    found = []
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        if _is_special(name) or not os.path.isdir(path):
            continue
        info = TagInfo(name, path)
        try:
            info.marker = read_marker(path)
        except CheckpointError as err:
            info.error = err
        found.append(info)
    return found


def _order(infos) -> list[TagInfo]:
    return sorted(infos, key=lambda i: (i.steps, i.name))


def complete_tags(save_dir: str) -> list[TagInfo]:
    """The complete tags (valid marker), oldest first by ``global_steps`` (ties by name)."""
    return _order(i for i in scan(save_dir) if i.complete)


def read_latest(save_dir: str) -> str | None:
    """The tag ``save_dir/latest`` names, None without that file; CheckpointCorruptError
    when it does not hold a tag name (empty, binary, not UTF-8, a path)."""
    path = os.path.join(save_dir, LATEST)
    if not os.path.lexists(path):
        return None
    raw = b""
    try:
        with open(path, "rb") as f:
            raw = f.read(4096)
        return check_tag_name(raw.decode("utf-8").strip())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointCorruptError(f"{path} does not hold a checkpoint tag name ({err}; it starts {raw[:40]!r})",
                                     path=path) from None


def write_latest(save_dir: str, tag: str) -> None:
    atomic_write(os.path.join(save_dir, LATEST), check_tag_name(tag).encode())


# ------------------------------------------------------------------------ verification
def _check_torch_file(path: str, deep: bool) -> None:
    """A ``torch.save`` file: the zip structure (and with ``deep`` every member's
    CRC) or, for the legacy format, its magic number."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head == _ZIP_MAGIC:
        try:
            with zipfile.ZipFile(path) as z:
                bad = z.testzip() if deep else None
        except (zipfile.BadZipFile, OSError, EOFError) as err:
            raise CheckpointCorruptError(f"{path} is truncated or corrupt ({err})", path=path) from None
        if bad is not None:
            raise CheckpointCorruptError(f"{path} is corrupt (checksum of {bad!r} does not match)", path=path)
    elif not head.startswith(_PICKLE_MAGIC):
        raise CheckpointCorruptError(f"{path} is not a torch.save file (starts {head!r})", path=path)


def _check_shard(path: str, name: str, rank: int, world_size: int) -> None:
    import safetensors
    try:
        with safetensors.safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as err:     # safetensors raises its own error type for every kind of damage
        raise CheckpointCorruptError(f"{path} is truncated or corrupt ({err})", path=path) from None
    if meta.get("format") != ckpt.FORMAT or meta.get("rank") != str(rank) or \
            meta.get("world_size") != str(world_size):
        raise CheckpointCorruptError(f"{path} is not rank {rank} of {world_size} of head {name!r} "
                                     f"(format {meta.get('format')!r}, rank {meta.get('rank')!r}, "
                                     f"world_size {meta.get('world_size')!r})", path=path)


def rank_state_name(rank: int, world_size: int) -> str:
    return f"rank_state-{rank:05d}-of-{world_size:05d}.pt"


def head_world_sizes(marker: dict) -> dict[str, int]:
    """``head name -> number of shards`` of a checkpoint: each head's class-group size
    (``head_layouts``), the job's world size for markers that predate it."""
    layouts = marker.get("head_layouts") or {}
    return {name: int(layouts.get(name, {}).get("world_size", marker["world_size"])) for name in marker["heads"]}


def verify_tag(tag_dir: str, marker: dict | None = None, *, deep: bool = True) -> dict:
    """Check that every file of the checkpoint in ``tag_dir`` is there and sound,
    without loading it: head shards (ranks ``0..k-1`` of each head's class group,
    safetensors header and length), per-rank state files and DeepSpeed's files (the
    sizes the marker recorded; zip structure, with ``deep`` every CRC). Shards of
    another world size are ignored. Returns the marker; raises CheckpointError
    naming the first bad file. Without ``deep`` it reads headers and sizes only;
    :func:`verify_share` spreads the content checks over the ranks of a job."""
    if marker is None:
        marker = read_marker(tag_dir)
    world = int(marker["world_size"])

    for name, shards in head_world_sizes(marker).items():
        for rank in range(shards):
            _check_shard(_present(os.path.join(tag_dir, ckpt.shard_file_name(name, rank, shards))), name, rank,
                         shards)
    for rank in range(world):
        _check_torch_file(_present(os.path.join(tag_dir, rank_state_name(rank, world))), False)
    for rel, size in sorted(_engine_files(tag_dir, marker).items()):
        path = _present(os.path.join(tag_dir, rel))
        actual = os.path.getsize(path)
        if size is not None and actual != size:
            raise CheckpointCorruptError(f"{path} has {actual} bytes but its save wrote {size}", path=path)
        if path.endswith(".pt"):
            _check_torch_file(path, False)
    if deep:
        for path in content_files(tag_dir, marker):
            check_content(path)
    return marker


def _present(path: str) -> str:
    if not os.path.isfile(path):
        raise CheckpointCorruptError(f"{path} is missing", path=path)
    return path


def _engine_files(tag_dir: str, marker: dict) -> dict:
    """``relative path -> size saved (None: not recorded)`` of DeepSpeed's files."""
    files = marker.get("engine_files")
    if files is None:       # a marker that predates the file list
        names = [n for n in os.listdir(tag_dir) if _ENGINE_FILE.fullmatch(n)]
        if not any(n.endswith("model_states.pt") for n in names):
            raise CheckpointCorruptError(f"{tag_dir} holds no DeepSpeed module states (*model_states.pt)",
                                         path=tag_dir)
        files = {n: None for n in names}
    return files


def content_files(tag_dir: str, marker: dict, *, shard_heads=()) -> list[str]:
    """The files of the checkpoint whose bytes carry checksums to check, sorted: every
    ``torch.save`` file (per-rank states, DeepSpeed's ``.pt`` files: zip member CRCs)
    and the shards of the heads named in ``shard_heads`` (CRC-32 per tensor; a
    reader of a whole shard checks it as it loads it, so a load lists only the heads
    whose shards are read in slices)."""
    world = int(marker["world_size"])
    paths = [os.path.join(tag_dir, rank_state_name(rank, world)) for rank in range(world)]
    paths += [os.path.join(tag_dir, rel) for rel in _engine_files(tag_dir, marker) if rel.endswith(".pt")]
    shards = head_world_sizes(marker)
    for name in shard_heads:
        paths += [os.path.join(tag_dir, ckpt.shard_file_name(name, rank, shards[name])) for rank in range(shards[name])]
    return sorted(paths)


def check_content(path: str) -> None:
    """Check the bytes of one checkpoint file against the checksums it carries (a head
    shard: :func:`ds_pfc.checkpoint.verify_shard`; a ``torch.save`` file: every zip
    member's CRC); CheckpointCorruptError naming the file if they differ or it cannot
    be read."""
    if not path.endswith(".safetensors"):
        _check_torch_file(_present(path), True)
        return
    try:
        ckpt.verify_shard(_present(path))
    except OSError as err:        # ShardChecksumError, ShardReadError, I/O errors
        message = str(err) if path in str(err) else f"{path}: {err}"
        raise CheckpointCorruptError(f"{message}", path=path) from None


def verify_share(tag_dir: str, marker: dict, *, rank: int, world_size: int, shard_heads=()) -> list[str]:
    """This rank's share of the content checks of a load: file ``i`` of
    :func:`content_files` for every ``i`` with ``i % world_size == rank``, so that
    the ranks together check every file once and none reads more than its share.
    Returns the files checked; raises CheckpointError naming the first bad one (the
    caller agrees on the outcome over the ranks)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    mine = content_files(tag_dir, marker, shard_heads=shard_heads)[rank::world_size]
    for path in mine:
        check_content(path)
    return mine


def engine_files(staging_dir: str, head_shards: dict[str, int], world_size: int) -> dict[str, int]:
    """``relative path -> size`` of every file in ``staging_dir`` other than ds_pfc's
    own (head shards: ``head name -> number of shards``, per-rank state, marker,
    temporaries): DeepSpeed's files."""
    own = {ckpt.shard_file_name(h, r, k) for h, k in head_shards.items() for r in range(k)}
    own |= {rank_state_name(r, world_size) for r in range(world_size)} | {COMPLETE_MARKER}
    found = {}
    for root, _, names in os.walk(staging_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), staging_dir)
            if rel in own or TMP_INFIX in name:
                continue
            found[rel] = os.path.getsize(os.path.join(root, name))
    return found


def _intact(info: TagInfo) -> bool:
    try:
        verify_tag(info.path, info.marker, deep=False)
        return True
    except (CheckpointError, OSError):
        return False


def newest_intact(save_dir: str, *, exclude=()) -> TagInfo | None:
    """The complete tag with the most steps whose files pass :func:`verify_tag`'s
    structural checks (no CRCs), other than those in ``exclude``."""
    for info in reversed(complete_tags(save_dir)):
        if info.name not in exclude and _intact(info):
            return info
    return None


def with_fallback(err: CheckpointError, save_dir: str, exclude=()) -> CheckpointError:
    """``err`` with the newest intact tag to fall back to in its message and ``fallback``."""
    if err.fallback is not None:
        return err
    other = newest_intact(save_dir, exclude=exclude)
    if other is None:
        hint = f"there is no intact checkpoint in {save_dir} to fall back to"
    else:
        hint = f"the newest intact checkpoint is {other.name!r} (step {other.steps})"
    return type(err)(f"{err}; {hint}", path=err.path, fallback=other.name if other else None)


# ------------------------------------------------------------------------ choosing a tag
@dataclass
class Choice:
    tag: str
    marker: dict
    note: str | None = None
    """Why the tag is not the one ``latest`` names, for the log."""


def choose_tag(save_dir: str, tag: str | None = None) -> Choice | None:
    """The tag to resume in ``save_dir``: ``tag`` if given; else the one ``latest``
    names, unless a complete tag with more steps exists (``latest`` lags when a save
    was interrupted right after its tag became complete) or ``latest`` is missing,
    then the newest complete tag (``note`` says so). None when ``save_dir`` holds no
    checkpoint at all. A ``latest`` that does not name a complete tag, or a tag whose
    marker is unreadable and may be newer than the choice, raises CheckpointError
    naming the file and the newest intact tag."""
    infos = scan(save_dir)
    by_name = {i.name: i for i in infos}
    if tag is not None:
        try:
            check_tag_name(tag)
        except ValueError as err:
            raise CheckpointError(f"resume tag: {err}") from None
        info = by_name.get(tag)
        if info is None:
            names = [i.name for i in _order(i for i in infos if i.complete)]
            raise CheckpointError(f"there is no checkpoint {tag!r} in {save_dir} (complete ones: {names or 'none'})",
                                  path=os.path.join(save_dir, tag))
        if info.error is not None:
            raise with_fallback(info.error, save_dir, exclude=(tag,))
        return Choice(tag, info.marker)

    complete = _order(i for i in infos if i.complete)
    try:
        named = read_latest(save_dir)
    except CheckpointError as err:
        raise with_fallback(err, save_dir) from None
    note = None
    if named is None:
        if not complete:
            broken = [i for i in infos if isinstance(i.error, CheckpointCorruptError)]
            if broken:
                raise with_fallback(broken[-1].error, save_dir)
            return None
        choice = complete[-1]
        note = (f"{save_dir} has no '{LATEST}' file: using its newest complete checkpoint {choice.name} "
                f"(step {choice.steps})")
    else:
        latest_path = os.path.join(save_dir, LATEST)
        info = by_name.get(named)
        if info is None:
            raise with_fallback(CheckpointCorruptError(f"{latest_path} names {named!r}, which does not exist",
                                                       path=latest_path), save_dir)
        if info.error is not None:
            raise with_fallback(info.error, save_dir, exclude=(named,))
        choice = info
        if complete and complete[-1].steps > info.steps:
            choice = complete[-1]
            note = (f"{latest_path} names {named} (step {info.steps}) but {choice.name} (step {choice.steps}) is "
                    f"complete and newer (a save was interrupted before it moved '{LATEST}'): using {choice.name}")
    for other in infos:       # an unreadable marker that may belong to a newer save
        if isinstance(other.error, CheckpointCorruptError) and (other.steps is None or other.steps >= choice.steps):
            raise with_fallback(other.error, save_dir, exclude=(other.name,))
    return Choice(choice.name, choice.marker, note)


# ------------------------------------------------------------------------ writing and removing
def commit_staged(save_dir: str, staging: str, tag: str, marker: dict) -> str:
    """Rank 0's end of a save, once every rank's files in ``save_dir/staging`` are
    durable: write the marker there, make the directory tag ``tag`` (replacing a
    previous ``tag`` directory), fsync ``save_dir``, point ``latest`` at it, then
    delete leftovers. Returns the tag directory."""
    staging_dir, tag_dir = os.path.join(save_dir, staging), os.path.join(save_dir, tag)
    atomic_write(os.path.join(staging_dir, COMPLETE_MARKER), json.dumps(marker, indent=1).encode())
    old = None
    if os.path.lexists(tag_dir):
        old = os.path.join(save_dir, f"{tag}{TMP_INFIX}{uuid.uuid4().hex}")
        os.rename(tag_dir, old)
    os.rename(staging_dir, tag_dir)
    fsync_dir(save_dir)
    write_latest(save_dir, tag)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    clean_leftovers(save_dir)
    return tag_dir


def remove_tag(save_dir: str, tag: str) -> None:
    """Delete tag directory ``tag``: renamed first to a staging name (it leaves the
    listings at once; a crash during the deletion leaves a leftover that the next
    save removes), then deleted."""
    tag_dir = os.path.join(save_dir, check_tag_name(tag))
    if not os.path.lexists(tag_dir):
        return
    doomed = os.path.join(save_dir, f"{tag}{TMP_INFIX}{uuid.uuid4().hex}")
    os.rename(tag_dir, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _looks_like_tag(path: str) -> bool:
    """Whether a marker-less directory holds only what a checkpoint save writes (or nothing)."""
    names = os.listdir(path)
    return not names or any(_RANK_STATE.fullmatch(n) or _ANY_SHARD.fullmatch(n) or _ENGINE_FILE.fullmatch(n)
                            or TMP_INFIX in n for n in names)


def clean_leftovers(save_dir: str) -> list[str]:
    """Delete what interrupted saves and removals left in ``save_dir`` (rank 0 only,
    when no save is in progress): staging directories and temporary files
    (``*.tmp-*``), probe files, temporary files inside complete tags, and marker-less
    tag directories whose name ends in a step number below the newest complete tag's.
    Never the tag ``latest`` names or the newest complete one. Returns the paths."""
    if not os.path.isdir(save_dir):
        return []
    removed = []

    def delete(path):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            _remove_quietly(path)
        removed.append(path)

    for name in os.listdir(save_dir):
        if TMP_INFIX in name or name.startswith(PROBE_PREFIX):
            delete(os.path.join(save_dir, name))
    infos = scan(save_dir)
    complete = _order(i for i in infos if i.complete)
    try:
        named = read_latest(save_dir)
    except CheckpointError:
        named = None
    for info in complete:
        for name in os.listdir(info.path):
            if TMP_INFIX in name:
                delete(os.path.join(info.path, name))
    if complete:
        newest = complete[-1]
        for info in infos:
            if info.complete or info.name == named or not isinstance(info.error, CheckpointIncompleteError):
                continue
            if info.steps is not None and info.steps < newest.steps and _looks_like_tag(info.path):
                delete(info.path)
    return removed


def prune(save_dir: str, keep: int) -> list[str]:
    """Remove all but the ``keep`` complete tags with the most steps (``keep`` 0:
    none), sparing the tag ``latest`` names. Returns the removed tags."""
    if keep <= 0:
        return []
    complete = complete_tags(save_dir)
    try:
        named = read_latest(save_dir)
    except CheckpointError:
        named = None
    protected = {named, complete[-1].name if complete else None}
    removed = []
    for info in complete[:-keep]:
        if info.name not in protected:
            remove_tag(save_dir, info.name)
            removed.append(info.name)
    return removed


def supersede(save_dir: str, tag: str) -> list[str]:
    """After a run resumed the older tag ``tag`` on purpose: move every tag that may
    be newer (more steps, or an unreadable marker) to ``save_dir/superseded/`` and
    point ``latest`` at ``tag``, so that the next automatic resume continues this
    run, not the one rolled back. Returns the moved tag names."""
    infos = scan(save_dir)
    kept = {i.name: i for i in infos}[tag]
    moved = []
    for info in infos:
        if info.name == tag or not (info.complete or isinstance(info.error, CheckpointCorruptError)
                                    or _looks_like_tag(info.path)):
            continue
        if info.steps is None or info.steps > kept.steps:
            dest_dir = os.path.join(save_dir, SUPERSEDED)
            os.makedirs(dest_dir, exist_ok=True)
            dest = os.path.join(dest_dir, f"{info.name}.{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}")
            os.rename(info.path, dest)
            moved.append(info.name)
    if moved:
        fsync_dir(save_dir)
    try:
        current = read_latest(save_dir)
    except CheckpointError:
        current = None
    if current != tag:
        write_latest(save_dir, tag)
    return moved


# ------------------------------------------------------------------------ collectives
def _distributed(group) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _picklable(err: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")


def on_rank0(fn, *, group=None):
    """Call ``fn()`` on rank 0 only; every rank returns its result or raises its
    exception (a collective: one broadcast)."""
    if not _distributed(group):
        return fn()
    box = [None]
    if dist.get_rank(group) == 0:
        try:
            box[0] = (True, fn())
        except Exception as err:
            box[0] = (False, _picklable(err))
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    ok, value = box[0]
    if not ok:
        raise value
    return value


def agree(error: BaseException | None, *, group=None, same: bool = False) -> None:
    """Every rank passes the exception its part of a collective step raised (or
    None); if any rank failed, every rank raises: its own exception, else the
    lowest failing rank's (with ``same``: the lowest failing rank's on every rank,
    so all report one file). A collective: one all-gather."""
    if not _distributed(group):
        if error is not None:
            raise error
        return
    errors = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, None if error is None else _picklable(error), group=group)
    if error is not None and not same:
        raise error
    failed = next(err for err in errors if err is not None) if any(e is not None for e in errors) else None
    if failed is not None:
        raise failed


def check_shared_directory(directory: str, *, group=None, wait_s: float = 2.0) -> None:
    """Check that every rank sees the files rank 0 writes in ``directory`` (created if
    needed): rank 0 writes a uniquely named file, every rank looks for it (for up to
    ``wait_s``), the answers are gathered and the file removed. Checkpoints hold
    files of every rank and rank 0 alone writes the marker and ``latest``, so a
    directory that is not shared (node-local storage on several nodes) breaks resume
    and export. A collective that every rank must join; raises
    SharedDirectoryError on every rank, naming the directory and the ranks and hosts
    that do not see the file."""
    host = socket.gethostname()
    if not _distributed(group):
        os.makedirs(directory, exist_ok=True)
        return

    def write_probe():
        os.makedirs(directory, exist_ok=True)
        name = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
        atomic_write(os.path.join(directory, name), name.encode())
        return name

    name = on_rank0(write_probe, group=group)
    path = os.path.join(directory, name)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with open(path, "rb") as f:
                seen = f.read() == name.encode()
        except OSError:
            seen = False
        if seen or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    answers = [None] * dist.get_world_size(group)
    dist.all_gather_object(answers, (dist.get_rank(group), host, seen), group=group)
    on_rank0(lambda: _remove_quietly(path), group=group)     # gone on return, for every rank
    blind = [(r, h) for r, h, ok in answers if not ok]
    if blind:
        ranks = ", ".join(f"{r} ({h})" for r, h in blind)
        first = answers[0]
        raise SharedDirectoryError(
            f"{directory} is not shared by all ranks: rank(s) {ranks} do not see the file rank {first[0]} "
            f"({first[1]}) wrote there. Checkpoints hold every rank's files and rank 0 alone writes their "
            "marker and 'latest', so resume and export need one directory every rank reads and writes: put the "
            "output directory on a filesystem shared by all nodes", path=directory)
