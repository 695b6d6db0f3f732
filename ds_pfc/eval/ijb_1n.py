"""IJB-B / IJB-C 1:N identification, as insightface's IJB evaluation (``ijb_1n.py``)
computes it (reimplemented from its description).

Protocol files (``meta/``, comma-separated with a header row, the first two columns
``TEMPLATE_ID, SUBJECT_ID``): the gallery is ``ijbc_1N_gallery_G1.csv`` and
``ijbc_1N_gallery_G2.csv`` together (IJB-B: ``ijbb_1N_gallery_S1.csv``/``S2``), the
probes ``<target>_1N_probe_mixed.csv``. Each template's subject is that of its first
row. Template features are pooled from the image features exactly as for 1:1
verification (:func:`ds_pfc.eval.ijb.pool_templates`, after the same norm and
detector-score weighting); a score is the cosine of a probe and a gallery template.

Every probe's subject must have exactly one gallery template (insightface refuses
the protocol otherwise). Metrics, as insightface defines them:

- rank-k identification rate: the fraction of probes whose mated gallery template is
  among their ``k`` highest scores (ties counted in the probe's favour: a mated score
  is at rank ``1 +`` the number of gallery scores strictly above it);
- TPIR at FPIR ``f``: with ``P`` probes, the threshold is the ``ceil(P f)``-th highest
  of all non-mated scores (every probe against every other gallery template), and
  TPIR is the fraction of probes whose mated score is strictly above it (NaN when
  there are fewer non-mated scores than that).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = ["IJBIdentification", "IdentificationResult", "read_identification", "identify", "DEFAULT_FPIRS",
           "DEFAULT_RANKS"]

DEFAULT_FPIRS = (0.01, 0.1)
DEFAULT_RANKS = (1, 5, 10)


@dataclass
class IJBIdentification:
    """Gallery and probe templates of an IJB release (:func:`read_identification`)."""

    gallery_templates: torch.Tensor
    gallery_subjects: torch.Tensor
    probe_templates: torch.Tensor
    probe_subjects: torch.Tensor
    files: tuple[str, ...] = ()


@dataclass
class IdentificationResult:
    rank_rate: dict[int, float]
    """rank ``k`` -> identification rate."""
    tpir_at_fpir: dict[float, float]
    threshold_at_fpir: dict[float, float]
    num_probes: int
    num_gallery: int
    ranks: torch.Tensor = field(repr=False, default=None)
    """int64 ``[P]``: each probe's mated rank (1 = top)."""


def _read_csv(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"IJB 1:N protocol file not found: {path}")
    templates, subjects = [], []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            parts = [p.strip() for p in line.split(",")]
            if line_no == 1 or not line.strip():
                continue                      # the header
            try:
                templates.append(int(parts[0]))
                subjects.append(int(parts[1]))
            except (ValueError, IndexError):
                raise ValueError(f"{path}:{line_no}: expected TEMPLATE_ID,SUBJECT_ID,... integers, got "
                                 f"{line.rstrip()!r}") from None
    if not templates:
        raise ValueError(f"{path} has no rows")
    return torch.tensor(templates, dtype=torch.int64), torch.tensor(subjects, dtype=torch.int64)


def read_identification(root: str | os.PathLike, target: str) -> IJBIdentification:
    """Read the 1:N protocol files of ``target`` (``"IJBC"`` or ``"IJBB"``) under
    ``root/meta`` (see the module docstring)."""
    target = str(target).upper()
    if target not in ("IJBB", "IJBC"):
        raise ValueError(f"target must be 'IJBB' or 'IJBC', got {target!r}")
    low = target.lower()
    parts = ("G1", "G2") if target == "IJBC" else ("S1", "S2")
    meta = os.path.join(os.fspath(root), "meta")
    files = [os.path.join(meta, f"{low}_1N_gallery_{p}.csv") for p in parts]
    files.append(os.path.join(meta, f"{low}_1N_probe_mixed.csv"))
    read = [_read_csv(p) for p in files]
    return IJBIdentification(torch.cat([read[0][0], read[1][0]]), torch.cat([read[0][1], read[1][1]]),
                             read[2][0], read[2][1], tuple(files))


def _template_subjects(templates: torch.Tensor, subjects: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct template ids (ascending) and the subject of each one's first row."""
    ids, inverse = torch.unique(templates, return_inverse=True)
    first = torch.full((ids.numel(),), templates.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(templates.numel()), reduce="amin")
    return ids, subjects[first]


def identify(features, templates, medias, protocol: IJBIdentification, *, faceness=None,
             use_norm_score: bool = True, use_detector_score: bool = True,
             fpirs: Sequence[float] = DEFAULT_FPIRS, ranks: Sequence[int] = DEFAULT_RANKS) -> IdentificationResult:
    """1:N identification from per-image ``features [N, d]`` (``f(x) + f(flip x)``,
    not normalised, :func:`ds_pfc.eval.ijb.embed_images`) with their ``templates``
    and ``medias`` ids; ``faceness``, ``use_norm_score`` and ``use_detector_score`` as
    in :func:`ds_pfc.eval.ijb.evaluate`."""
    from .ijb import pool_templates
    feats = torch.as_tensor(features)
    if not feats.is_floating_point() or feats.dim() != 2:
        raise ValueError(f"features must be a floating-point [N, d] array, got {feats.dtype} {tuple(feats.shape)}")
    feats = feats.detach().to("cpu", torch.float64, copy=True)
    if not use_norm_score:
        norm = feats.norm(dim=1, keepdim=True)
        feats.div_(torch.where(norm > 0, norm, 1.0))
    if use_detector_score:
        if faceness is None:
            raise ValueError("faceness is required with use_detector_score=True")
        score = torch.as_tensor(faceness).detach().to("cpu", torch.float64).reshape(-1)
        if score.shape[0] != feats.shape[0]:
            raise ValueError(f"faceness must hold {feats.shape[0]} scores, got {score.shape[0]}")
        feats.mul_(score.unsqueeze(1))
    template_ids, pooled = pool_templates(feats, templates, medias)

    def rows(ids: torch.Tensor, what: str) -> torch.Tensor:
        r = torch.searchsorted(template_ids, ids).clamp(max=template_ids.numel() - 1)
        bad = template_ids[r] != ids
        if bad.any():
            raise ValueError(f"{what} templates without images: {ids[bad][:10].tolist()}")
        return r

    g_ids, g_subj = _template_subjects(protocol.gallery_templates, protocol.gallery_subjects)
    p_ids, p_subj = _template_subjects(protocol.probe_templates, protocol.probe_subjects)
    gallery, probes = pooled[rows(g_ids, "gallery")], pooled[rows(p_ids, "probe")]
    mate = torch.empty(p_ids.numel(), dtype=torch.int64)
    for i, s in enumerate(p_subj.tolist()):
        hits = (g_subj == s).nonzero().flatten()
        if hits.numel() != 1:
            raise ValueError(f"probe template {int(p_ids[i])} (subject {s}) has {hits.numel()} gallery templates; "
                             "the protocol needs exactly one per probe subject")
        mate[i] = hits[0]
    sim = probes @ gallery.T                                          # [P, G]
    mated = sim.gather(1, mate.unsqueeze(1)).squeeze(1)
    rank = (sim > mated.unsqueeze(1)).sum(1) + 1
    num_p, num_g = sim.shape
    rank_rate = {int(k): float((rank <= int(k)).double().mean()) for k in ranks}
    non_mated = sim.masked_fill(torch.nn.functional.one_hot(mate, num_g).bool(), -math.inf).flatten()
    non_mated = non_mated[torch.isfinite(non_mated)]
    tpir, thresholds = {}, {}
    for f in fpirs:
        k = math.ceil(num_p * float(f))
        if k < 1 or k > non_mated.numel():
            tpir[f], thresholds[f] = float("nan"), float("nan")
            continue
        th = float(torch.topk(non_mated, k).values[-1])
        thresholds[f] = th
        tpir[f] = float((mated > th).double().mean())
    return IdentificationResult(rank_rate, tpir, thresholds, num_p, num_g, rank)
