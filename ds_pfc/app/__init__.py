"""The training app: the job config (``config``), its datasets (``datasets``), the
training loop (``training``), exports that need the job (``export``), the paper
studies (``experiments``), fine-tuning from weights (``finetune``), what may change on
resume (``resume_changes``), arcface_torch import (``arcface_import``), config
migration (``migrate``) and loading any model for evaluation (``eval_models``).

May import: every ds_pfc layer below it (core, bank, kernels, data, models, eval,
checkpoint, deepspeed_plugin, bench and the top-level helpers).
Never: ds_pfc.cli, the root package."""
