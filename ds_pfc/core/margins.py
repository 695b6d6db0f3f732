"""Margin functions (pure tensor math) and the interface the softmax calls them through.

A margin maps the target cosine ``c = cos(theta)`` to ``phi(c)``; the target logit is
``scale * phi(c)`` and every other active logit is ``scale * c``. Each margin gives
``phi`` and its derivative ``dphi/dc`` in closed form, so the softmax can apply the
chain rule in place without keeping an autograd graph over ``N x S`` logits.

The softmax asks a margin for a :class:`MarginPlan` once per call, on the gathered
batch: per-sample target logits and their derivatives (and, for margins that depend
on the feature norm, their derivative with respect to it), an optional per-sample
loss term (MagFace's regulariser) and an optional transform of the negative cosines
(CurricularFace). The plain margins (``ArcFace``, ``CosFace``, ``CombinedMargin``)
give the same ``phi`` to every sample; AdaFace, MagFace and ElasticFace give each
sample its own. Margins with running state (AdaFace's norm statistics,
CurricularFace's ``t``, ElasticFace's draw counter) update it in training forwards
only, from the global batch (every rank of the class group holds the same gathered
batch, so every rank computes the same state without communication), and expose it
through ``state_dict()`` / ``load_state_dict()`` for checkpoints.

``theta + m > pi``. For an angular margin, ``cos(m1*theta + m2)`` stops decreasing once
``m1*theta + m2`` passes ``pi``: past that point a larger angle to the center would
*raise* the target logit, rewarding the wrong direction. For
``theta > theta* = (pi - m2) / m1`` every margin here therefore continues linearly in
the cosine, ``phi(c) = c - c* - 1 - m3`` with ``c* = cos(theta*)``. That extension is
continuous at ``theta*``, monotone in ``c``, and (for ``m3 >= 0``) keeps
``phi(c) < c``: the target is still penalised. It differs from insightface's ``cos(theta) - m*sin(m)`` fallback,
which jumps at ``theta*``.
"""
from __future__ import annotations

import math

import torch

__all__ = ["Margin", "MarginPlan", "CombinedMargin", "ArcFace", "CosFace", "AdaFace", "MagFace", "CurricularFace",
           "ElasticArcFace", "ElasticCosFace"]

_SIN_EPS = 1e-12  # floor of sin^2(theta) where the arc derivative is singular (c -> +-1)


def _check_number(name: str, value, *, low=None, high=None, low_open=False, high_open=False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite number, got {value!r}")
    value = float(value)
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and (value > high or (high_open and value == high)):
        raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got {value}")
    return value


class Margin:
    """``scale * (cos(m1*theta + m2) - m3)`` on the target, ``scale * cos`` elsewhere.

    Subclasses only fix parameters. ``straight_through=True`` keeps the margin's value
    but back-propagates as if it were a constant shift (``dphi/dc = 1``), which is
    what insightface's arcface_torch does for ArcFace.
    """

    def __init__(self, scale: float, m1: float, m2: float, m3: float, *, straight_through: bool = False):
        self.scale = _check_number("scale", scale, low=0.0, low_open=True)
        self.m1 = _check_number("m1", m1, low=0.0, low_open=True)
        self.m2 = _check_number("m2", m2, low=0.0, high=math.pi, high_open=True)
        self.m3 = _check_number("m3", m3)
        if not isinstance(straight_through, bool):
            raise TypeError(f"straight_through must be a bool, got {straight_through!r}")
        self.straight_through = straight_through
        self._pure_cosine = self.m1 == 1.0 and self.m2 == 0.0
        theta_star = (math.pi - self.m2) / self.m1
        # Below this cosine the linear continuation applies (None: never).
        self.cos_star = math.cos(theta_star) if theta_star < math.pi else None

    def __repr__(self) -> str:
        extra = ", straight_through=True" if self.straight_through else ""
        return f"{type(self).__name__}(scale={self.scale}, m1={self.m1}, m2={self.m2}, m3={self.m3}{extra})"

    def phi(self, cos: torch.Tensor) -> torch.Tensor:
        """The margined target cosine ``phi(c)`` (unscaled)."""
        cos = cos.clamp(-1.0, 1.0)
        if self._pure_cosine:
            return cos - self.m3
        arc = torch.cos(self.m1 * torch.acos(cos) + self.m2) - self.m3
        if self.cos_star is None:
            return arc
        linear = cos - self.cos_star - 1.0 - self.m3
        return torch.where(cos >= self.cos_star, arc, linear)

    def dphi(self, cos: torch.Tensor) -> torch.Tensor:
        """``dphi/dc``; 1 everywhere in straight-through mode.

        At ``c -> 1`` the true ArcFace derivative diverges; ``sin^2(theta)`` is floored
        at 1e-12 there, so it is large but finite.
        """
        if self.straight_through or self._pure_cosine:
            return torch.ones_like(cos)
        cos = cos.clamp(-1.0, 1.0)
        theta = torch.acos(cos)
        sin_theta = torch.sqrt((1.0 - cos * cos).clamp_min(_SIN_EPS))
        arc = self.m1 * torch.sin(self.m1 * theta + self.m2) / sin_theta
        if self.cos_star is None:
            return arc
        return torch.where(cos >= self.cos_star, arc, torch.ones_like(cos))

    def target_logit(self, cos: torch.Tensor) -> torch.Tensor:
        """``scale * phi(cos)``, differentiable with this margin's derivative."""
        return _MarginLogit.apply(cos, self)

    # -- the interface the softmax uses ----------------------------------------------
    needs_all_targets = False
    """Whether :meth:`plan` needs every sample's target cosine on every rank (the
    softmax then all-reduces them: one more collective of ``N`` values)."""
    fused = True
    """Whether the fused Triton backend supports this margin (it handles the target
    terms outside its kernels, so only a negative transform rules it out)."""

    def plan(self, cos_t: torch.Tensor, x_norm: torch.Tensor, *, update: bool) -> "MarginPlan":
        """Per-sample terms of one softmax call. ``cos_t [N]``: target cosines (valid
        where this rank owns the target, or everywhere when ``needs_all_targets``);
        ``x_norm [N]``: the embeddings' norms; ``update``: a training forward (running
        state advances)."""
        return MarginPlan(self.scale * self.phi(cos_t), self.scale * self.dphi(cos_t))

    def state_dict(self) -> dict[str, float]:
        """Running state (plain floats), empty for stateless margins."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} has no running state, got {sorted(state)}")

    def key(self) -> str:
        """What must agree on every rank (type and hyper-parameters)."""
        return repr(self)


class MarginPlan:
    """A margin's per-sample terms for one softmax call (all ``[N]``, scaled).

    - ``target``, ``dtarget``: target logit and its derivative in the target cosine.
    - ``dtarget_dnorm``: its derivative in the embedding's norm (None: independent).
    - ``extra``, ``dextra_dnorm``: a per-sample term added to the loss and its
      derivative in the norm (MagFace's regulariser; None: none).
    - ``neg_above``, ``neg_t``: CurricularFace's transform of the negatives: a
      negative cosine ``c > neg_above[n]`` becomes ``c * (neg_t + c)`` (None: none).
    """

    __slots__ = ("target", "dtarget", "dtarget_dnorm", "extra", "dextra_dnorm", "neg_above", "neg_t")

    def __init__(self, target, dtarget, dtarget_dnorm=None, extra=None, dextra_dnorm=None, neg_above=None,
                 neg_t=None):
        self.target, self.dtarget, self.dtarget_dnorm = target, dtarget, dtarget_dnorm
        self.extra, self.dextra_dnorm = extra, dextra_dnorm
        self.neg_above, self.neg_t = neg_above, neg_t


class _MarginLogit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cos, margin):
        ctx.save_for_backward(cos)
        ctx.margin = margin
        return margin.scale * margin.phi(cos)

    @staticmethod
    def backward(ctx, grad):
        (cos,) = ctx.saved_tensors
        return grad * ctx.margin.scale * ctx.margin.dphi(cos), None


class CombinedMargin(Margin):
    """``scale * (cos(m1*theta + m2) - m3)``: SphereFace (m1), ArcFace (m2), CosFace (m3)."""

    def __init__(self, scale: float = 64.0, m1: float = 1.0, m2: float = 0.5, m3: float = 0.0, *,
                 straight_through: bool = False):
        super().__init__(scale, m1, m2, m3, straight_through=straight_through)


class ArcFace(Margin):
    """Additive angular margin ``scale * cos(theta + margin)`` with its true derivative.

    ``straight_through=True`` reproduces arcface_torch: same value, gradient of
    ``scale * cos(theta)``.
    """

    def __init__(self, scale: float = 64.0, margin: float = 0.5, *, straight_through: bool = False):
        super().__init__(scale, 1.0, _check_number("margin", margin, low=0.0, high=math.pi, high_open=True),
                         0.0, straight_through=straight_through)
        self.margin = self.m2

    def __repr__(self) -> str:
        extra = ", straight_through=True" if self.straight_through else ""
        return f"ArcFace(scale={self.scale}, margin={self.margin}{extra})"


class CosFace(Margin):
    """Additive cosine margin ``scale * (cos(theta) - margin)``."""

    def __init__(self, scale: float = 64.0, margin: float = 0.4):
        super().__init__(scale, 1.0, 0.0, _check_number("margin", margin))
        self.margin = self.m3

    def __repr__(self) -> str:
        return f"CosFace(scale={self.scale}, margin={self.margin})"


# ---------------------------------------------------------------------- per-sample margins
def _sin_of(c: torch.Tensor) -> torch.Tensor:
    """``sin(acos(c))``, floored where the derivative of the angle is singular."""
    return torch.sqrt((1.0 - c * c).clamp_min(_SIN_EPS))


def _state_tensor(value, like: torch.Tensor) -> torch.Tensor:
    """A running-state scalar as a float64 tensor on ``like``'s device."""
    if isinstance(value, torch.Tensor):
        return value.to(device=like.device, dtype=torch.float64)
    return torch.tensor(float(value), dtype=torch.float64, device=like.device)


class _PerSample(Margin):
    """A margin that gives every sample its own target function: only :meth:`plan`."""

    def phi(self, cos):
        raise TypeError(f"{type(self).__name__} has a per-sample margin: the softmax calls its plan()")

    dphi = phi


class _Stateful(_PerSample):
    """A margin whose running state lives in float64 scalars (``_STATE``: name ->
    initial value), kept as device tensors so a step never waits for the host."""

    _STATE: dict = {}

    def _init_state(self):
        self._state = {k: torch.tensor(float(v), dtype=torch.float64) for k, v in self._STATE.items()}

    def _get(self, name, like):
        value = self._state[name]
        if value.device != like.device:
            value = self._state[name] = value.to(like.device)
        return value

    def state_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in self._state.items()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or sorted(state) != sorted(self._STATE):
            raise ValueError(f"{type(self).__name__} state must have keys {sorted(self._STATE)}, got "
                             f"{sorted(state) if isinstance(state, dict) else type(state).__name__}")
        for k, v in state.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"{type(self).__name__} state {k!r} must be a number, got {v!r}")
        self._state = {k: torch.tensor(float(state[k]), dtype=torch.float64) for k in self._STATE}


class AdaFace(_Stateful):
    """AdaFace (Kim et al., CVPR 2022): a margin that adapts to the feature norm, a
    proxy of image quality.

    With ``z = clip((||x|| clipped to [0.001, 100] - mean) / (std + eps) * h, -1, 1)``
    and the running batch ``mean`` and ``std`` of the norms, the target logit is
    ``scale * (cos(clip(theta - m z, eps, pi - eps)) - (m + m z))``: high-norm (easy)
    samples get an angular margin, low-norm (hard) ones a smaller additive one.

    As the official code (``mk-minchul/AdaFace``, ``head.py``): the norms are
    detached (the loss reaches the embedding only through its direction); in a
    training forward the running statistics are updated from the batch *before* the
    margin uses them, ``mean <- t_alpha * mean(norms) + (1 - t_alpha) * mean`` and the
    same for the unbiased ``std`` (initially 20 and 100; a global batch of one sample
    gives NaN, as there); the target cosine is clamped to ``[-1 + eps, 1 - eps]`` and
    the angle clipped to ``[eps, pi - eps]`` (the clips pass no gradient, which is how
    ``theta + m > pi`` is handled). Differences: the statistics cover the *global*
    batch (all ranks' samples, every rank computing the same values), where the
    official code under DDP follows each rank's local batch; they update in training
    forwards only (the official head updates in every forward); the non-target
    cosines are not clamped to ``1 - eps`` (a cosine above 0.999 to a negative).
    """

    _STATE = {"batch_mean": 20.0, "batch_std": 100.0}

    def __init__(self, scale: float = 64.0, m: float = 0.4, h: float = 0.333, t_alpha: float = 0.01,
                 eps: float = 1e-3):
        super().__init__(scale, 1.0, 0.0, 0.0)
        self.m = _check_number("m", m, low=0.0)
        self.h = _check_number("h", h, low=0.0)
        self.t_alpha = _check_number("t_alpha", t_alpha, low=0.0, high=1.0)
        self.eps = _check_number("eps", eps, low=0.0, low_open=True, high=0.5)
        self._init_state()

    def __repr__(self) -> str:
        return f"AdaFace(scale={self.scale}, m={self.m}, h={self.h}, t_alpha={self.t_alpha}, eps={self.eps})"

    def plan(self, cos_t, x_norm, *, update):
        norms = x_norm.detach().to(torch.float64).clamp(0.001, 100.0)
        mean, std = self._get("batch_mean", norms), self._get("batch_std", norms)
        if update:
            mean = self._state["batch_mean"] = norms.mean() * self.t_alpha + (1.0 - self.t_alpha) * mean
            std = self._state["batch_std"] = norms.std() * self.t_alpha + (1.0 - self.t_alpha) * std
        z = ((norms - mean) / (std + self.eps) * self.h).clamp(-1.0, 1.0).to(cos_t.dtype)
        lo, hi = -1.0 + self.eps, 1.0 - self.eps
        c = cos_t.clamp(lo, hi)
        theta = torch.acos(c)
        raw = theta - self.m * z
        theta_m = raw.clamp(self.eps, math.pi - self.eps)
        target = self.scale * (torch.cos(theta_m) - (self.m + self.m * z))
        inside = (cos_t >= lo) & (cos_t <= hi) & (raw >= self.eps) & (raw <= math.pi - self.eps)
        dtarget = torch.where(inside, self.scale * torch.sin(theta_m) / _sin_of(c), torch.zeros_like(c))
        return MarginPlan(target, dtarget)


class MagFace(_PerSample):
    """MagFace (Meng et al., CVPR 2021): an angular margin growing with the feature
    magnitude, plus a regulariser that rewards magnitude.

    With ``a = ||x||`` clamped to ``[l_a, u_a]`` and ``m(a) = l_m + (u_m - l_m) (a -
    l_a) / (u_a - l_a)``, the target logit is ``scale * cos(theta + m(a))`` and each
    sample adds ``lambda_g * (a / u_a^2 + 1 / a)`` to the loss. The magnitude is not
    detached: the gradient reaches it through the margin and the regulariser (zero
    outside ``[l_a, u_a]``, where the clamp is flat).

    ``theta + m > pi``: the official ``MagLinear`` (``IrvingMeng/MagFace``) defaults
    to ``easy_margin=True`` and its training scripts keep it: the margin applies where
    ``cos > 0`` and the target is the plain cosine elsewhere. ``easy_margin=False``
    is its other branch: ``cos - m sin(m)`` below ``cos(pi - m)``.
    """

    def __init__(self, scale: float = 64.0, l_a: float = 10.0, u_a: float = 110.0, l_m: float = 0.45,
                 u_m: float = 0.8, lambda_g: float = 35.0, *, easy_margin: bool = True):
        super().__init__(scale, 1.0, 0.0, 0.0)
        self.l_a = _check_number("l_a", l_a, low=0.0, low_open=True)
        self.u_a = _check_number("u_a", u_a, low=self.l_a, low_open=True)
        self.l_m = _check_number("l_m", l_m, low=0.0, high=math.pi, high_open=True)
        self.u_m = _check_number("u_m", u_m, low=0.0, high=math.pi, high_open=True)
        self.lambda_g = _check_number("lambda_g", lambda_g, low=0.0)
        if not isinstance(easy_margin, bool):
            raise TypeError(f"easy_margin must be a bool, got {easy_margin!r}")
        self.easy_margin = easy_margin

    def __repr__(self) -> str:
        return (f"MagFace(scale={self.scale}, l_a={self.l_a}, u_a={self.u_a}, l_m={self.l_m}, u_m={self.u_m}, "
                f"lambda_g={self.lambda_g}, easy_margin={self.easy_margin})")

    def plan(self, cos_t, x_norm, *, update):
        x_norm = x_norm.to(cos_t.dtype)
        a = x_norm.clamp(self.l_a, self.u_a)
        in_range = ((x_norm >= self.l_a) & (x_norm <= self.u_a)).to(cos_t.dtype)
        slope = (self.u_m - self.l_m) / (self.u_a - self.l_a)
        mg = slope * (a - self.l_a) + self.l_m
        c = cos_t.clamp(-1.0, 1.0)
        sin = _sin_of(c)
        cos_m, sin_m = torch.cos(mg), torch.sin(mg)
        arc = c * cos_m - sin * sin_m
        if self.easy_margin:
            use = c > 0
            other, d_other_dm = c, torch.zeros_like(c)
        else:
            use = c > torch.cos(math.pi - mg)
            other, d_other_dm = c - sin_m * mg, -(sin_m + mg * cos_m)
        target = self.scale * torch.where(use, arc, other)
        dtarget = self.scale * torch.where(use, cos_m + sin_m * c / sin, torch.ones_like(c))
        dtarget_dm = self.scale * torch.where(use, -c * sin_m - sin * cos_m, d_other_dm)
        extra = self.lambda_g * (a / self.u_a ** 2 + 1.0 / a)
        dextra = self.lambda_g * (1.0 / self.u_a ** 2 - 1.0 / (a * a)) * in_range
        return MarginPlan(target, dtarget, dtarget_dm * slope * in_range, extra, dextra)


class CurricularFace(_Stateful):
    """CurricularFace (Huang et al., CVPR 2020): ArcFace on the target, and hard
    negatives re-weighted by a running estimate ``t`` of the training progress.

    A negative cosine ``c`` above the sample's margined target ``cos(theta_y + m)``
    becomes ``c (t + c)``: ignored early (``t ~ 0``), emphasised later. In a training
    forward ``t <- 0.01 * mean(cos_y) + 0.99 t`` over the global batch's target
    cosines, *before* it is used (initially 0). As the official code
    (``HuangYG123/CurricularFace``, ``head/metrics.py``): the hard-negative test
    compares with the unthresholded ``cos(theta_y + m)``, the target itself uses
    ArcFace's ``cos(theta) - m sin(m)`` below ``cos(pi - m)``, and ``t`` is a constant
    for the gradient (a hard negative's derivative is ``t + 2c``). Every rank needs
    every sample's target cosine for the test: one all-reduce of ``N`` values more per
    step. ``t`` follows the global batch, where the official code under DDP follows
    each rank's own; it updates in training forwards only. The fused Triton backend
    does not implement the negative transform (``backend="auto"`` uses torch).
    """

    _STATE = {"t": 0.0}
    needs_all_targets = True
    fused = False

    def __init__(self, scale: float = 64.0, m: float = 0.5):
        super().__init__(scale, 1.0, _check_number("m", m, low=0.0, high=math.pi, high_open=True), 0.0)
        self.m = self.m2
        self._init_state()

    def __repr__(self) -> str:
        return f"CurricularFace(scale={self.scale}, m={self.m})"

    def plan(self, cos_t, x_norm, *, update):
        c = cos_t.clamp(-1.0, 1.0)
        sin = _sin_of(c)
        cos_m, sin_m = math.cos(self.m), math.sin(self.m)
        arc = c * cos_m - sin * sin_m
        use = c > math.cos(math.pi - self.m)
        target = self.scale * torch.where(use, arc, c - math.sin(math.pi - self.m) * self.m)
        dtarget = self.scale * torch.where(use, cos_m + sin_m * c / sin, torch.ones_like(c))
        t = self._get("t", c)
        if update:
            t = self._state["t"] = c.to(torch.float64).mean() * 0.01 + 0.99 * t
        return MarginPlan(target, dtarget, neg_above=arc, neg_t=t.to(c.dtype))


class _Elastic(_Stateful):
    """Per-sample margins drawn from ``N(m, std)`` (ElasticFace, Boutros et al., CVPRW
    2022), one per sample of the global batch, from a generator seeded by ``(seed,
    draw)`` where ``draw`` counts the training forwards (saved in checkpoints): the
    same on every rank and in a resumed run. Evaluation forwards use ``m`` itself.
    ``plus=True`` is ElasticFace+: the sorted margins are handed out by the target
    cosines, exactly as the official code indexes them (``sorted_margins[argsort of
    the cosines, descending]``), which needs every target cosine on every rank."""

    _STATE = {"draw": 0}
    fused = True

    def __init__(self, scale, m, std, plus, seed):
        Margin.__init__(self, scale, 1.0, 0.0, 0.0)
        self.m = _check_number("m", m)
        self.std = _check_number("std", std, low=0.0)
        if not isinstance(plus, bool):
            raise TypeError(f"plus must be a bool, got {plus!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {seed!r}")
        self.plus, self.seed = plus, seed
        self.needs_all_targets = plus
        self._draw = 0

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scale={self.scale}, m={self.m}, std={self.std}, plus={self.plus}, seed={self.seed})"

    def margins(self, cos_t: torch.Tensor, draw: int) -> torch.Tensor:
        """The ``[N]`` margins of training forward number ``draw``."""
        import hashlib
        digest = hashlib.blake2b(f"elastic:{self.seed}:{draw}".encode(), digest_size=8).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
        drawn = torch.normal(self.m, self.std, (cos_t.shape[0],), generator=gen, dtype=torch.float64)
        drawn = drawn.to(device=cos_t.device, dtype=cos_t.dtype)
        if self.plus:
            order = torch.argsort(cos_t.detach(), descending=True, stable=True)
            drawn = torch.sort(drawn, stable=True).values[order]
        return drawn

    def plan(self, cos_t, x_norm, *, update):
        if update:
            m = self.margins(cos_t, self._draw)
            self._draw += 1
        else:
            m = torch.full_like(cos_t, self.m)
        return self._target(cos_t.clamp(-1.0, 1.0), m)

    def state_dict(self) -> dict[str, int]:
        return {"draw": self._draw}

    def load_state_dict(self, state: dict) -> None:
        draw = state.get("draw") if isinstance(state, dict) and sorted(state) == ["draw"] else None
        if isinstance(draw, float) and draw.is_integer():
            draw = int(draw)
        if isinstance(draw, bool) or not isinstance(draw, int) or draw < 0:
            raise ValueError(f"{type(self).__name__} state must be {{'draw': int >= 0}}, got {state!r}")
        self._draw = draw


class ElasticArcFace(_Elastic):
    """ElasticFace-Arc: ``scale * cos(theta + m_i)`` with ``m_i ~ N(m, std)``. As the
    official code (``fdbtrs/ElasticFace``, ``utils/losses.py``) the angle is not
    limited: past ``pi`` the logit grows again (no ``theta + m > pi`` handling)."""

    def __init__(self, scale: float = 64.0, m: float = 0.5, std: float = 0.05, *, plus: bool = False,
                 seed: int = 0):
        super().__init__(scale, m, std, plus, seed)

    def _target(self, c, m):
        theta = torch.acos(c)
        return MarginPlan(self.scale * torch.cos(theta + m), self.scale * torch.sin(theta + m) / _sin_of(c))


class ElasticCosFace(_Elastic):
    """ElasticFace-Cos: ``scale * (cos(theta) - m_i)`` with ``m_i ~ N(m, std)``."""

    def __init__(self, scale: float = 64.0, m: float = 0.35, std: float = 0.0125, *, plus: bool = False,
                 seed: int = 0):
        super().__init__(scale, m, std, plus, seed)

    def _target(self, c, m):
        return MarginPlan(self.scale * (c - m), torch.full_like(c, self.scale))
