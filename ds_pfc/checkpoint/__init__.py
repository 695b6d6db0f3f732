"""Checkpoint file formats: per-rank head shards (``shards``), tag directories with a
crash-safe commit (``tags``), the one atomic write (``files``), DeepSpeed universal
conversion (``universal``) and exports read from files alone (``export``). Knows
files, not engines. The public names of ``shards`` are re-exported here, so
``ds_pfc.checkpoint.reshard`` and ``ds_pfc.checkpoint.SubcenterCounter`` keep working.

May import: ds_pfc._checks, ds_pfc._ds_internals, ds_pfc.devices, ds_pfc.core (Partition);
torch, safetensors; deepspeed inside functions.
Never: ds_pfc.deepspeed_plugin, ds_pfc.bench, ds_pfc.app, ds_pfc.cli, the root package."""
from .shards import *  # noqa: F401,F403
from .shards import __all__
