"""Old module paths keep importing: ``ds_pfc.head`` is ``ds_pfc.core.head``, the same
module object (not a copy of its names), so ``import ds_pfc.head``, ``from ds_pfc.config
import split_config``, ``monkeypatch.setattr("ds_pfc.training.x", ...)`` and a pickle
that names ``ds_pfc.margins.ArcFace`` all reach the module that is used.

A finder at the front of ``sys.meta_path`` (installed by ``ds_pfc/__init__.py``) answers
only for the paths in :data:`MOVED` (at the front, so that no other finder, e.g. an
editable install of an older checkout, hands out a stale module under an old path)."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys

__all__ = ["MOVED", "install"]

# old path -> new path (0.2.0 moved them)
MOVED = {
    **{f"ds_pfc.{name}": f"ds_pfc.core.{name}"
       for name in ("partition", "sampling", "collectives", "margins", "softmax", "functional", "optim", "head")},
    "ds_pfc.checkpoint_tags": "ds_pfc.checkpoint.tags",
    "ds_pfc.universal": "ds_pfc.checkpoint.universal",
    **{f"ds_pfc.{name}": f"ds_pfc.app.{name}"
       for name in ("config", "training", "experiments", "export", "finetune", "resume_changes", "arcface_import")},
    "ds_pfc.eval.models": "ds_pfc.app.eval_models",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path and loads it as the new module itself."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(MOVED[spec.name])
        self._specs = getattr(self, "_specs", {})
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        # The import system wrote the alias' spec onto the module; give it back its own,
        # so its __name__ and __spec__ keep naming the new path (pickles, runpy, reload).
        spec = self._specs.pop(module.__spec__.name, None) if module.__spec__ is not None else None
        if spec is not None:
            module.__spec__ = spec
            module.__loader__ = spec.loader


_FINDER = _Alias()


def install() -> None:
    """Put the alias finder at the front of ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Alias) for f in sys.meta_path):
        sys.meta_path.insert(0, _FINDER)
