"""DeepSpeed integration: the backbone in a DeepSpeed engine, Partial FC heads beside it.

DeepSpeed broadcasts every registered parameter from rank 0 at start-up, averages
every gradient over the data-parallel group, partitions parameters under ZeRO and
saves the module from one rank only. All four are wrong for a class-sharded head, so
heads are never registered: :func:`attach` stores a head on a module without
``nn.Module`` registration (the module can still call it in ``forward``), and
:class:`PfcEngine` steps the heads itself.

    model = MyModel()                                 # backbone + task layers
    attach(model, "identity", PartialFC(C, 512, sample_rate=0.1, group=None, device=dev))
    engine = initialize(model=model, config=ds_config)
    for x, y in loader:
        loss = engine(x, y)                           # model.forward calls self.identity(emb, y)
        engine.backward(loss)
        engine.step()                                 # heads step at the optimizer boundary

Gradient scale, per optimizer step of the engine:

- ``engine.backward`` divides the loss by the gradient accumulation steps; the heads'
  gradients are therefore the mean over the micro batches, like the backbone's.
  ``loss.backward()`` and ``engine.scale(loss).backward()`` (DeepSpeed accepts them at
  ZeRO 1-3) divide the gradient of the engine's outputs instead; a head applied to
  those outputs gets the same division on its centers' gradient
  (:meth:`PfcEngine._center_grad_hook`).
- Loss scaling (``fp16``, or ``torch_autocast`` with float16): :meth:`PfcEngine.backward`
  checks, by behaviour, that the gradient reaching the loss carries the scale the
  optimizer will divide by, and multiplies it in where DeepSpeed did not (its fp16
  optimizers at ZeRO stage 0 divide by the scale without having multiplied by it).
  The scale in force during the accumulation window is read before ``engine.step()``
  and passed to ``head.step(grad_scale=)``.
- Overflow: a head whose gradient is not finite poisons its embedding gradient, so
  DeepSpeed's overflow check sees it and skips the step; when the engine skips (its
  optimizer's overflow flag, or a drop of a torch ``GradScaler``'s scale) the heads
  drop their gradients too. A head that overflows while the backbone did not (a
  detached embedding) skips alone and the loss scale is lowered as for an overflow.
- The heads' learning rate is the engine's (first parameter group) at that step,
  times each head's ``lr_ratio``.
- ``gradient_clipping`` applies to the engine's parameters only, as arcface_torch
  clips the backbone only; head rows are not clipped.

Refused at :func:`initialize`: a gradient all-reduce that does not average
(``gradient_allreduce_op`` other than the mean; the backbone would get W times the
heads' gradient); sequence parallelism. Refused elsewhere: a head built inside
``deepspeed.zero.Init`` (at construction) and a head recomputed by activation
checkpointing (in backward). DeepSpeed internals are read through
:mod:`ds_pfc._ds_internals`: a missing one raises, naming it and the
DeepSpeed version. ``managed_gradient_accumulation: false`` is supported: every
``step()`` is then an optimizer boundary, for the heads as for DeepSpeed. With a
decoupled (asynchronous) checkpoint writer, :meth:`PfcEngine.save_checkpoint` waits
for DeepSpeed's commit before it writes the completion marker.

Modules: ``heads`` (:func:`attach`, :func:`head_spec`), ``groups``
(:func:`init_distributed`, the engine's process groups and the options refused),
``loss_scaling`` (the scale the heads unscale by, overflow), ``checkpointing`` (what a
checkpoint tag holds and how it is committed and loaded), ``engine``
(:func:`initialize`, :class:`PfcEngine`). ``engine`` imports the others; ``groups`` and ``checkpointing`` may import
``heads``; ``checkpointing`` takes the engine as an argument and never imports it.
May import from ds_pfc: the L0 modules (``devices``, ``_ds_internals``, ...), ``core``
and ``checkpoint``; deepspeed inside functions only. Never: ``app``, ``cli``, ``bench``.
"""
from __future__ import annotations

from ..checkpoint.tags import CheckpointError, CheckpointIncompleteError
from .checkpointing import COMPLETE_MARKER, list_checkpoints, remove_checkpoint
from .engine import PfcEngine, initialize
from .groups import init_distributed
from .heads import HeadSpec, attach, attached_heads, head_spec
from .._ds_internals import DeepSpeedInternalsError
from .loss_scaling import loss_scale

__all__ = ["attach", "attached_heads", "head_spec", "HeadSpec", "init_distributed", "initialize", "PfcEngine",
           "loss_scale",
           "DeepSpeedInternalsError", "COMPLETE_MARKER", "CheckpointError", "CheckpointIncompleteError",
           "list_checkpoints", "remove_checkpoint"]
