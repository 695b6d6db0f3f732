"""The ds_pfc release (``__version__``: one place, which the package, setup.cfg and the
app's logs read) and the torch and DeepSpeed versions ds_pfc is tested with, checked when
it is imported.

``setup.cfg`` states the same ranges (a test keeps the two equal). Below a floor ds_pfc
does not work: the import stops with an error naming the installed version and the
range, unless ``DS_PFC_ALLOW_UNTESTED=1`` is set (for a GPU image whose preinstalled
torch is older: the import then warns instead). Above the tested ceiling it may work,
but nobody has run it: the import warns once, naming both, and ds_pfc's reads of DeepSpeed internals stop with an error rather
than guess if one of them has gone.
"""
from __future__ import annotations

import os
import re
import warnings

__all__ = ["__version__", "TESTED", "check_versions", "check_version", "parse_version"]

__version__ = "0.2.0"

TESTED = {
    # 2.13 is the oldest torch the suite runs on; the ceiling admits the 2.14 series
    # (its DeepSpeed-facing, head and kernel tests pass on 2.14.1; not run in CI).
    "torch": ("2.13", "2.15"),
    # Earlier releases lack engine.managed_gradient_accumulation() (before 0.19.4,
    # every PfcEngine.step calls it), restore a ZeRO 1-3 universal checkpoint's
    # weights from the wrong files (before 0.19.7: a resume on another number of ranks
    # would start from other weights), or (0.19.7) now and then give a ZeRO-3 backbone
    # update that differs from plain PyTorch's. CI runs the suite on 0.19.8.
    "deepspeed": ("0.19.8", "0.20"),
}
"""package -> (lowest supported, first untested): ``lowest <= version < first untested``."""

_WHY = {
    "torch": "older releases are untested",
    "deepspeed": "older releases lack engine.managed_gradient_accumulation(), which every step calls, or "
                 "load a universal checkpoint's weights wrong",
}


def parse_version(text: str) -> tuple[int, ...]:
    """The release numbers of a version string: ``"2.13.0+cpu"`` -> ``(2, 13, 0)``,
    ``"0.19.5rc1"`` -> ``(0, 19, 5)``."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", str(text))
    if match is None:
        raise ValueError(f"version: cannot read a release number from {text!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def _pad(version: tuple[int, ...], width: int = 3) -> tuple[int, ...]:
    return version + (0,) * max(0, width - len(version))


def check_version(package: str, installed: str) -> None:
    """Raise ``ImportError`` when ``installed`` is below ``package``'s tested floor;
    warn when it is at or above the first untested release."""
    low, high = TESTED[package]
    have = _pad(parse_version(installed))
    span = f">={low},<{high}"
    if have < _pad(parse_version(low)):
        message = (f"ds_pfc needs {package}{span} ({_WHY[package]}); installed: {package} {installed}. "
                   f"Install a supported release, e.g. pip install '{package}{span}'")
        if os.environ.get("DS_PFC_ALLOW_UNTESTED") != "1":
            raise ImportError(message + ", or set DS_PFC_ALLOW_UNTESTED=1 to run on it anyway")
        warnings.warn(message + "; running anyway (DS_PFC_ALLOW_UNTESTED=1)", RuntimeWarning, stacklevel=3)
        return
    if have >= _pad(parse_version(high)):
        warnings.warn(f"ds_pfc is tested with {package}{span}; installed: {package} {installed}, which has not "
                      "been tested. It may work; ds_pfc stops with an error if a DeepSpeed internal it relies on "
                      "has changed", RuntimeWarning, stacklevel=3)


def check_versions() -> None:
    """Check the installed torch and (if installed) DeepSpeed; reads DeepSpeed's
    version from its package metadata, without importing it."""
    from importlib import metadata

    import torch

    check_version("torch", torch.__version__)
    try:
        deepspeed = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        return      # ds_pfc.deepspeed_plugin then fails to import, naming the missing package
    check_version("deepspeed", deepspeed)
