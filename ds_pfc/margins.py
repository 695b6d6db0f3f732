"""Margin functions on the target cosine (pure tensor math).

A margin maps the target cosine ``c = cos(theta)`` to ``phi(c)``; the target logit is
``scale * phi(c)`` and every other active logit is ``scale * c``. Each margin gives
``phi`` and its derivative ``dphi/dc`` in closed form, so the softmax can apply the
chain rule in place without keeping an autograd graph over ``N x S`` logits.

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

__all__ = ["Margin", "CombinedMargin", "ArcFace", "CosFace"]

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
