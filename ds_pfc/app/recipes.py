"""The shipped job configs ("recipes"): ``configs/*.json`` of the source tree, packaged
with ds_pfc as ``ds_pfc/configs`` so that an installed copy can name them.

    ds-pfc-train --list-configs
    ds-pfc-train --deepspeed_config arcface_ms1mv3_r50_8gpu

A ``--deepspeed_config`` value that is not a file and has no directory part is looked up
here by name (with or without ``.json``)."""
from __future__ import annotations

import difflib
import json
import os

__all__ = ["recipe_dir", "recipe_names", "recipe_path", "resolve_config", "summary"]


def recipe_dir() -> str:
    """The directory of the shipped configs (inside the package)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def recipe_names() -> list[str]:
    """Names of the shipped configs, sorted (file names without ``.json``)."""
    folder = recipe_dir()
    if not os.path.isdir(folder):
        return []
    return sorted(n[:-5] for n in os.listdir(folder) if n.endswith(".json"))


def recipe_path(name: str) -> str:
    """The file of the shipped config ``name``; FileNotFoundError naming the closest names."""
    stem = name[:-5] if name.endswith(".json") else name
    path = os.path.join(recipe_dir(), stem + ".json")
    if os.path.isfile(path):
        return path
    names = recipe_names()
    close = difflib.get_close_matches(stem, names, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    raise FileNotFoundError(f"config file not found: {name!r} is neither a file nor a shipped config{hint} "
                            "(ds-pfc-train --list-configs lists them)")


def resolve_config(value: str) -> str:
    """``--deepspeed_config``'s value as a path: an existing file as it is, else a bare name
    (no directory part) as a shipped config; else FileNotFoundError (naming the shipped
    config when the missing path's file name is one, e.g. ``configs/cpu_quickstart.json``
    run outside a checkout)."""
    if os.path.isfile(value):
        return value
    if os.sep in value or (os.altsep and os.altsep in value):
        # A path that is not there, e.g. configs/cpu_quickstart.json outside a checkout:
        # when its file name is a shipped config, say how to name that one.
        base = os.path.basename(value.rstrip("/" + os.sep))
        stem = base[:-5] if base.endswith(".json") else base
        hint = (f"; {stem} is a config shipped with ds_pfc: --deepspeed_config {stem}"
                if stem and stem in recipe_names() else "")
        raise FileNotFoundError(f"config file not found: {value!r} (looked for {os.path.abspath(value)}){hint}")
    return recipe_path(value)


def summary(name: str, width: int = 100) -> str:
    """The first clause of a shipped config's ``ds_pfc.description`` (at most ``width``
    characters), or '' without one."""
    try:
        with open(recipe_path(name)) as f:
            text = (json.load(f).get("ds_pfc") or {}).get("description") or ""
    except (OSError, ValueError):
        return ""
    text = " ".join(str(text).split())
    depth = 0
    for i, ch in enumerate(text):           # the first ": " or ". " outside parentheses
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and ch in ":." and text[i + 1: i + 2] == " ":
            text = text[:i]
            break
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."
