"""A trained head grows with new identities (``ds_pfc.train.init.class_map``).

A fresh run's head of ``ds_pfc.head.num_classes`` classes starts from the head shards
of an earlier run (any number of ranks, any number of classes) and a class map, old
class id -> new class id:

1. :func:`read_class_map` reads the map (a JSON object ``{"old": new}`` or lines
   ``old new``) and refuses a malformed one, an empty one, an old id listed twice or
   two old ids sent to one new id.
2. :func:`grow_head`: every rank places the old rows whose new ids it owns into its
   own shard, bitwise: the centers and, with ``optimizer_states``, every optimizer
   state saved with them (SGD momentum, AdamW moments and step counts). A rank reads
   only the old rows it needs, through safetensors slices of the old shards, in
   windows of at most ``GROW_WINDOW_BYTES``: under a map that keeps ids in place it
   reads its own range alone; under a permutation it may scan every old shard, but
   never holds more than one window beside its shard. Each old shard it reads from is
   checked against its checksums once first.
3. :func:`imprint_rows`: the classes no old id maps to (:attr:`GrownHead.new_classes`)
   start from their training images (``new_rows: imprint``): sub-center 0 of each such
   class becomes the unit vector along the mean of its images' L2-normalised
   embeddings under the initial backbone (eval mode). One pass over those classes'
   images, shared by the ranks: the classes are taken in blocks of at most
   ``IMPRINT_BLOCK_BYTES`` of float64 sums; every rank embeds an equal share of each
   block's images (so the work is balanced even when every new id sits on the last
   ranks, as when new ids are appended), the block's per-class sums are all-reduced,
   and each rank writes the rows it owns. A class without images keeps its fresh row;
   ``new_rows: random`` keeps every fresh row.

Why unit norm, not the fresh rows' norm: the margin softmax sees only a center's
direction, but the row optimizer moves the raw row, and a step turns it by about
``lr |g| / |w|^2`` (``g`` the gradient with respect to the unit direction). The
head's fresh rows have norm ``init_std sqrt(d)`` (0.08 at d = 64, 0.23 at d = 512)
while trained rows grow to norms of order 1 to 10 (4.3 on average in the grow
study's base head), so at the fresh norm an imprinted direction is turned away
within the first few SGD steps: in a pilot of the study (:mod:`ds_pfc.bench.grow`,
100 -> 200 identities, 2 seeds) the training loss went from 2.0 at step 1 to 7.3 at
step 5, worse than random rows' 4.9; at unit norm it stayed at 1.7 (at norm 2.5:
1.75). Unit norm is a fixed scale, the same for every head, of the order of trained
rows.

Why the embeddings are normalised before the mean: the logit of a class is the
cosine between a normalised embedding and the center, so the direction that
maximises the summed cosine of a class's images is that of the sum of their
normalised embeddings (weight imprinting, Qi et al. 2018).

Memory per rank beyond its shard: the map (two int64 per entry), a table of 8 bytes
per class, the training labels and the order of the imprinted classes' images (about
24 bytes per image), one read window or one block of sums, and a batch of images;
never the old head or the new one whole.
"""
from __future__ import annotations

import json
import multiprocessing
import os
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..core import collectives
from ..core.partition import Partition
from ..devices import collective_device
from .config import ConfigError

__all__ = ["read_class_map", "grow_head", "imprint_rows", "zero_optimizer_states", "GrownHead", "Imprinted",
           "GROW_WINDOW_BYTES", "IMPRINT_BLOCK_BYTES"]

MAP_KEY = "ds_pfc.train.init.class_map"
HEAD_KEY = "ds_pfc.train.init.head"
GROW_WINDOW_BYTES = 64 << 20
"""Bytes of old rows (every state read) one window of :func:`grow_head` reads at once."""
IMPRINT_BLOCK_BYTES = 64 << 20
"""Bytes of float64 per-class sums in one block of :func:`imprint_rows` (one all-reduce)."""

_INT = re.compile(r"\d+")


class _Pairs(list):
    """A JSON object's ``(key, value)`` pairs in file order (duplicate keys kept)."""


def read_class_map(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(old_ids, new_ids)``, int64 ``[M]`` each, sorted by old id: the class map in
    ``path``. A ``.json`` file (or one starting with ``{``) is a JSON object whose keys
    are old ids as decimal strings and whose values are new ids; any other file has
    one ``old new`` pair per line (whitespace or a comma between; blank lines and
    ``#`` comments are skipped). Ids are integers >= 0. A :class:`ConfigError` naming
    ``ds_pfc.train.init.class_map`` for an unreadable or malformed file, an empty map,
    an old id listed twice or a new id that two old ids map to; the ranges are
    :func:`grow_head`'s to check (they need the heads)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{MAP_KEY}: cannot read {path!r} ({err})") from None
    if path.lower().endswith(".json") or text.lstrip().startswith("{"):
        old, new = _json_pairs(path, text)
    else:
        old, new = _text_pairs(path, text)
    if not old:
        raise ConfigError(f"{MAP_KEY}: {path} maps no class (an empty map); list 'old new' pairs")
    old_ids, new_ids = torch.tensor(old, dtype=torch.int64), torch.tensor(new, dtype=torch.int64)
    order = torch.argsort(old_ids, stable=True)
    old_ids, new_ids = old_ids[order], new_ids[order]
    twice = torch.nonzero(old_ids[1:] == old_ids[:-1]).view(-1)
    if twice.numel():
        i = int(twice[0])
        raise ConfigError(f"{MAP_KEY}: {path} lists old id {int(old_ids[i])} twice (to {int(new_ids[i])} and "
                          f"{int(new_ids[i + 1])}); each old class has one new id")
    by_new = torch.argsort(new_ids, stable=True)
    sorted_new = new_ids[by_new]
    clash = torch.nonzero(sorted_new[1:] == sorted_new[:-1]).view(-1)
    if clash.numel():
        i = int(clash[0])
        raise ConfigError(f"{MAP_KEY}: {path} maps old ids {int(old_ids[by_new[i]])} and "
                          f"{int(old_ids[by_new[i + 1]])} to the same new id {int(sorted_new[i])}; two old "
                          "classes cannot share a row (merge them in the data, or map one of them)")
    return old_ids, new_ids


def _json_pairs(path: str, text: str) -> tuple[list[int], list[int]]:
    try:
        data = json.loads(text, object_pairs_hook=_Pairs)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{MAP_KEY}: {path} is not valid JSON ({err})") from None
    if not isinstance(data, _Pairs):
        raise ConfigError(f"{MAP_KEY}: {path} must hold a JSON object {{\"old id\": new id, ...}}, got "
                          f"{type(data).__name__}")
    old, new, seen = [], [], set()
    for key, value in data:
        if not _INT.fullmatch(key):
            raise ConfigError(f"{MAP_KEY}: {path}: key {key!r} is not an old class id (a decimal integer >= 0)")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{MAP_KEY}: {path}: the new id of old id {key} must be an integer >= 0, "
                              f"got {value!r}")
        if key in seen:
            raise ConfigError(f"{MAP_KEY}: {path} lists old id {key} twice; each old class has one new id")
        seen.add(key)
        old.append(int(key))
        new.append(value)
    return old, new


def _text_pairs(path: str, text: str) -> tuple[list[int], list[int]]:
    old, new = [], []
    for number, line in enumerate(text.splitlines(), 1):
        body = line.split("#", 1)[0].strip()
        if not body:
            continue
        fields = [f for f in re.split(r"[,\s]+", body) if f]
        if len(fields) != 2 or not all(_INT.fullmatch(f) for f in fields):
            raise ConfigError(f"{MAP_KEY}: {path} line {number}: expected two class ids 'old new' (integers "
                              f">= 0), got {line.strip()!r}")
        old.append(int(fields[0]))
        new.append(int(fields[1]))
    return old, new


@dataclass(frozen=True)
class GrownHead:
    """What :func:`grow_head` did (the same on every rank)."""

    old_num_classes: int
    old_world_size: int
    moved: int
    """Old rows placed at their new ids (the map's size)."""
    states: tuple
    """The states moved with them (``weight`` and, with ``optimizer_states``, the rest)."""
    new_classes: torch.Tensor
    """int64, sorted: the new ids no old id maps to (they hold the head's fresh rows)."""


def grow_head(head, directory: str, old_ids: torch.Tensor, new_ids: torch.Tensor, *,
              optimizer_states: bool = True) -> GrownHead:
    """Place the rows of the old head in ``directory`` (shards of any world size) at
    their new ids in ``head``, a freshly built :class:`~ds_pfc.core.head.PartialFC`
    (this rank's shard only): old class ``old_ids[i]`` becomes new class
    ``new_ids[i]`` (:func:`read_class_map`), bitwise, with every optimizer state when
    ``optimizer_states`` (else they stay zero). Classes no old id maps to keep the
    head's fresh rows; the head's counters (sampler step, optimizer steps) and margin
    state stay those of a new head. No collective: each rank reads what it needs.

    A :class:`ConfigError` naming the key when the map does not fit the heads (an old
    id past the old head's classes, a new id past ``head.num_classes``) or the old head
    does not fit this one (embedding size, sub-centers, the optimizer's states or the
    dtypes, which must match for the copy to be exact)."""
    from ..checkpoint import shards as ckpt
    if head.sample_step or head.step_count:
        raise ValueError(f"head must be freshly built (it has taken {head.sample_step} forward passes and "
                         f"{head.step_count} steps)")
    old_ids, new_ids = _check_id_tensors(old_ids, new_ids)
    if not os.path.isdir(directory):
        raise ConfigError(f"{HEAD_KEY}: no such directory {directory!r}")
    try:
        shards = ckpt.open_shards(directory)
    except (ValueError, FileNotFoundError) as err:
        raise ConfigError(f"{HEAD_KEY}: {err}") from None
    meta = shards.meta
    old_classes = meta["num_classes"]
    if meta["embedding_size"] != head.embedding_size:
        raise ConfigError(f"{HEAD_KEY}: {directory} holds centers of embedding size {meta['embedding_size']}, this "
                          f"head's is {head.embedding_size} (ds_pfc.head.embedding_size); a grown head keeps the "
                          "embedding size of the one it grows from")
    if meta["sub_centers"] != head.sub_centers:
        raise ConfigError(f"{HEAD_KEY}: {directory} holds {meta['sub_centers']} sub-center(s) per class, this head "
                          f"{head.sub_centers} (ds_pfc.head.sub_centers)")
    if int(old_ids.max()) >= old_classes:
        raise ConfigError(f"{MAP_KEY}: old id {int(old_ids.max())} is not a class of the old head in {directory} "
                          f"(it has {old_classes} classes: ids 0..{old_classes - 1})")
    if int(new_ids.max()) >= head.num_classes:
        raise ConfigError(f"{MAP_KEY}: new id {int(new_ids.max())} is not a class of this head "
                          f"(ds_pfc.head.num_classes is {head.num_classes}: ids 0..{head.num_classes - 1})")
    names = head.bank.state_names()
    states = [n for n in names if n == "weight" or optimizer_states]
    if optimizer_states and sorted(shards.states) != sorted(names):
        raise ConfigError(f"{HEAD_KEY}: {directory} holds states {sorted(shards.states)} (optimizer "
                          f"{meta['optimizer']}) but this head holds {sorted(names)} (optimizer {head.optimizer}); "
                          "set ds_pfc.head.optimizer to the old one, or ds_pfc.train.init.optimizer_states false "
                          "to start the states at zero")
    empty = torch.zeros(0, dtype=torch.long, device=head.device)
    for key in states:
        want = head.bank.read(key, empty).dtype
        if key not in shards.dtypes or shards.dtypes[key] != want:
            raise ConfigError(f"{HEAD_KEY}: state {key!r} of {directory} is {shards.dtypes.get(key)}, this head "
                              f"stores {want}: the rows could not move exactly")

    # This rank's rows, in old-id order (the order the windows read them in).
    mine = (new_ids >= head.class_start) & (new_ids < head.class_end)
    old_mine, new_mine = old_ids[mine], new_ids[mine] - head.class_start
    head.flush()
    if old_mine.numel():
        sources = Partition(old_classes, shards.world_size).owner(old_mine).unique().tolist()
        for r in sources:                 # each old shard read from: checked once, streaming
            ckpt.verify_shard(shards.files[r])
        k = head.sub_centers
        row_bytes = k * sum(torch.Size(shards.row_shapes[s]).numel() * torch.empty((), dtype=shards.dtypes[s])
                            .element_size() for s in states)
        window = max(1, GROW_WINDOW_BYTES // max(1, row_bytes))
        sub = torch.arange(k)
        i, n = 0, old_mine.numel()
        while i < n:
            start = int(old_mine[i])
            j = int(torch.searchsorted(old_mine, start + window))
            end = int(old_mine[j - 1]) + 1           # up to the window's last needed class
            part = _read_classes(shards, start, end, states)
            src = ((old_mine[i:j] - start)[:, None] * k + sub).reshape(-1)
            dst = (new_mine[i:j][:, None] * k + sub).reshape(-1).to(head.device)
            for key in states:
                head.bank.write(key, dst, part[key].index_select(0, src).to(head.device))
            del part
            i = j
    taken = torch.zeros(head.num_classes, dtype=torch.bool)
    taken[new_ids] = True
    return GrownHead(old_num_classes=old_classes, old_world_size=shards.world_size, moved=int(old_ids.numel()),
                     states=tuple(states), new_classes=torch.nonzero(~taken).view(-1))


def _check_id_tensors(old_ids, new_ids) -> tuple[torch.Tensor, torch.Tensor]:
    for name, ids in (("old_ids", old_ids), ("new_ids", new_ids)):
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
            raise TypeError(f"{name} must be an int64 [M] tensor, got "
                            f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}")
    if old_ids.shape != new_ids.shape or not old_ids.numel():
        raise ValueError(f"old_ids and new_ids must be non-empty and of one length, got {old_ids.numel()} and "
                         f"{new_ids.numel()}")
    if int(old_ids.min()) < 0 or int(new_ids.min()) < 0:
        raise ConfigError(f"{MAP_KEY}: class ids must be >= 0")
    order = torch.argsort(old_ids, stable=True)
    old_ids, new_ids = old_ids[order].cpu(), new_ids[order].cpu()
    if bool((old_ids[1:] == old_ids[:-1]).any()) or new_ids.unique().numel() != new_ids.numel():
        raise ConfigError(f"{MAP_KEY}: every old id must appear once and map to a new id of its own")
    return old_ids, new_ids


def _read_classes(shards, start: int, end: int, states) -> dict[str, torch.Tensor]:
    """The rows of old classes ``[start, end)`` of ``states``, read from the shards that
    hold them (:meth:`ShardSet.read_rows` for a subset of the states; the shards were
    verified already)."""
    from ..checkpoint.shards import _copy_rows, class_rows
    rows = class_rows(shards.meta, start, end)
    lo, hi = rows.start, rows.stop
    out = {key: torch.empty((hi - lo,) + shards.row_shapes[key], dtype=shards.dtypes[key]) for key in states}
    for r in shards.sources(start, end):
        r_lo, r_hi = shards.row_range(r)
        a, b = max(lo, r_lo), min(hi, r_hi)
        for key, dst in out.items():
            _copy_rows(shards.files[r], key, a - r_lo, b - r_lo, dst[a - lo:b - lo])
    return out


def zero_optimizer_states(head) -> None:
    """Set every state of ``head``'s bank but ``weight`` to zero, a chunk of rows at a
    time (``init.optimizer_states: false`` for a head loaded as it was saved)."""
    head.flush()
    for name in head.bank.state_names():
        if name == "weight":
            continue
        probe = head.bank.read(name, torch.zeros(0, dtype=torch.long, device=head.device))
        shape = tuple(probe.shape[1:])
        step = max(1, GROW_WINDOW_BYTES // max(1, torch.Size(shape).numel() * probe.element_size()))
        for lo in range(0, head.num_rows, step):
            hi = min(head.num_rows, lo + step)
            head.bank.write(name, torch.arange(lo, hi, device=head.device),
                            torch.zeros((hi - lo,) + shape, dtype=probe.dtype, device=head.device))


@dataclass(frozen=True)
class Imprinted:
    """What :func:`imprint_rows` did (the same on every rank)."""

    imprinted: int
    """Classes whose row now holds their images' mean direction."""
    without_images: int
    """Classes asked for that have no training image (their rows are unchanged)."""
    images: int
    """Training images embedded, over all ranks."""


class _Batches(torch.utils.data.Dataset):
    """Batch ``i`` of ``batches`` (index tensors into ``dataset``): images fetched and
    normalised as the training loader does, without flips; and their labels."""

    def __init__(self, dataset, batches: list[torch.Tensor]):
        self.dataset, self.batches = dataset, batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int):
        from ..data.loader import _fetch
        from ..data.transforms import normalize
        images, labels = _fetch(self.dataset, self.batches[i])
        return normalize(images), labels


@torch.no_grad()
def imprint_rows(head, backbone: torch.nn.Module, dataset, classes: torch.Tensor, *, device, batch_size: int = 256,
                 workers: int = 0) -> Imprinted:
    """Imprint the rows of global ``classes`` (int64, the same on every rank of
    ``head.group``): sub-center 0 of each class becomes the unit vector along the sum
    of its training images' L2-normalised embeddings under ``backbone`` (in eval
    mode, in float32 on ``device``, where its parameters must be; sums in float64).
    See the module docstring for the split of the work over the ranks and the norm;
    every rank of ``head.group`` must call it.

    ``dataset``: the training set, with ``labels()`` (every item's class) and items or
    a ``get_batch`` as :class:`~ds_pfc.data.loader.MicroBatchLoader` reads them.
    ``batch_size``: images per forward pass; ``workers``: loader processes (0: in this
    process)."""
    from .._checks import check_int
    check_int("batch_size", batch_size, 1)
    check_int("workers", workers, 0)
    device = torch.device(device)
    if not isinstance(classes, torch.Tensor) or classes.dtype != torch.int64 or classes.dim() != 1:
        raise TypeError(f"classes must be an int64 [n] tensor, got {classes!r:.60}")
    classes = classes.cpu()
    if classes.numel() and (int(classes.min()) < 0 or int(classes.max()) >= head.num_classes
                            or classes.unique().numel() != classes.numel()):
        raise ValueError(f"classes must be distinct ids in [0, {head.num_classes})")
    params = [p.device for p in backbone.parameters()]
    if params and any(d.type != device.type or (device.index is not None and d.index != device.index)
                      for d in params):
        raise ValueError(f"backbone's parameters must be on device {device}, found {sorted({str(d) for d in params})}")
    labels_of = getattr(dataset, "labels", None)
    if labels_of is None:
        raise TypeError(f"dataset {type(dataset).__name__} has no labels(): imprinting needs every item's class "
                        "before the pass (set ds_pfc.train.init.new_rows to random)")
    labels = torch.as_tensor(labels_of(), dtype=torch.int64).view(-1)
    if labels.numel() != len(dataset):
        raise ValueError(f"dataset.labels() gives {labels.numel()} labels for {len(dataset)} items")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= head.num_classes):
        raise ValueError(f"dataset labels must lie in [0, {head.num_classes}) (head.num_classes), got "
                         f"{int(labels.min())}..{int(labels.max())}")
    world, rank = collectives.world_size(head.group), collectives.rank(head.group)
    num = classes.numel()
    position = torch.full((head.num_classes,), -1, dtype=torch.int64)
    position[classes] = torch.arange(num)
    at = position[labels]
    items = torch.nonzero(at >= 0).view(-1)
    order = torch.argsort(at[items], stable=True)
    items, at = items[order], at[items][order]      # the imprinted classes' images, by class
    del order
    counts = torch.bincount(at, minlength=num)
    first = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    d, k = head.embedding_size, head.sub_centers
    per_block = max(1, IMPRINT_BLOCK_BYTES // (8 * d))
    blocks, batches = [], []
    for b0 in range(0, num, per_block):      # every rank: the same blocks; its own share of each one's images
        b1 = min(num, b0 + per_block)
        lo, hi = int(first[b0]), int(first[b1])
        a, e = lo + (hi - lo) * rank // world, lo + (hi - lo) * (rank + 1) // world
        mine = [items[s:min(e, s + batch_size)] for s in range(a, e, batch_size)]
        blocks.append((b0, b1, len(mine)))
        batches += mine
    loader = torch.utils.data.DataLoader(
        _Batches(dataset, batches), batch_size=None, shuffle=False, num_workers=workers,
        multiprocessing_context="fork" if workers and "fork" in multiprocessing.get_all_start_methods() else None)
    reduce_on = collective_device(head.group, device)
    dtype = head.bank.read("weight", torch.zeros(0, dtype=torch.long, device=head.device)).dtype
    was_training = backbone.training
    backbone.eval()
    imprinted = 0
    try:
        fetched = iter(loader)
        for b0, b1, count in blocks:
            sums = torch.zeros(b1 - b0, d, dtype=torch.float64, device=device)
            for _ in range(count):
                x, y = next(fetched)
                emb = backbone(x.to(device, torch.float32)).to(torch.float64)
                if emb.shape != (x.shape[0], d):
                    raise ValueError(f"backbone gives embeddings of shape {tuple(emb.shape)}, the head takes "
                                     f"[N, {d}] (head.embedding_size)")
                slot = position[y.to(torch.int64).cpu()]
                if bool((slot < b0).any() or (slot >= b1).any()):
                    raise RuntimeError("the dataset's items do not carry the classes its labels() gives")
                sums.index_add_(0, (slot - b0).to(device), torch.nn.functional.normalize(emb, dim=1))
            if world > 1:
                sums = sums.to(reduce_on)
                dist.all_reduce(sums, group=head.group)
            sums = sums.to(device)
            norms = sums.norm(dim=1)
            ok = (norms > 0).cpu()
            imprinted += int(ok.sum())
            ids = classes[b0:b1]
            own = ok & (ids >= head.class_start) & (ids < head.class_end)
            if bool(own.any()):
                rows = ((ids[own] - head.class_start) * k).to(head.device)
                keep = own.to(device)
                head.bank.write("weight", rows, (sums[keep] / norms[keep, None]).to(head.device, dtype))
    finally:
        backbone.train(was_training)
    return Imprinted(imprinted=imprinted, without_images=int((counts == 0).sum()), images=int(items.numel()))
