"""Cleaning a label space with the model it trained (``ds-pfc-clean``).

One inference pass of a trained backbone over the training images gives every image
an L2-normalised embedding; from them:

- **centres**: per class, the unit vector along the sum of its images' embeddings
  (float64 sums; the statistic insightface's ``dataset_merge.py`` compares and
  :func:`~ds_pfc.app.grow.imprint_rows` imprints).
- **per-image scores** (:func:`image_scores`): the cosine to the own class's centre
  *without the image* (leave-one-out, so a flipped image does not vote for itself;
  NaN for a class of one image), and the best other class with its cosine (exact,
  :func:`ds_pfc.core.neighbors.nearest` with the own label excluded).
- **duplicate identities** (:func:`find_duplicates`): pairs of classes whose centres
  are within ``duplicate_cos`` (the exact blockwise top-``neighbours``), confirmed by
  the images: the share of the pair's images whose best other class is the other one
  must reach ``duplicate_evidence``, with votes from both classes (a trained head pushes a person's two labels apart,
  so their centres may sit at a cosine of only 0.5-0.6, but each label's images still
  name the other as their nearest other class). Confirmed pairs join
  into groups (union-find); a group keeps the id of its class with the most images.
  The head's own rows, when given, are compared for the candidate pairs as a second
  signal (a column of the table, not a condition).
- **mislabelled and outlier images** (:func:`find_flips`): ``flip`` when the best
  other class beats the own (leave-one-out) centre by ``flip_margin`` (it names the
  class the image points to); ``outlier`` when the image is below ``outlier_cos``
  from its own centre and points nowhere clearly. A class's siblings in a duplicate
  group do not count as another class.
- **test-set overlap** (:func:`find_overlap`): training classes whose centre is
  within ``overlap_cos`` of a test image (insightface's rule against LFW ``.bin``
  files) or, with test identities, of a test identity's centre.
- **merge of two label spaces** (:func:`merge_label_spaces`): each class of a second
  dataset takes the id of the first's class whose centre is nearest when within
  ``merge_cos``, else a new id after the first's.

:func:`plan_labels` turns the findings into a cleaned label per image (``-1``:
dropped) and a class map ``{old id: new id}`` over the kept classes, numbered
compactly, in the format ``ds_pfc.train.init.class_map`` reads
(:func:`~ds_pfc.app.grow.read_class_map`): a group's other classes are absent from
it and their images carry the kept id.

Memory: the embeddings (``N d`` float32), the centres (``C d``) and one block of
products; never a ``C x C`` or ``N x C`` matrix.

A fixed threshold is not identity truth: the tables and contact sheets are for a
person to look at before anything is deleted at scale.
"""
from __future__ import annotations

import csv
import json
import math
import os
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from ..core import collectives
from ..core.neighbors import IMPLS, NEIGHBOR_BLOCK_ROWS, nearest, sharded_nearest
from ..core.partition import Partition

__all__ = ["CleanSettings", "CleanReport", "class_centres", "image_scores", "find_duplicates", "find_flips",
           "find_overlap", "merge_label_spaces", "plan_labels", "clean_embeddings", "embed_dataset",
           "write_report", "contact_sheet", "run_clean", "load_run", "clean_sharded"]


def _cos(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not -1.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be a cosine in [-1, 1], got {value!r}")
    return float(value)


@dataclass(frozen=True, kw_only=True)
class CleanSettings:
    """The thresholds of a cleaning pass (defaults: ``docs/cleaning.md``)."""

    duplicate_cos: float = 0.4
    """Centre cosine at or above which two classes are a candidate duplicate."""
    duplicate_evidence: float = 0.5
    """Share of a candidate pair's images whose best other class is the other one of
    the pair that confirms it."""
    neighbours: int = 8
    """Candidates per class (the top-k of the centre comparison)."""
    flip_margin: float = 0.0
    """How much the best other centre must beat the own (leave-one-out) centre for a flip."""
    outlier_cos: float = 0.2
    """Below this cosine to the own centre an image that points nowhere is an outlier."""
    overlap_cos: float = 0.5
    """Centre-to-test cosine at or above which a training class overlaps the test set."""
    merge_cos: float = 0.5
    """Centre cosine at or above which a second dataset's class joins a first's."""
    block_rows: int = NEIGHBOR_BLOCK_ROWS
    """Rows per block of products."""
    impl: str = "auto"
    """``torch`` (matrix products), ``triton`` (the fused kernel: CUDA, ``neighbours`` <= 64),
    ``faiss`` (exact flat inner-product index on CPU, the optional faiss-cpu package) or
    ``auto`` (faiss for float32 CPU embeddings when installed, else torch)."""

    def __post_init__(self) -> None:
        for name in ("duplicate_cos", "overlap_cos", "merge_cos", "outlier_cos"):
            _cos(name, getattr(self, name))
        for name in ("duplicate_evidence", "flip_margin"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 2.0:
                raise ValueError(f"{name} must be a number in [0, {1 if name == 'duplicate_evidence' else 2}], "
                                 f"got {value!r}")
        if self.duplicate_evidence > 1:
            raise ValueError(f"duplicate_evidence must be a share in [0, 1], got {self.duplicate_evidence!r}")
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {', '.join(map(repr, IMPLS))}, got {self.impl!r}")
        for name in ("neighbours", "block_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_embeddings(embeddings, labels, num_classes, what: str = "embeddings") -> None:
    if not isinstance(embeddings, torch.Tensor) or embeddings.dim() != 2 or not embeddings.is_floating_point():
        raise ValueError(f"{what} must be a float tensor [N, d], got "
                         f"{getattr(embeddings, 'dtype', type(embeddings).__name__)} "
                         f"{tuple(getattr(embeddings, 'shape', ()))}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive int, got {num_classes!r}")
    if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64 \
            or tuple(labels.shape) != (embeddings.shape[0],):
        raise ValueError(f"labels must be int64 [{embeddings.shape[0]}] (one per row of {what}), got "
                         f"{getattr(labels, 'dtype', type(labels).__name__)} {tuple(getattr(labels, 'shape', ()))}")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}) (num_classes {num_classes}), got "
                         f"[{int(labels.min())}, {int(labels.max())}]")


def class_centres(embeddings: torch.Tensor, labels: torch.Tensor, num_classes: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sums float64 [C, d], counts int64 [C])`` of the L2-normalised embeddings per class."""
    _check_embeddings(embeddings, labels, num_classes)
    unit = F.normalize(embeddings.to(torch.float64), dim=1)
    sums = torch.zeros(num_classes, embeddings.shape[1], dtype=torch.float64)
    sums.index_add_(0, labels, unit)
    return sums, torch.bincount(labels, minlength=num_classes)


def image_scores(embeddings: torch.Tensor, labels: torch.Tensor, sums: torch.Tensor, counts: torch.Tensor, *,
                 block_rows: int = NEIGHBOR_BLOCK_ROWS, impl: str = "torch"
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(own_cos, other_cos, other_class)`` per image: the cosine to the own class's
    centre without the image (NaN when the class has no other image), the best other
    class's centre cosine and its id (``-1`` when there is no other class)."""
    unit = F.normalize(embeddings.to(torch.float64), dim=1)
    rest = sums[labels] - unit
    own = (unit * rest).sum(1) / rest.norm(dim=1)
    own = torch.where(counts[labels] > 1, own, torch.full_like(own, math.nan))
    values, indices = nearest(embeddings.float(), F.normalize(sums, dim=1).float(), 1, query_ids=labels,
                              block_rows=block_rows, impl=impl)
    return own.float(), values[:, 0], indices[:, 0]


def _union_find(num: int, pairs) -> list[int]:
    parent = list(range(num))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i
    for a, b in pairs:
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return [root(i) for i in range(num)]


def find_duplicates(labels: torch.Tensor, sums: torch.Tensor, counts: torch.Tensor, other_class: torch.Tensor,
                    settings: CleanSettings, head_rows: torch.Tensor | None = None
                    ) -> tuple[list[dict], list[list[int]]]:
    """``(pairs, groups)``: every candidate pair (a row per pair: classes, centre cosine,
    image evidence both ways and pooled, head cosine, confirmed) and the groups of
    confirmed pairs (each a list of class ids, the kept one first: most images, then
    lowest id).

    The evidence of a pair is the share of the images of both classes whose best other
    class (``other_class``, :func:`image_scores`) is the other one of the pair: images
    of one person under two labels name the other label, whatever training did to the
    two centres; a pair is confirmed at ``duplicate_evidence`` when images of both
    classes name the other (a look-alike's images may all name their nearest class
    while that class's images name another). ``head_rows``: the
    head's rows ``[C, d]`` or ``[C, K, d]`` (sub-centres: the best pair of
    sub-centres), or None."""
    num_classes = sums.shape[0]
    if head_rows is not None and head_rows.shape[0] != num_classes:
        raise ValueError(f"head_rows has {head_rows.shape[0]} classes but the data has {num_classes}; the head "
                         "must be the one trained on this label space")
    centres = F.normalize(sums, dim=1).float()
    values, indices = nearest(centres, centres, settings.neighbours, threshold=settings.duplicate_cos,
                              query_ids=torch.arange(num_classes), block_rows=settings.block_rows, impl=settings.impl)
    return _confirm(_candidates(values, indices, 0), _votes(labels, other_class, num_classes), counts, settings,
                    head_rows)


def _candidates(values: torch.Tensor, indices: torch.Tensor, start: int) -> list[tuple[int, int, float]]:
    """``(a, b, cos)`` with ``a < b`` of a block of top-k rows whose queries are ``start ..``."""
    a = torch.arange(start, start + indices.shape[0]).unsqueeze(1).expand_as(indices)
    keep = indices > a                                   # each pair once, from its lower id
    return list(zip(a[keep].tolist(), indices[keep].tolist(), values[keep].tolist()))


def _votes(labels: torch.Tensor, other_class: torch.Tensor, num_classes: int) -> dict[int, int]:
    """``{label * C + best other class: images}``."""
    valid = other_class >= 0
    uniq, n = torch.unique(labels[valid] * num_classes + other_class[valid], return_counts=True)
    return dict(zip(uniq.tolist(), n.tolist()))


def _confirm(candidates, votes: dict[int, int], counts: torch.Tensor, settings: CleanSettings,
             head_rows: torch.Tensor | None) -> tuple[list[dict], list[list[int]]]:
    num_classes = counts.shape[0]

    def picks(x: int, y: int) -> tuple[int, int]:
        return votes.get(x * num_classes + y, 0), int(counts[x])
    rows, confirmed = [], []
    for x, y, c in sorted(candidates):
        (p_xy, n_x), (p_yx, n_y) = picks(x, y), picks(y, x)
        evidence = (p_xy + p_yx) / max(1, n_x + n_y)
        row = {"class_a": x, "class_b": y, "centre_cos": round(c, 6), "images_a": int(counts[x]),
               "images_b": int(counts[y]), "evidence_a_to_b": round(p_xy / max(1, n_x), 6),
               "evidence_b_to_a": round(p_yx / max(1, n_y), 6), "evidence": round(evidence, 6),
               "head_cos": "" if head_rows is None else round(_head_cos(head_rows, x, y), 6)}
        # both ways: a look-alike's images all name its nearest class, that class's images name another
        row["confirmed"] = p_xy > 0 and p_yx > 0 and evidence >= settings.duplicate_evidence
        if row["confirmed"]:
            confirmed.append((x, y))
        rows.append(row)
    roots = _union_find(num_classes, confirmed)
    members: dict[int, set] = {}
    for x, y in confirmed:
        for c in (x, y):
            members.setdefault(roots[c], set()).add(c)
    groups = [sorted(g, key=lambda c: (-int(counts[c]), c)) for g in members.values()]
    groups.sort(key=lambda g: g[0])
    rows.sort(key=lambda r: (not r["confirmed"], -r["centre_cos"]))
    return rows, groups


def _head_cos(head_rows: torch.Tensor, x: int, y: int) -> float:
    wx, wy = head_rows[x].double(), head_rows[y].double()
    if wx.dim() == 1:
        wx, wy = wx[None], wy[None]
    return float((F.normalize(wx, dim=1) @ F.normalize(wy, dim=1).T).max())


def find_flips(labels: torch.Tensor, own_cos: torch.Tensor, other_cos: torch.Tensor, other_class: torch.Tensor,
               settings: CleanSettings, group_of: torch.Tensor | None = None) -> list[dict]:
    """A row per suspicious image: ``flip`` (points to ``points_to``) or ``outlier``
    (points nowhere; ``points_to`` -1). ``group_of``: int64 ``[C]``, each class's
    group's kept id (a sibling is not another class), or None."""
    if group_of is None:
        group_of = torch.arange(int(max(labels.max(), other_class.max())) + 1 if labels.numel() else 0)
    target = torch.where(other_class >= 0, group_of[other_class.clamp(min=0)], torch.full_like(other_class, -1))
    sibling = target == group_of[labels]
    known = ~torch.isnan(own_cos)
    flip = known & ~sibling & (other_class >= 0) & (other_cos - own_cos >= settings.flip_margin)
    outlier = known & ~flip & (own_cos < settings.outlier_cos)
    rows = []
    for i in torch.nonzero(flip | outlier).view(-1).tolist():
        rows.append({"image": i, "label": int(labels[i]), "own_cos": round(float(own_cos[i]), 6),
                     "other_cos": round(float(other_cos[i]), 6), "kind": "flip" if flip[i] else "outlier",
                     "points_to": int(target[i]) if flip[i] else -1})
    rows.sort(key=lambda r: (r["kind"] != "flip", r["own_cos"] - r["other_cos"], r["image"]))
    return rows


def find_overlap(sums: torch.Tensor, test_embeddings: torch.Tensor, settings: CleanSettings,
                 test_labels: torch.Tensor | None = None) -> list[dict]:
    """A row per training class whose centre is within ``overlap_cos`` of a test image
    (or, with ``test_labels``, of a test identity's centre): the class, the test
    image or identity it matches best, the cosine."""
    if not isinstance(test_embeddings, torch.Tensor) or test_embeddings.dim() != 2 \
            or test_embeddings.shape[1] != sums.shape[1]:
        raise ValueError(f"test_embeddings must be [M, {sums.shape[1]}] (the training embeddings' width), got "
                         f"{tuple(getattr(test_embeddings, 'shape', ()))}")
    keys, what = test_embeddings, "test_image"
    if test_labels is not None:
        num_test = int(test_labels.max()) + 1 if test_labels.numel() else 1
        keys, _ = class_centres(test_embeddings, test_labels, num_test)
        what = "test_identity"
    values, indices = nearest(F.normalize(sums, dim=1).float(), keys.float(), 1, threshold=settings.overlap_cos,
                              block_rows=settings.block_rows, impl=settings.impl)
    hit = torch.nonzero(indices[:, 0] >= 0).view(-1)
    return [{"class": int(c), what: int(indices[c, 0]), "cos": round(float(values[c, 0]), 6)}
            for c in hit.tolist()]


def merge_label_spaces(sums_a: torch.Tensor, sums_b: torch.Tensor, settings: CleanSettings) -> list[dict]:
    """A row per class of the second dataset: its id there, its id in the merged label
    space (a first-dataset class within ``merge_cos``, else a new id after the first's
    ``C_a``, in order), the cosine to the nearest first-dataset class."""
    if sums_a.shape[1] != sums_b.shape[1]:
        raise ValueError(f"the datasets' embeddings differ in width ({sums_a.shape[1]} vs {sums_b.shape[1]}); "
                         "embed both with the same model")
    values, indices = nearest(F.normalize(sums_b, dim=1).float(), F.normalize(sums_a, dim=1).float(), 1,
                              block_rows=settings.block_rows, impl=settings.impl)
    rows, next_id = [], sums_a.shape[0]
    for b in range(sums_b.shape[0]):
        cos = float(values[b, 0])
        if cos >= settings.merge_cos:
            merged = int(indices[b, 0])
        else:
            merged, next_id = next_id, next_id + 1
        rows.append({"class_b": b, "merged_id": merged, "nearest_a": int(indices[b, 0]), "cos": round(cos, 6),
                     "joined": merged < sums_a.shape[0]})
    return rows


def plan_labels(labels: torch.Tensor, num_classes: int, groups: list[list[int]], flips: list[dict], *,
                drop_classes=(), relabel_flips: bool = True) -> tuple[torch.Tensor, dict[int, int], torch.Tensor]:
    """``(new_labels [N], class_map {old: new}, group_of [C])``: a group's classes take
    its kept id, ``drop_classes`` (test overlap) and their images go, flipped images
    take the class they point to (``relabel_flips``) or go, outliers go; kept classes
    are renumbered compactly in old-id order. Dropped images: ``-1``."""
    group_of = torch.arange(num_classes)
    for g in groups:
        group_of[torch.tensor(g)] = g[0]
    dropped = torch.zeros(num_classes, dtype=torch.bool)
    for c in drop_classes:
        dropped[group_of[int(c)]] = True
    kept = (group_of == torch.arange(num_classes)) & ~dropped
    new_id = torch.full((num_classes,), -1, dtype=torch.int64)
    new_id[kept] = torch.arange(int(kept.sum()))
    label_of = new_id[group_of]                              # old class -> new id, -1 when gone
    new_labels = label_of[labels].clone()
    for row in flips:
        i = row["image"]
        if row["kind"] == "flip" and relabel_flips:
            new_labels[i] = label_of[row["points_to"]]
        else:
            new_labels[i] = -1
    class_map = {int(c): int(new_id[c]) for c in torch.nonzero(kept).view(-1).tolist()}
    return new_labels, class_map, group_of


@dataclass
class CleanReport:
    """Everything :func:`clean_embeddings` found (tables as lists of rows)."""

    num_images: int
    num_classes: int
    settings: CleanSettings
    duplicate_pairs: list = field(default_factory=list)
    groups: list = field(default_factory=list)
    flips: list = field(default_factory=list)
    overlap: list = field(default_factory=list)
    merge: list = field(default_factory=list)
    new_labels: torch.Tensor | None = None
    class_map: dict = field(default_factory=dict)
    second_labels: torch.Tensor | None = None
    """The second dataset's images' ids in the merged label space (with ``second``)."""

    def summary(self) -> dict:
        kinds = [r["kind"] for r in self.flips]
        return {"images": self.num_images, "classes": self.num_classes,
                "candidate_pairs": len(self.duplicate_pairs),
                "confirmed_pairs": sum(r["confirmed"] for r in self.duplicate_pairs),
                "duplicate_groups": len(self.groups), "classes_merged_away": sum(len(g) - 1 for g in self.groups),
                "flipped_images": kinds.count("flip"), "outlier_images": kinds.count("outlier"),
                "overlapping_classes": len(self.overlap),
                "second_dataset_classes": len(self.merge),
                "second_dataset_joined": sum(r["joined"] for r in self.merge),
                "kept_classes": len(self.class_map),
                "kept_images": None if self.new_labels is None else int((self.new_labels >= 0).sum()),
                "settings": asdict(self.settings)}


def clean_embeddings(embeddings: torch.Tensor, labels: torch.Tensor, num_classes: int,
                     settings: CleanSettings | None = None, *, head_rows: torch.Tensor | None = None,
                     test_embeddings: torch.Tensor | None = None, test_labels: torch.Tensor | None = None,
                     second: tuple[torch.Tensor, torch.Tensor, int] | None = None, drop_overlap: bool = True,
                     relabel_flips: bool = True, log=None) -> CleanReport:
    """The whole analysis on embeddings ``[N, d]`` with their training ``labels``
    (int64 ``[N]`` in ``[0, num_classes)``); ``head_rows`` (``[C, d]`` / ``[C, K, d]``)
    as the second duplicate signal, a test set (``test_embeddings`` and optionally
    ``test_labels``), a second dataset ``(embeddings, labels, num_classes)`` to merge.
    Changes none of its inputs."""
    settings = settings or CleanSettings()
    log = log or (lambda line: None)
    _check_embeddings(embeddings, labels, num_classes)
    if head_rows is not None and (not isinstance(head_rows, torch.Tensor) or head_rows.shape[0] != num_classes
                                  or head_rows.shape[-1] != embeddings.shape[1]):
        raise ValueError(f"head_rows must be [{num_classes}, {embeddings.shape[1]}] (or with sub-centres [C, K, d]) "
                         f"for the data's {num_classes} classes, got {tuple(getattr(head_rows, 'shape', ()))}")
    if test_labels is not None:
        if test_embeddings is None:
            raise ValueError("test_labels needs test_embeddings")
        _check_embeddings(test_embeddings, test_labels, max(1, int(test_labels.max()) + 1 if test_labels.numel()
                                                            else 1), "test_embeddings")
    if second is not None:
        _check_embeddings(second[0], second[1], second[2], "the second dataset's embeddings")
    report = CleanReport(num_images=embeddings.shape[0], num_classes=num_classes, settings=settings)
    sums, counts = class_centres(embeddings, labels, num_classes)
    empty = int((counts == 0).sum())
    if empty:
        log(f"clean: {empty} of {num_classes} classes have no image (no centre; never matched)")
    own, other_cos, other_class = image_scores(embeddings, labels, sums, counts,
                                               block_rows=settings.block_rows, impl=settings.impl)
    log(f"clean: scored {embeddings.shape[0]} images against {num_classes} centres")
    report.duplicate_pairs, report.groups = find_duplicates(labels, sums, counts, other_class, settings,
                                                            head_rows)
    log(f"clean: {len(report.duplicate_pairs)} candidate duplicate pairs, {len(report.groups)} confirmed groups")
    group_of = torch.arange(num_classes)
    for g in report.groups:
        group_of[torch.tensor(g)] = g[0]
    report.flips = find_flips(labels, own, other_cos, other_class, settings, group_of)
    if test_embeddings is not None:
        report.overlap = find_overlap(sums, test_embeddings, settings, test_labels)
        log(f"clean: {len(report.overlap)} training classes overlap the test set")
    if second is not None:
        sums_b, _ = class_centres(*second)
        report.merge = merge_label_spaces(sums, sums_b, settings)
        merged = torch.tensor([r["merged_id"] for r in report.merge], dtype=torch.int64)
        report.second_labels = merged[second[1]]
    drop = [r["class"] for r in report.overlap] if drop_overlap else []
    report.new_labels, report.class_map, _ = plan_labels(labels, num_classes, report.groups, report.flips,
                                                         drop_classes=drop, relabel_flips=relabel_flips)
    return report


def _gather_objects(obj, group) -> list:
    import torch.distributed as dist
    out = [None] * collectives.world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def clean_sharded(embeddings: torch.Tensor, labels: torch.Tensor, index: torch.Tensor, num_classes: int,
                  num_images: int, settings: CleanSettings | None = None, *, group=None, device=None,
                  head_rows: torch.Tensor | None = None, test_embeddings: torch.Tensor | None = None,
                  second: tuple | None = None, drop_overlap: bool = True, relabel_flips: bool = True,
                  log=None) -> CleanReport:
    """:func:`clean_embeddings` when each rank of ``group`` holds a share of the images:
    ``embeddings``/``labels`` of the images whose dataset indices are ``index`` (int64,
    the shares together cover ``0 .. num_images - 1`` once). Every rank returns the
    same report, equal to :func:`clean_embeddings` on all images (up to the order of
    float64 sums). Per rank: the class sums (``C d`` float64, all-reduced), its images'
    scores, its shard of the centres in the candidate search
    (:func:`~ds_pfc.core.neighbors.sharded_nearest`), and the labels of all images
    (8 bytes each) for the cleaned list. ``device``: where the collectives run. ``second``:
    a second dataset to merge, ``(embeddings, labels, index, num_classes, num_images)`` of
    this rank's share of its images, sharded as the first."""
    import torch.distributed as dist
    settings = settings or CleanSettings()
    log = log or (lambda line: None)
    _check_embeddings(embeddings, labels, num_classes)
    if not isinstance(index, torch.Tensor) or index.dtype != torch.int64 or tuple(index.shape) != tuple(labels.shape):
        raise ValueError(f"index must be int64 [{labels.shape[0]}] (the dataset index of every row), got "
                         f"{getattr(index, 'dtype', type(index).__name__)} {tuple(getattr(index, 'shape', ()))}")
    if head_rows is not None and (not isinstance(head_rows, torch.Tensor) or head_rows.shape[0] != num_classes
                                  or head_rows.shape[-1] != embeddings.shape[1]):
        raise ValueError(f"head_rows must be [{num_classes}, {embeddings.shape[1]}] (or with sub-centres [C, K, d]) "
                         f"for the data's {num_classes} classes, got {tuple(getattr(head_rows, 'shape', ()))}")
    if second is not None:
        if len(second) != 5:
            raise ValueError("second must be (embeddings, labels, index, num_classes, num_images) of this rank's "
                             "share of the second dataset")
        _check_embeddings(second[0], second[1], second[3], "the second dataset's embeddings")
    report = CleanReport(num_images=num_images, num_classes=num_classes, settings=settings)
    sums, counts = class_centres(embeddings, labels, num_classes)
    sums, counts = sums.to(device), counts.to(device)
    dist.all_reduce(sums, group=group)
    dist.all_reduce(counts, group=group)
    sums, counts = sums.cpu(), counts.cpu()
    own, other_cos, other_class = image_scores(embeddings, labels, sums, counts,
                                               block_rows=settings.block_rows, impl=settings.impl)
    # candidates: each rank searches for its shard of the centres among every shard
    part = Partition(num_classes, collectives.world_size(group))
    rank = collectives.rank(group)
    start, count = part.class_start(rank), part.num_local(rank)
    shard = F.normalize(sums[start:start + count], dim=1).float()
    values, indices = sharded_nearest(shard, shard, settings.neighbours, threshold=settings.duplicate_cos,
                                      query_ids=torch.arange(start, start + count), group=group, device=device,
                                      block_rows=settings.block_rows, impl=settings.impl)
    candidates = [c for part_c in _gather_objects(_candidates(values, indices, start), group) for c in part_c]
    votes: dict[int, int] = {}
    for part_v in _gather_objects(_votes(labels, other_class, num_classes), group):
        for key, n in part_v.items():
            votes[key] = votes.get(key, 0) + n
    report.duplicate_pairs, report.groups = _confirm(candidates, votes, counts, settings, head_rows)
    log(f"clean: {len(report.duplicate_pairs)} candidate duplicate pairs, {len(report.groups)} confirmed groups")
    group_of = torch.arange(num_classes)
    for g in report.groups:
        group_of[torch.tensor(g)] = g[0]
    flips = find_flips(labels, own, other_cos, other_class, settings, group_of)
    for row in flips:
        row["image"] = int(index[row["image"]])
    report.flips = sorted((r for part_f in _gather_objects(flips, group) for r in part_f),
                          key=lambda r: (r["kind"] != "flip", r["own_cos"] - r["other_cos"], r["image"]))
    all_labels = torch.full((num_images,), -1, dtype=torch.int64)
    for part_i, part_l in _gather_objects((index, labels), group):
        all_labels[part_i] = part_l
    if test_embeddings is not None:
        report.overlap = find_overlap(sums, test_embeddings, settings)
    if second is not None:
        emb_b, labels_b, index_b, classes_b, images_b = second
        sums_b = class_centres(emb_b, labels_b, classes_b)[0].to(device)
        dist.all_reduce(sums_b, group=group)
        report.merge = merge_label_spaces(sums, sums_b.cpu(), settings)
        merged = torch.tensor([r["merged_id"] for r in report.merge], dtype=torch.int64)
        all_b = torch.full((images_b,), -1, dtype=torch.int64)
        for part_i, part_l in _gather_objects((index_b, labels_b), group):
            all_b[part_i] = part_l
        report.second_labels = merged[all_b]
    drop = [r["class"] for r in report.overlap] if drop_overlap else []
    report.new_labels, report.class_map, _ = plan_labels(all_labels, num_classes, report.groups, report.flips,
                                                         drop_classes=drop, relabel_flips=relabel_flips)
    return report


@torch.no_grad()
def embed_dataset(backbone: torch.nn.Module, dataset, *, batch_size: int = 256, device="cpu", flip: bool = False,
                  log=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(embeddings float32 [N, d] unit rows, labels int64 [N])`` of every item of
    ``dataset`` under ``backbone`` in eval mode (``flip``: the sum with the
    horizontally flipped image, as verification does). One pass, in batches."""
    from ..data.loader import _fetch
    from ..data.transforms import normalize
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    log = log or (lambda line: None)
    was_training = backbone.training
    backbone.eval()
    total, out, labels = len(dataset), [], []
    try:
        for start in range(0, total, batch_size):
            images, y = _fetch(dataset, torch.arange(start, min(total, start + batch_size)))
            x = normalize(images).to(device)
            feat = backbone(x).float()
            if flip:
                feat = feat + backbone(x.flip(3)).float()
            out.append(F.normalize(feat, dim=1).cpu())
            labels.append(torch.as_tensor(y, dtype=torch.int64))
            if (start // batch_size) % 100 == 0:
                log(f"clean: embedded {min(total, start + batch_size)}/{total} images")
    finally:
        backbone.train(was_training)
    if not out:
        raise ValueError("the dataset is empty: nothing to clean")
    return torch.cat(out), torch.cat(labels)


def _write_csv(path: str, rows: list[dict], columns: list[str]) -> None:
    """The table as CSV and, when pyarrow is installed, as Parquet beside it."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow(row)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return
    table = pa.table({c: [None if r.get(c) == "" else r.get(c) for r in rows] for c in columns}) if rows \
        else pa.table({c: pa.array([], pa.string()) for c in columns})
    pq.write_table(table, path[:-len(".csv")] + ".parquet")


def contact_sheet(path: str, rows: list[tuple[str, torch.Tensor]], *, tile: int = 64) -> None:
    """A PNG with one row of tiles per ``(caption, uint8 images [m, 3, H, W])``."""
    from PIL import Image, ImageDraw
    width = max(1, max(len(images) for _, images in rows)) * tile + 120
    sheet = Image.new("RGB", (width, len(rows) * tile), "white")
    draw = ImageDraw.Draw(sheet)
    for r, (caption, images) in enumerate(rows):
        draw.text((4, r * tile + tile // 2 - 6), caption, fill="black")
        for j, image in enumerate(images):
            pixels = image.clamp(0, 255).to(torch.uint8)
            if pixels.shape[0] == 1:
                pixels = pixels.expand(3, -1, -1)
            tile_image = Image.fromarray(pixels.permute(1, 2, 0).contiguous().numpy(), mode="RGB")
            sheet.paste(tile_image.resize((tile, tile)), (120 + j * tile, r * tile))
    sheet.save(path)


def write_report(report: CleanReport, out_dir: str, *, dataset=None, labels: torch.Tensor | None = None,
                 sheets: int = 8, per_row: int = 6, log=None) -> dict[str, str]:
    """Write the tables (CSV, and Parquet when pyarrow is installed), ``labels.txt``
    (one cleaned label per image, ``-1``: dropped), ``class_map.json`` and
    ``summary.json`` into ``out_dir``; with
    ``dataset`` and its ``labels``, contact sheets (PNG) of the top ``sheets``
    duplicate groups and flips under ``out_dir/sheets``. Returns ``{name: path}``."""
    from ..data.loader import _fetch
    log = log or (lambda line: None)
    os.makedirs(out_dir, exist_ok=True)
    paths = {name: os.path.join(out_dir, name) for name in
             ("duplicates.csv", "images.csv", "overlap.csv", "merge.csv", "labels.txt", "class_map.json",
              "summary.json")}
    _write_csv(paths["duplicates.csv"], report.duplicate_pairs,
               ["class_a", "class_b", "centre_cos", "images_a", "images_b", "evidence_a_to_b", "evidence_b_to_a",
                "evidence", "head_cos", "confirmed"])
    _write_csv(paths["images.csv"], report.flips, ["image", "label", "own_cos", "other_cos", "kind", "points_to"])
    what = "test_identity" if report.overlap and "test_identity" in report.overlap[0] else "test_image"
    _write_csv(paths["overlap.csv"], report.overlap, ["class", what, "cos"])
    _write_csv(paths["merge.csv"], report.merge, ["class_b", "merged_id", "nearest_a", "cos", "joined"])
    with open(paths["labels.txt"], "w", encoding="utf-8") as f:
        f.write("".join(f"{int(v)}\n" for v in report.new_labels.tolist()))
    if report.second_labels is not None:
        paths["second_labels.txt"] = os.path.join(out_dir, "second_labels.txt")
        with open(paths["second_labels.txt"], "w", encoding="utf-8") as f:
            f.write("".join(f"{int(v)}\n" for v in report.second_labels.tolist()))
    with open(paths["class_map.json"], "w", encoding="utf-8") as f:
        json.dump({str(k): v for k, v in report.class_map.items()}, f, indent=0)
    with open(paths["summary.json"], "w", encoding="utf-8") as f:
        json.dump(report.summary(), f, indent=2)
    if dataset is not None and labels is not None and sheets > 0:
        folder = os.path.join(out_dir, "sheets")
        os.makedirs(folder, exist_ok=True)

        def images_of(cls, limit):
            index = torch.nonzero(labels == cls).view(-1)[:limit]
            return _fetch(dataset, index)[0] if index.numel() else torch.zeros(0, 3, 8, 8)
        for n, group in enumerate(report.groups[:sheets]):
            contact_sheet(os.path.join(folder, f"duplicate-{n:03d}.png"),
                          [(f"class {c}", images_of(c, per_row)) for c in group])
        for n, row in enumerate([r for r in report.flips if r["kind"] == "flip"][:sheets]):
            image = _fetch(dataset, torch.tensor([row["image"]]))[0]
            contact_sheet(os.path.join(folder, f"flip-{n:03d}.png"),
                          [(f"image {row['image']}", image), (f"label {row['label']}", images_of(row["label"],
                                                                                                 per_row)),
                           (f"-> {row['points_to']}", images_of(row["points_to"], per_row))])
        paths["sheets"] = folder
        log(f"clean: contact sheets in {folder}")
    return paths


def load_run(model: str, *, tag: str | None = None, data: str | None = None, head: bool = True, log=None):
    """``(backbone, training set, head rows or None)`` of a trained run: the backbone of
    ``model`` (a checkpoint directory, a model folder, an export), the training set of
    the job config stored with it (``data`` replaces its ``ds_pfc.data.path``) and,
    for a checkpoint with ``head``, the head's rows ``[C, K, d]``. A ``ValueError``
    naming the path when the data is missing or does not match the head."""
    import warnings

    from ..checkpoint import shards as ckpt
    from .config import split_config
    from .datasets import build_train_set
    from .export import backbone_weights
    state, config, _, tag_dir = backbone_weights(model, tag)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, cfg = split_config(config, strict=False)
    backbone = cfg.backbone.build(cfg.head.embedding_size)       # as export.load_backbone, read once
    backbone.load_state_dict(state)
    backbone.eval()
    if data is not None:
        if not os.path.exists(data):
            raise FileNotFoundError(f"--data {data!r} does not exist")
        import dataclasses
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=data))
    try:
        dataset = build_train_set(cfg, log=log)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"the training data of {model} is not where its job config says ({err}); pass "
                                "--data with its current path") from None
    rows = None
    if head and tag_dir is not None:
        tensors, meta = ckpt.merge_shards(tag_dir, name="head")
        k = int(meta.get("sub_centers", 1) or 1)
        weight = tensors["weight"]
        if weight.shape[0] % k:
            raise ValueError(f"{tag_dir}: head rows {weight.shape[0]} are not a multiple of sub_centers {k}")
        rows = weight.float().view(weight.shape[0] // k, k, -1)
        if rows.shape[0] != dataset.num_classes:
            raise ValueError(f"{tag_dir}: the head has {rows.shape[0]} classes but the training set has "
                             f"{dataset.num_classes}; clean the run with the data it trained on")
    return backbone, dataset, rows


def _test_embeddings(paths, backbone, *, image_shape, batch_size, device, flip):
    from ..data.transforms import decode_image
    from ..eval.verification import load_bin
    out = []
    for path in paths:
        images, _ = load_bin(path, decode=decode_image)
        images = torch.stack(images)
        if tuple(images.shape[1:]) != tuple(image_shape):
            raise ValueError(f"--test {path}: images of shape {tuple(images.shape[1:])}, but the model trained on "
                             f"{tuple(image_shape)}; give a test set at the training resolution")
        out.append(embed_dataset(backbone, _Images(images), batch_size=batch_size, device=device, flip=flip)[0])
    return torch.cat(out)


class _Share(torch.utils.data.Dataset):
    """The items ``index`` of ``dataset`` (one rank's share of the embedding pass)."""

    def __init__(self, dataset, index):
        self.dataset, self.index = dataset, index

    def __len__(self):
        return len(self.index)

    def get_batch(self, index):
        from ..data.loader import _fetch
        return _fetch(self.dataset, self.index[torch.as_tensor(index, dtype=torch.int64)])


class _Images(torch.utils.data.Dataset):
    """Unlabelled images as a dataset (label 0) for :func:`embed_dataset`."""

    def __init__(self, images):
        self.images = images

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], 0

    def get_batch(self, index):
        return self.images[index], torch.zeros(len(index), dtype=torch.int64)


def run_clean(args, log=None) -> dict:
    """``ds-pfc-clean`` (:mod:`ds_pfc.cli.clean`): load, embed, analyse, write; the summary."""
    import warnings

    from .config import split_config
    from .datasets import build_train_set
    log = log or (lambda line: None)
    settings = CleanSettings(duplicate_cos=args.duplicate_cos, duplicate_evidence=args.duplicate_evidence,
                             neighbours=args.neighbours, flip_margin=args.flip_margin, outlier_cos=args.outlier_cos,
                             overlap_cos=args.overlap_cos, merge_cos=args.merge_cos, impl=args.impl)
    for path in args.test:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--test {path!r} does not exist")
    import torch.distributed as dist
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if rank != 0:
        log = lambda line: None      # noqa: E731  (rank 0 speaks)
    backbone, dataset, head_rows = load_run(args.model, tag=args.tag, data=args.data, head=not args.no_head,
                                            log=log)
    backbone = backbone.to(args.device)
    index = torch.arange(rank, len(dataset), world)      # every rank embeds a strided share
    share = dataset if world == 1 else _Share(dataset, index)
    embeddings, labels = embed_dataset(backbone, share, batch_size=args.batch_size, device=args.device,
                                       flip=args.flip, log=log)
    test = None
    if args.test:
        from ..data.loader import _fetch
        shape = _fetch(dataset, torch.tensor([0]))[0].shape[1:]
        test = _test_embeddings(args.test, backbone, image_shape=shape, batch_size=args.batch_size,
                                device=args.device, flip=args.flip)
    second = None
    if args.second:
        try:
            with open(args.second, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"--second {args.second!r}: cannot read the job config ({err})") from None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, cfg = split_config(config, strict=False)
        other = build_train_set(cfg, log=log)
        index_b = torch.arange(rank, len(other), world)    # sharded as the first dataset
        emb_b, labels_b = embed_dataset(backbone, other if world == 1 else _Share(other, index_b),
                                        batch_size=args.batch_size, device=args.device, flip=args.flip, log=log)
        if emb_b.shape[1] != embeddings.shape[1]:
            raise ValueError("--second: embeddings of another width")
        second = ((emb_b, labels_b, index_b, other.num_classes, len(other)) if distributed
                  else (emb_b, labels_b, other.num_classes))
    if distributed:
        report = clean_sharded(embeddings, labels, index, dataset.num_classes, len(dataset), settings,
                               device=args.device if str(args.device).startswith("cuda") else None,
                               head_rows=head_rows, test_embeddings=test, second=second,
                               drop_overlap=not args.keep_overlap,
                               relabel_flips=not args.drop_flips, log=log)
        labels = torch.as_tensor(dataset.labels(), dtype=torch.int64)
        if rank != 0:
            return report.summary()
    else:
        report = clean_embeddings(embeddings, labels, dataset.num_classes, settings, head_rows=head_rows,
                                  test_embeddings=test, second=second, drop_overlap=not args.keep_overlap,
                                  relabel_flips=not args.drop_flips, log=log)
    write_report(report, args.out, dataset=dataset, labels=labels, sheets=args.sheets, log=log)
    return report.summary()
