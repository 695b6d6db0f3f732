"""The DeepSpeed internals ds_pfc reads or patches, each through :func:`internal`.

A private attribute that a DeepSpeed release renames must not quietly turn into a
default (a loss scaler read as "none" leaves the heads' gradients scaled by 65536; a
tensor-parallel group read as "none" shards a head over the wrong ranks): where
ds_pfc needs one and it is missing, :class:`DeepSpeedInternalsError` names the
attribute, what it is needed for, and the installed DeepSpeed version.
"""
from __future__ import annotations

__all__ = ["DeepSpeedInternalsError", "deepspeed_version", "internal", "none_is_missing", "require_internal"]

_MISSING = object()


class DeepSpeedInternalsError(RuntimeError):
    """An attribute of DeepSpeed that ds_pfc relies on is missing in the installed version."""


def deepspeed_version() -> str:
    import deepspeed
    return str(getattr(deepspeed, "__version__", "unknown"))


def _missing(owner: str, name: str, why: str) -> DeepSpeedInternalsError:
    return DeepSpeedInternalsError(
        f"{owner}.{name} is missing in the installed DeepSpeed {deepspeed_version()}; ds_pfc needs it {why}. "
        "This DeepSpeed version is not supported by this ds_pfc (install the DeepSpeed release ds_pfc declares)")


def internal(obj, name: str, *, owner: str, why: str):
    """``getattr(obj, name)``, or :class:`DeepSpeedInternalsError` when ``obj`` has no
    ``name``. ``owner`` names ``obj`` in the message (``"engine"``,
    ``"deepspeed.utils.groups"``, the optimizer's class), ``why`` says what for."""
    value = getattr(obj, name, _MISSING)
    if value is _MISSING:
        raise _missing(owner, name, why)
    return value


def require_internal(obj, name: str, *, owner: str, why: str) -> None:
    """Raise :class:`DeepSpeedInternalsError` unless ``obj`` has ``name`` (before
    replacing or setting it: a renamed attribute would be set without effect)."""
    internal(obj, name, owner=owner, why=why)


def none_is_missing(value, owner: str, name: str, why: str):
    """``value``, unless it is None where DeepSpeed should have set it."""
    if value is None:
        raise DeepSpeedInternalsError(
            f"{owner}.{name} is None in the installed DeepSpeed {deepspeed_version()}, but ds_pfc needs it {why}; "
            "this DeepSpeed version is not supported by this ds_pfc")
    return value
