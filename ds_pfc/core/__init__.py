"""The head without DeepSpeed: the class partition, the class sampler, the collectives,
the margins, the exact sharded margin softmax, its function form
(``margin_cross_entropy``), the row optimizers and the ``PartialFC`` module.

May import: ds_pfc._checks, ds_pfc._rng, ds_pfc.devices, ds_pfc.bank, ds_pfc.kernels
(lazily, inside functions); torch.
Never: ds_pfc.checkpoint, ds_pfc.deepspeed_plugin, ds_pfc.bench, ds_pfc.app, ds_pfc.cli,
the root package; deepspeed; triton at module level."""
