"""Console commands: ``ds-pfc-train``, ``ds-pfc-eval``, ``ds-pfc-export``, ``ds-pfc-bench``,
``ds-pfc-experiments``, ``ds-pfc-selfcheck`` and ``ds-pfc-migrate`` (setup.cfg's
console_scripts), and the code behind ``launch/*.py``, which call these same mains.
Each module has ``build_parser()`` (its argparse parser) and ``main(argv=None)`` (the
exit status); where a result is useful in-process, ``run(argv=None)`` returns it.

May import: every ds_pfc layer (app, bench, deepspeed_plugin, checkpoint, core, ...); argparse.
Never: the root package; nothing imports cli except the ``python -m`` entry files
(ds_pfc/selfcheck.py)."""
from __future__ import annotations

import os

__all__ = ["checkout_root"]


def checkout_root() -> str | None:
    """The source checkout that holds this ds_pfc package (the directory with ``ds_pfc/``,
    ``configs/`` and ``launch/``), or None for an installed package."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if all(os.path.isdir(os.path.join(root, d)) for d in ("ds_pfc", "configs", "launch")):
        return root
    return None
