"""Opt-in training diagnostics (``ds_pfc.train.diagnostics``).

:class:`FlipMechanism` measures the mechanism the paper gives for Partial FC's
robustness to label flips. A flipped sample ``i`` (image of identity ``t_i``, label
``y_i != t_i``) pushes every *active* center except ``w_{y_i}`` away from its
embedding, the true center ``w_{t_i}`` included, with a weight that grows as the model
learns that the image belongs to ``t_i``. Under the full softmax (``r = 1``) that
happens every time the sample is seen; under Partial FC only when ``t_i`` is in the
step's active set: when ``t_i`` is the label of another sample of the batch (a
positive, always active) or drawn among the negatives (about ``r`` of the time). The
true centers should then stay closer to the images that belong to them.

Per flipped sample of every micro step (all ranks' samples, each counted once), it
records:

(a) whether ``t_i`` was in the active set of the rank that owns it, and, next to
    it, the probability of that under uniform positive-preserving sampling given
    the batch (1 when ``t_i`` is a positive of the batch, else
    ``max(b_q - |P_q|, 0) / (C_q - |P_q|)``, ``b_q = floor(r C_q)``), computed from
    the batch's labels alone, not from the draw;
(b) the cosine between the sample's embedding (as the head saw it) and the true
    center before the optimizer step, and its change over the step (negative: the
    center turned away from the image); the same for the noisy label's center (pulled
    towards the image) and for a *control* class drawn uniformly among the classes
    that are neither a label of the micro batch nor the true class of one of its
    flipped samples, i.e. a center that is only ever a negative of this batch; and
    the angle each center turned over the step, as ``1 - cos(w_before, w_after)``
    (a rotation: weight decay's shrinking does not count).

Cosines are what the margin softmax scores, so a change of cosine reads directly
as a change of the logit (times the scale). With sub-centers a class's cosine is
its best sub-center's, and a center's turn is the mean over its sub-centers.

Reported per interval (:meth:`FlipMechanism.interval`): shares and means over the
flipped samples of the interval's steps, summed exactly over the ranks.
"""
from __future__ import annotations

import hashlib
import math

import torch
import torch.distributed as dist

from ..bank import DeviceBank
from ..core.head import PartialFC
from ..core.sampling import activation_budget
from ..devices import collective_device

__all__ = ["FlipMechanism", "FLIP_MECHANISM_FIELDS"]

# Sums kept per interval (every one counted on the rank that owns the class it is about).
_SUMS = ("flipped", "true_active", "true_expected", "true_in_batch", "cos_true", "dcos_true", "dcos_true_active",
         "drift_true", "labels", "cos_label", "dcos_label", "controls", "control_active", "dcos_control",
         "drift_control")
_AT = {name: i for i, name in enumerate(_SUMS)}

FLIP_MECHANISM_FIELDS = {
    "steps": "[first, last] optimizer step of the interval",
    "sample_rate": "the head's r",
    "flipped": "flipped samples seen (a sample seen in two steps counts twice)",
    "true_active_share": "share of them whose true class was in the step's active set",
    "true_active_expected": "that share's expectation under uniform positive-preserving sampling given each batch",
    "true_in_batch_share": "share whose true class was the label of a sample of the same micro batch",
    "control_active_share": "share of the control classes (never a label of the batch) in the active set",
    "cos_true": "mean cos(embedding, true center) before the step",
    "cos_label": "mean cos(embedding, noisy label's center) before the step",
    "dcos_true": "mean change of cos(embedding, true center) over the step",
    "dcos_true_active": "the same over the samples whose true class was active",
    "dcos_label": "mean change of cos(embedding, noisy label's center) over the step",
    "dcos_control": "mean change of cos(embedding, control center) over the step",
    "drift_true": "mean 1 - cos(true center before, after) over the step",
    "drift_control": "mean 1 - cos(control center before, after) over the step",
}


def _draw_seed(seed: int, step: int) -> int:
    digest = hashlib.blake2b(f"flip_mechanism:{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class FlipMechanism:
    """Counts (a) and measures (b) of the module docstring for ``head``.

    Call :meth:`observe` after each training forward of the head (every rank, with
    this rank's micro batch: a collective), :meth:`after_step` after the optimizer
    step that applies the head's update (every micro step before it is measured
    across that update), and :meth:`interval` (every rank) to read
    and reset the sums. Micro batches must have one size on every rank.

    Args:
        head: the trained :class:`~ds_pfc.core.head.PartialFC` (device bank, one
            process group).
        seed: seeds the draw of the control classes (with the head's step).
    """

    def __init__(self, head: PartialFC, *, seed: int = 0):
        if not isinstance(head, PartialFC):
            raise TypeError(f"head must be a PartialFC, got {type(head).__name__}")
        if head._layout is not None:
            raise ValueError("head: the flip-mechanism diagnostic supports a head over one process group "
                             "(no separate batch_group)")
        if not isinstance(head.bank, DeviceBank):
            raise ValueError(f"head: the flip-mechanism diagnostic reads centers between steps from a device bank, "
                             f"not a {type(head.bank).__name__} (set ds_pfc.head.bank to the device tier)")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        self.head, self.seed = head, seed
        self._device = collective_device(head.group, head.device)
        self._pending: list[dict] = []
        self._sums = torch.zeros(len(_SUMS), dtype=torch.float64, device=self._device)
        self._first_step = self._last_step = None

    # ------------------------------------------------------------------ gather
    def _gather(self, x, labels, true_labels):
        head = self.head
        if head.world_size == 1:
            return x.to(torch.float64), labels.long(), true_labels.long()
        dev, group = self._device, head.group
        size = torch.tensor([x.shape[0]], dtype=torch.int64, device=dev)
        sizes = [torch.empty_like(size) for _ in range(head.world_size)]
        dist.all_gather(sizes, size, group=group)
        sizes = [int(s) for s in torch.cat(sizes).tolist()]
        if len(set(sizes)) > 1:
            raise ValueError(f"embeddings: the flip-mechanism diagnostic needs micro batches of one size on every "
                             f"rank, got {sizes}")
        parts = []
        wide = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32   # no half over gloo
        for t in (x.to(dev, wide), labels.to(dev, torch.int64), true_labels.to(dev, torch.int64)):
            out = [torch.empty_like(t) for _ in range(head.world_size)]
            dist.all_gather(out, t.contiguous(), group=group)
            parts.append(torch.cat(out))
        x, y, t = parts
        return x.to(head.device, torch.float64), y.to(head.device), t.to(head.device)

    # ------------------------------------------------------------------ per micro step
    @torch.no_grad()
    def observe(self, embeddings: torch.Tensor, labels: torch.Tensor, true_labels: torch.Tensor, *,
                sample_step: int | None = None) -> None:
        """One micro step: this rank's ``embeddings [m, d]`` as passed to the head,
        its ``labels [m]`` (the training labels) and ``true_labels [m]`` (before the
        flips). ``sample_step``: the head's sampler step of that forward (default:
        the one just taken, ``head.sample_step - 1``)."""
        head = self.head
        if embeddings.dim() != 2 or embeddings.shape[1] != head.embedding_size:
            raise ValueError(f"embeddings must be [m, {head.embedding_size}], got {tuple(embeddings.shape)}")
        m = embeddings.shape[0]
        for name, t in (("labels", labels), ("true_labels", true_labels)):
            if t.dim() != 1 or t.shape[0] != m:
                raise ValueError(f"{name} must be [{m}] like the embeddings, got {tuple(t.shape)}")
        step = head.sample_step - 1 if sample_step is None else int(sample_step)
        x, y, t = self._gather(embeddings.detach(), labels, true_labels)
        flipped = (y != t).nonzero().flatten()
        if flipped.numel() == 0:
            return
        xf, tf, yf = x[flipped], t[flipped], y[flipped]
        positives = torch.unique(y)
        lo, hi, num_local = head.class_start, head.class_end, head.num_local
        # (a) the active set the head drew for this forward (a pure function of the
        # seed, the step and the positives), and the probability of each flipped
        # sample's true class being in it, from the batch's labels alone.
        active = head.active_set(head.partition.to_local(y, head.rank), sample_step=step)
        is_active = torch.ones(num_local, dtype=torch.bool, device=head.device)
        if active is not None:
            is_active.zero_()
            is_active[active] = True
        owned_positives = int(((positives >= lo) & (positives < hi)).sum())
        budget = num_local if head.sample_rate >= 1.0 else activation_budget(num_local, head.sample_rate)
        free = num_local - owned_positives
        p_negative = max(budget - owned_positives, 0) / free if free > 0 else 0.0
        controls = self._controls(positives, tf, step)

        record = {"x": xf}
        for role, classes in (("true", tf), ("label", yf), ("control", controls)):
            sel = ((classes >= lo) & (classes < hi)).nonzero().flatten()
            local = classes[sel] - lo
            rows = self._rows(local)
            w = self._read(rows, sel.numel())
            entry = {"sel": sel, "rows": rows, "w": w, "cos": _best_cos(xf[sel], w)}
            if role == "true":
                in_batch = torch.isin(classes[sel], positives)
                entry["active"] = is_active[local]
                entry["in_batch"] = in_batch
                entry["expected"] = torch.where(in_batch, torch.ones_like(sel, dtype=torch.float64),
                                                torch.full_like(sel, p_negative, dtype=torch.float64))
            elif role == "control":
                entry["active"] = is_active[local]
            record[role] = entry
        self._pending.append(record)

    def _controls(self, positives: torch.Tensor, true_flipped: torch.Tensor, step: int) -> torch.Tensor:
        """One control class per flipped sample, uniform over the classes that are no
        label of the batch and no flipped sample's true class (-1 if none is left);
        the same draw on every rank."""
        num_classes = self.head.num_classes
        excluded = torch.zeros(num_classes, dtype=torch.bool)
        excluded[positives.cpu()] = True
        excluded[true_flipped.cpu()] = True
        allowed = (~excluded).nonzero().flatten()
        n = true_flipped.numel()
        if allowed.numel() == 0:
            return torch.full((n,), -1, dtype=torch.int64, device=self.head.device)
        g = torch.Generator().manual_seed(_draw_seed(self.seed, step))
        return allowed[torch.randint(allowed.numel(), (n,), generator=g)].to(self.head.device)

    def _rows(self, local: torch.Tensor) -> torch.Tensor:
        k = self.head.sub_centers
        return (local[:, None] * k + torch.arange(k, device=local.device)).reshape(-1)

    def _read(self, rows: torch.Tensor, n: int) -> torch.Tensor:
        head = self.head
        return head.bank.read("weight", rows).to(torch.float64).reshape(n, head.sub_centers, head.embedding_size)

    # ------------------------------------------------------------------ per optimizer step
    @torch.no_grad()
    def after_step(self, step: int | None = None) -> None:
        """After the optimizer step that updated the head: read the centers again and
        add the micro steps observed since the last call to the interval's sums.
        ``step``: that optimizer step's number (the interval reports its steps as
        ``[first, last]``)."""
        if step is not None:
            self._last_step = int(step)
            self._first_step = int(step) if self._first_step is None else self._first_step
        if not self._pending:
            return
        self.head.flush()
        add = torch.zeros(len(_SUMS), dtype=torch.float64, device=self.head.device)
        for record in self._pending:
            for role in ("true", "label", "control"):
                e = record[role]
                n = e["sel"].numel()
                if n == 0:
                    continue
                w_after = self._read(e["rows"], n)
                dcos = _best_cos(record["x"][e["sel"]], w_after) - e["cos"]
                drift = (1.0 - torch.nn.functional.cosine_similarity(e["w"], w_after, dim=-1)).mean(-1)
                if role == "true":
                    active = e["active"]
                    values = {"flipped": n, "true_active": active.sum(), "true_expected": e["expected"].sum(),
                              "true_in_batch": e["in_batch"].sum(), "cos_true": e["cos"].sum(),
                              "dcos_true": dcos.sum(), "dcos_true_active": dcos[active].sum(),
                              "drift_true": drift.sum()}
                elif role == "label":
                    values = {"labels": n, "cos_label": e["cos"].sum(), "dcos_label": dcos.sum()}
                else:
                    values = {"controls": n, "control_active": e["active"].sum(), "dcos_control": dcos.sum(),
                              "drift_control": drift.sum()}
                for name, v in values.items():
                    add[_AT[name]] += v
        self._sums += add.to(self._sums.device)
        self._pending = []

    # ------------------------------------------------------------------ per interval
    def interval(self) -> dict:
        """The interval's numbers (the same on every rank; a collective over the
        head's group), then a new interval begins. Means over no sample are NaN."""
        self.after_step()
        sums = self._sums.clone()
        if self.head.world_size > 1:
            dist.all_reduce(sums, group=self.head.group)
        s = dict(zip(_SUMS, sums.tolist()))

        def mean(total, count):
            return s[total] / s[count] if s[count] else math.nan
        out = {"steps": [self._first_step, self._last_step], "sample_rate": self.head.sample_rate,
               "flipped": int(round(s["flipped"])),
               "true_active_share": mean("true_active", "flipped"),
               "true_active_expected": mean("true_expected", "flipped"),
               "true_in_batch_share": mean("true_in_batch", "flipped"),
               "control_active_share": mean("control_active", "controls"),
               "cos_true": mean("cos_true", "flipped"), "cos_label": mean("cos_label", "labels"),
               "dcos_true": mean("dcos_true", "flipped"), "dcos_true_active": mean("dcos_true_active", "true_active"),
               "dcos_label": mean("dcos_label", "labels"), "dcos_control": mean("dcos_control", "controls"),
               "drift_true": mean("drift_true", "flipped"), "drift_control": mean("drift_control", "controls")}
        self._sums.zero_()
        self._first_step = self._last_step = None
        return out


def _best_cos(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64 ``[n]``: the largest cosine between ``x[i]`` and the sub-centers ``w[i]``
    (``x [n, d]``, ``w [n, K, d]``)."""
    if x.shape[0] == 0:
        return torch.zeros(0, dtype=torch.float64, device=x.device)
    xn = torch.nn.functional.normalize(x.to(torch.float64), dim=-1)
    wn = torch.nn.functional.normalize(w.to(torch.float64), dim=-1)
    return torch.einsum("nkd,nd->nk", wn, xn).max(dim=-1).values
