"""Loss scaling for the heads: the scale the engine's optimizer divides by (fp16, or a
float16-autocast ``GradScaler``), the probe that checks the loss gradient carries it,
and the overflow checks on the heads' gradients. :func:`loss_scale` and the scaler
helpers take a DeepSpeed engine; :func:`scaled_grad`, :func:`probed_loss_fn` and the
finite checks take the :class:`~ds_pfc.deepspeed_plugin.PfcEngine` (its DeepSpeed
engine is ``engine.engine``)."""
from __future__ import annotations

import contextlib
import math

import torch

from ..devices import collective_device
from .._ds_internals import DeepSpeedInternalsError, deepspeed_version, internal, none_is_missing

# ``engine`` arguments are :class:`~ds_pfc.deepspeed_plugin.engine.PfcEngine` objects; the
# annotations name it without importing it (the engine module imports this one).

__all__ = ["loss_scale"]


def _grad_scaler(engine):
    """The torch ``GradScaler`` DeepSpeed uses for float16 autocast (ZeRO 0: the
    engine's; ZeRO 1-3: the optimizer's), or None without float16 autocast. With it
    and no scaler where this DeepSpeed keeps it, raises (the heads' gradients would
    stay multiplied by the scale)."""
    why = "to unscale the heads' gradients under float16 torch_autocast"
    enabled = internal(engine, "torch_autocast_enabled", owner="engine", why=why)
    if not enabled() or internal(engine, "torch_autocast_dtype", owner="engine", why=why)() != torch.float16:
        return None
    if engine.zero_optimization_stage() == 0:
        scaler = internal(engine, "torch_autocast_z0_gradscaler", owner="engine", why=why)
        return none_is_missing(scaler, "engine", "torch_autocast_z0_gradscaler", why)
    optimizer = engine.optimizer
    owner = f"optimizer ({type(optimizer).__name__})"
    scaler = internal(optimizer, "torch_autocast_gradscaler", owner=owner, why=why)
    return none_is_missing(scaler, owner, "torch_autocast_gradscaler", why)


def loss_scale(engine) -> float:
    """The factor the optimizer divides the gradients by at the next step (1.0 unless
    fp16 loss scaling or a float16-autocast grad scaler is active)."""
    scaler = _grad_scaler(engine)
    if scaler is not None:
        return float(scaler.get_scale())
    if not engine.fp16_enabled():
        return 1.0
    for attr in ("cur_scale", "loss_scale"):
        value = getattr(engine.optimizer, attr, None)
        if isinstance(value, torch.Tensor):
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    raise DeepSpeedInternalsError(f"fp16 is enabled but the loss scale of {type(engine.optimizer).__name__} "
                                  "cannot be read (neither cur_scale nor loss_scale) in the installed DeepSpeed "
                                  f"{deepspeed_version()}; the heads' gradients could not be unscaled")


def _uses_loss_scaling(engine) -> bool:
    return _grad_scaler(engine) is not None or bool(engine.fp16_enabled())


def _lower_loss_scale(engine) -> None:
    """Let the optimizer's loss scaler react as to an overflow (a dynamic scale comes
    down, after its hysteresis; a static one stays)."""
    scaler = _grad_scaler(engine)
    if scaler is not None:
        scaler.update(new_scale=scaler.get_scale() * scaler.get_backoff_factor())
        return
    # DeepSpeed's fp16 and ZeRO optimizers
    internal(engine.optimizer, "_update_scale", owner=f"optimizer ({type(engine.optimizer).__name__})",
             why="to lower the loss scale after a head gradient overflowed")(True)


class _LossScaleProbe(torch.autograd.Function):
    """forward: identity on the loss; backward: hands the incoming gradient to
    :func:`scaled_grad` with the loss scale and the divisor DeepSpeed applied to the
    loss (which may multiply the missing loss scale in)."""

    @staticmethod
    def forward(ctx, loss, engine, scale, divisor):
        ctx.engine, ctx.scale, ctx.divisor = engine, scale, divisor
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx, grad):
        return scaled_grad(ctx.engine, grad, ctx.scale, ctx.divisor), None, None, None


def scaled_grad(engine: PfcEngine, grad: torch.Tensor, scale: float, gas: float) -> torch.Tensor:
    """The loss gradient ``grad`` carrying ``scale``: whether DeepSpeed multiplied it in
    is decided once, from the first gradient that arrives (divided by ``gas``, the
    gradient accumulation divisor), and kept on ``engine``."""
    if scale == 1.0:
        return grad
    if engine._ds_scales_loss is None:        # decided once, from what arrived (one host sync)
        got = float(grad) * gas
        if math.isclose(got, scale, rel_tol=1e-3):
            engine._ds_scales_loss = True
        elif math.isclose(got, 1.0, rel_tol=1e-3):
            engine._ds_scales_loss = False
        else:
            raise RuntimeError(f"the loss gradient DeepSpeed back-propagates is {got:g} / "
                               f"gradient_accumulation_steps, neither 1 nor the loss scale {scale:g} its "
                               f"optimizer ({type(engine.engine.optimizer).__name__}) divides by; the heads' "
                               "gradients cannot be unscaled")
    return grad if engine._ds_scales_loss else grad * scale


@contextlib.contextmanager
def probed_loss_fn(engine: PfcEngine, scale: float):
    """On the last stage of a pipeline under loss scaling: the module's ``loss_fn``
    returns its loss through :class:`_LossScaleProbe` inside the block."""
    module = engine.engine.module
    if not engine._scaling or not engine.engine.is_last_stage():
        yield
        return
    loss_fn = module.loss_fn

    gas = float(engine.engine.gradient_accumulation_steps())

    def probed(outputs, labels):
        return _LossScaleProbe.apply(loss_fn(outputs, labels), engine, scale, gas)

    own = vars(module).get("loss_fn")          # None: a module loss_fn, registered in _modules
    object.__setattr__(module, "loss_fn", probed)
    try:
        yield
    finally:
        if own is None:
            del vars(module)["loss_fn"]
        else:
            object.__setattr__(module, "loss_fn", own)


def head_grads_finite(engine: PfcEngine) -> bool:
    """Whether every head's pending gradient is finite on every rank (one small
    all-reduce over the world and one host sync, only under loss scaling)."""
    flags = torch.stack([h.pending_grads_finite() for h in engine.heads.values()]).all().to(torch.float32)
    flag = flags.reshape(1).to(collective_device(None, engine.device))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item() == 1.0)


def head_grads_finite_on_every_stage(engine: PfcEngine) -> bool:
    """:func:`head_grads_finite` for a pipeline, where only the last stage holds heads:
    every rank joins the all-reduce (one host sync, only under loss scaling)."""
    flag = torch.ones((), dtype=torch.float32, device=torch.device(engine.device))
    for head in engine.heads.values():
        flag = flag * head.pending_grads_finite().to(flag)
    flag = flag.reshape(1).to(collective_device(None, engine.device))
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item() == 1.0)
