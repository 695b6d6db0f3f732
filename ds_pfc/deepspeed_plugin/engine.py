"""The engine wrapper: :func:`initialize` builds the DeepSpeed engine and the heads
beside it, and :class:`PfcEngine` steps the heads at the optimizer boundary and saves
and loads them with the engine (the module docstring of :mod:`ds_pfc.deepspeed_plugin`
says how the gradient scale is kept)."""
from __future__ import annotations

import warnings

import torch
from torch import nn

from . import checkpointing
from .groups import _check_engine, _EngineGroups
from .heads import HeadSpec, _Attached, _checked_heads, _last_stage_heads
from .._ds_internals import internal
from .loss_scaling import (_grad_scaler, _LossScaleProbe, _lower_loss_scale, _uses_loss_scaling, head_grads_finite,
                           head_grads_finite_on_every_stage, loss_scale, probed_loss_fn)

__all__ = ["initialize", "PfcEngine"]


def initialize(*, model: nn.Module, config: dict, heads: dict | None = None, model_parameters=None,
               optimizer=None, lr_scheduler=None, mpu=None, **kwargs) -> "PfcEngine":
    """``deepspeed.initialize`` for ``model`` plus the Partial FC heads attached to it
    (and any given in ``heads``: name -> PartialFC, head_spec, or (either, lr_ratio)).

    ``config`` is DeepSpeed's config dict (without the ``ds_pfc`` block). ``mpu``: a
    Megatron-style model-parallel unit (``get_data_parallel_group``,
    ``get_tensor_model_parallel_group``, ...), passed on to DeepSpeed. The process
    groups come from one place: ``mpu`` when given, else the engine's (a pipeline's
    grid; ``deepspeed.utils.groups``, where AutoTP puts its groups). Heads declared with
    :func:`head_spec` are built here from them; every head's groups are then
    compared by membership with the engine's data-parallel
    and tensor-parallel groups, and a mismatch is refused
    naming the head and both rank lists. With a ``PipelineModule`` only last-stage
    ranks hold heads (:meth:`PfcEngine.train_batch`); their tensor-parallel group is the
    pipeline grid's tensor-slicing group. Sequence parallelism is refused. Build heads
    outside ``deepspeed.zero.Init`` (a head built inside it is refused).
    Returns a :class:`PfcEngine`."""
    import deepspeed

    if not isinstance(config, dict):
        raise TypeError(f"config must be DeepSpeed's config dict, got {type(config).__name__}")
    if "ds_pfc" in config:
        raise ValueError("config still holds the 'ds_pfc' block; pass the DeepSpeed part "
                         "(ds_pfc.config.split_config returns both)")
    found = _checked_heads(model, heads)
    found = _last_stage_heads(model, found)
    if model_parameters is None:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    if mpu is not None:
        kwargs["mpu"] = mpu
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model_parameters,
                                           optimizer=optimizer, lr_scheduler=lr_scheduler, **kwargs)
    _check_engine(engine, found)
    layout = _EngineGroups.of(engine, mpu)
    for name, entry in found.items():
        if isinstance(entry.head, HeadSpec):
            entry.head = layout.build(entry.head)
            if entry.owner is not None:
                object.__setattr__(entry.owner, entry.attr, entry.head)
        layout.check(name, entry.head)
    return PfcEngine(engine, found)


class PfcEngine:
    """A DeepSpeed engine plus the Partial FC heads it must not touch.

    Calls, ``backward`` and attribute reads go to the engine; :meth:`step` also steps
    the heads at the optimizer boundary; :meth:`save_checkpoint` /
    :meth:`load_checkpoint` keep the engine, the heads' per-rank shards and each
    rank's own state (data position, RNG) in one tag directory, completed by a
    marker file only once every rank has written everything."""

    def __init__(self, engine, heads: dict[str, _Attached]):
        self.engine = engine
        self.heads = {name: a.head for name, a in heads.items()}
        self.lr_ratios = {name: a.lr_ratio for name, a in heads.items()}
        self.last_lr: float | None = None
        self.skipped_steps = 0
        # Loss scaling: whether DeepSpeed's backward multiplies the loss by the scale
        # (None until a backward with a scale != 1 has shown it), and the scale and
        # gradient accumulation divisor of the backward in flight.
        self._ds_scales_loss: bool | None = None
        self._scaling = _uses_loss_scaling(engine)
        # Inside engine(...) / engine.backward / train_batch: where the heads' forward
        # runs and which backward produces their gradients (see _center_grad_hook).
        self._forward_depth = 0
        self._backward_depth = 0
        for head in self.heads.values():
            head.guard_nonfinite = self._scaling
            head.center_grad_hook = self._center_grad_hook

    def __getattr__(self, name):
        # Only reached for names PfcEngine itself lacks: the engine answers them.
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)

    # -- training -------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        self._refuse_on_pipeline("engine(...)")
        self._forward_depth += 1
        try:
            return self.engine(*args, **kwargs)
        finally:
            self._forward_depth -= 1

    forward = __call__

    def _center_grad_hook(self):
        """Called by each head's training forward: a hook for its centers' gradient,
        or None.

        ``engine.backward(loss)`` divides the loss by the gradient accumulation steps
        (GAS). ``loss.backward()`` and ``engine.scale(loss).backward()`` (ZeRO 1-3)
        leave the loss alone: DeepSpeed divides the gradient of the engine's outputs
        instead. A head called inside the module's forward is upstream of those
        outputs and gets the division with the backbone; a head applied to the
        engine's outputs (``head(engine(x), y)``) is not, so its centers' gradient is
        divided here, when it did not come through :meth:`backward`."""
        if self._forward_depth:
            return None

        def hook(grad):
            if self._backward_depth:
                return grad
            return grad / self.engine.gradient_accumulation_steps()
        return hook

    def train(self, mode: bool = True) -> "PfcEngine":
        """Training mode for the engine's module and every head."""
        self.engine.train(mode)
        for head in self.heads.values():
            head.train(mode)
        return self

    def eval(self) -> "PfcEngine":
        return self.train(False)

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the engine runs the module in (inputs should match)."""
        if self.engine.fp16_enabled():
            return torch.float16
        if self.engine.bfloat16_enabled():
            return torch.bfloat16
        return torch.float32

    def backward(self, loss: torch.Tensor, **kwargs):
        """``engine.backward(loss)``, making sure the gradient carries the loss scale
        the optimizer will divide by (see the module docstring)."""
        self._refuse_on_pipeline("engine.backward")
        self._backward_depth += 1
        try:
            if not self._scaling:
                return self.engine.backward(loss, **kwargs)
            gas = self.engine.gradient_accumulation_steps() if kwargs.get("scale_wrt_gas", True) else 1
            return self.engine.backward(_LossScaleProbe.apply(loss, self, loss_scale(self.engine), float(gas)),
                                        **kwargs)
        finally:
            self._backward_depth -= 1

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``engine.scale(loss)``, for ``engine.scale(loss).backward()`` (DeepSpeed's
        ZeRO 1-3; at ZeRO 0 DeepSpeed accepts only ``engine.backward``): the loss
        times the loss scale, through the same check as :meth:`backward` that the
        gradient carries the scale the optimizer divides by. The heads' share of the
        gradient accumulation division is applied to their gradients."""
        self._refuse_on_pipeline("engine.scale")
        if self._scaling:
            loss = _LossScaleProbe.apply(loss, self, loss_scale(self.engine), 1.0)
        return self.engine.scale(loss)

    def get_lr(self) -> float:
        """The learning rate of the next optimizer step that the heads follow (times
        their ratios): the engine's first parameter group's, or, where the engine's
        scheduler scales the backbone's apart (it has a ``head_lr()`` method, e.g.
        :class:`ds_pfc.app.finetune.BackboneScaledLR`), the unscaled one it reports."""
        head_lr = getattr(getattr(self.engine, "lr_scheduler", None), "head_lr", None)
        if callable(head_lr):
            return float(head_lr())
        return float(self.engine.get_lr()[0])

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next :meth:`step` is an optimizer step (every ``step()`` is one
        without managed gradient accumulation)."""
        managed = internal(self.engine, "managed_gradient_accumulation", owner="engine",
                           why="to know whether every step() is an optimizer boundary for the heads")
        if not managed():
            return True
        return bool(self.engine.is_gradient_accumulation_boundary())

    def step(self) -> bool:
        """``engine.step()``; at the optimizer boundary also step every head with the
        learning rate the engine applied (times its ratio), unscaling loss-scaled
        gradients, or drop the heads' gradients when the step is skipped. Returns True
        when an optimizer step was applied."""
        self._refuse_on_pipeline("engine.step")
        boundary = self.is_gradient_accumulation_boundary()
        heads_finite = True
        if boundary:
            lr, scale = self.get_lr(), loss_scale(self.engine)
            if self._scaling and self.heads:
                heads_finite = head_grads_finite(self)
        scaler = _grad_scaler(self.engine) if boundary else None
        self.engine.step()
        if not boundary:
            return False
        applied = bool(self.engine.was_step_applied())
        if scaler is not None:
            if scaler.get_scale() < scale:
                applied = False      # the GradScaler skipped the optimizer (the engine may not say so)
            elif not applied:
                # ZeRO 1-3 skip an overflowing step before their GradScaler sees the
                # overflow, so its scale would never come down and every later step
                # would overflow too: lower it as the GradScaler would have.
                scaler.update(new_scale=scale * scaler.get_backoff_factor())
        return self._step_heads(applied, heads_finite, lr, scale)

    def _step_heads(self, applied: bool, heads_finite: bool, lr: float, scale: float) -> bool:
        """After the engine's optimizer step: step the heads with ``lr`` (times each
        ratio), unscaling by ``scale``, or drop their gradients when the step was
        skipped. A head overflow on a step the engine applied (the backbone's gradient
        was finite: the head's embedding gradient did not reach it) skips the heads
        alone and lowers the loss scale. Returns whether the heads stepped."""
        if applied and not heads_finite:
            _lower_loss_scale(self.engine)
            warnings.warn(f"step {self.global_steps}: a head gradient overflowed at loss scale {scale:g}; the heads "
                          "skipped this step", RuntimeWarning, stacklevel=3)
        if not applied or not heads_finite:
            self.skipped_steps += 1
            for head in self.heads.values():
                head.zero_grad()
            return False
        self.last_lr = lr
        for name, head in self.heads.items():
            head.step(lr * self.lr_ratios[name], grad_scale=scale)
        return True

    # -- pipeline parallelism -------------------------------------------------------
    def _is_pipeline(self) -> bool:
        from deepspeed.runtime.pipe.engine import PipelineEngine
        return isinstance(self.engine, PipelineEngine)

    def _refuse_on_pipeline(self, what: str) -> None:
        if self._is_pipeline():
            raise RuntimeError(f"{what} is not available on a DeepSpeed pipeline (PipelineModule): its optimizer step "
                               "is one engine.train_batch(data_iter) call, which also steps the heads")

    def train_batch(self, data_iter=None):
        """One optimizer step of a DeepSpeed pipeline (``PipelineEngine.train_batch``:
        ``gradient_accumulation_steps`` micro batches through every stage), then the
        heads' step on the last stage with the learning rate the engine applied (times
        each head's ratio); a skipped step drops the heads' gradients. Every rank of
        the pipeline calls it. Returns DeepSpeed's loss (the mean over the micro
        batches and the data-parallel ranks).

        The last stage back-propagates each micro batch's ``loss_fn`` value divided by
        the number of micro batches (``DeepSpeedEngine.backward``), so the heads'
        gradients, like the backbone's, are the mean over the micro batches. Under fp16
        loss scaling the loss leaves ``loss_fn`` through the probe :meth:`backward`
        uses, which supplies the scale where DeepSpeed's optimizer divides by one it
        never multiplied in; the gradients sent to the earlier stages carry it too."""
        if not self._is_pipeline():
            raise RuntimeError("train_batch needs a DeepSpeed pipeline (a PipelineModule model); this engine trains "
                               "with engine(...), engine.backward(loss), engine.step()")
        engine = self.engine
        if _grad_scaler(engine) is not None:
            # torch's GradScaler takes no part in collectives: each stage would decide
            # alone to skip a step and lower its scale, and the stages would diverge.
            raise ValueError("float16 torch_autocast is not supported with pipeline parallelism: every stage's "
                             "GradScaler decides on overflow alone, so stages would skip different steps; use "
                             "\"fp16\" (DeepSpeed's loss scaler checks overflow over the whole pipeline) or bf16")
        if self._scaling and engine.module.loss_fn is None:
            raise ValueError("fp16 loss scaling on a pipeline needs the loss computed by PipelineModule(loss_fn=...) "
                             "(the heads' loss scale is checked where loss_fn's value enters backward)")
        lr, scale = self.get_lr(), loss_scale(engine)
        for head in self.heads.values():
            head.train()            # DeepSpeed puts the module in training mode for train_batch
        self._backward_depth += 1           # the last stage back-propagates through engine.backward
        try:
            with probed_loss_fn(self, scale):
                loss = engine.train_batch(data_iter)
        finally:
            self._backward_depth -= 1
        applied = bool(engine.was_step_applied())
        heads_finite = head_grads_finite_on_every_stage(self) if self._scaling else True
        self._step_heads(applied, heads_finite, lr, scale)
        return loss

    def eval_batch(self, data_iter, **kwargs):
        """``PipelineEngine.eval_batch`` with the heads in evaluation mode, as DeepSpeed
        leaves the module; :meth:`train_batch` puts both back in training mode."""
        if not self._is_pipeline():
            raise RuntimeError("eval_batch needs a DeepSpeed pipeline (a PipelineModule model)")
        for head in self.heads.values():
            head.eval()
        return self.engine.eval_batch(data_iter, **kwargs)

    def broadcast_buffers(self) -> None:
        """Give every data-parallel rank the module buffers of the group's first rank
        (BatchNorm running statistics). DeepSpeed never synchronises buffers, so each
        rank's statistics follow its own micro batches; an export holds rank 0's. The
        app calls this before evaluating and saving, so that every rank evaluates, and
        every checkpoint holds, the model the export will be (DDP, and so
        arcface_torch, broadcast them at every forward)."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return
        group = internal(self.engine, "data_parallel_group", owner="engine",
                         why="to broadcast the module's buffers over the data-parallel group")
        if torch.distributed.get_world_size(group) == 1:
            return
        source = torch.distributed.get_global_rank(group, 0) if group is not None else 0
        for buffer in self.engine.module.buffers():
            if buffer.is_floating_point() or buffer.dtype in (torch.int64, torch.int32):
                torch.distributed.broadcast(buffer.data, source, group=group)

    @property
    def global_steps(self) -> int:
        return int(self.engine.global_steps)

    # -- checkpoints ----------------------------------------------------------------
    @property
    def rank(self) -> int:
        return int(self.engine.global_rank)

    @property
    def world_size(self) -> int:
        return int(self.engine.world_size)

    def save_checkpoint(self, save_dir: str, tag: str, *, client_state: dict | None = None,
                        rank_state: dict | None = None, metadata: dict | None = None, replace: bool = False) -> str:
        """Write checkpoint ``tag`` under ``save_dir`` on every rank (a collective).

        Layout of ``save_dir/tag``: DeepSpeed's files (module, optimizer, scheduler,
        ``client_state``), ``<head>-rankXXXXX-of-XXXXX.safetensors`` per head and
        rank, ``rank_state-XXXXX-of-XXXXX.pt`` (``rank_state`` plus this rank's RNG
        states) and ``ds_pfc_complete.json`` (steps, world size, heads, the size of
        every DeepSpeed file, and ``metadata``, JSON).

        Every rank writes into a fresh staging directory ``<tag>.tmp-<hex>`` and
        fsyncs each file it wrote there (DeepSpeed's too, once DeepSpeed's
        checkpoint writer has committed them); after all ranks are done, rank 0
        writes the marker, renames the directory to ``tag``, fsyncs ``save_dir``,
        points ``save_dir/latest`` at the tag and deletes what interrupted saves left
        (:mod:`ds_pfc.checkpoint.tags`). A crash or power loss at any point leaves
        the previous complete checkpoints untouched and the new tag either absent or
        complete; files of another save never mix into it. A complete ``tag`` is
        replaced only with ``replace`` (FileExistsError otherwise). An error on any
        rank raises on every rank."""
        return checkpointing.save(self, save_dir, tag, client_state=client_state, rank_state=rank_state,
                                  metadata=metadata, replace=replace)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, *, restore_rng: bool = True) -> dict | None:
        """Load checkpoint ``tag`` on every rank (a collective). Without ``tag``: the
        one ``load_dir/latest`` names, or the newest complete tag when ``latest`` is
        missing or lags behind it (:func:`ds_pfc.checkpoint.tags.choose_tag`).

        Rank 0 first checks that every file of the tag is there with the size its save
        wrote and a readable structure (headers only); then the ranks check the files'
        contents against their checksums, each its share
        (:func:`~ds_pfc.checkpoint.tags.verify_share`: the ``torch.save`` files and
        the shards read in slices; a shard read whole is checked by its reader), and
        agree on the outcome before anything is loaded. A missing, truncated or
        corrupt file, a ``latest`` that names no complete tag or an unreadable marker
        raises the same :class:`~ds_pfc.checkpoint.tags.CheckpointError` on every
        rank, naming the file and the newest intact tag to load instead.

        Returns ``{"tag", "client_state", "rank_state", "world_size", "metadata",
        "note"}`` (``note``: why the tag is not the one ``latest`` names, or None) or
        None when there is no checkpoint. ``rank_state`` is this rank's own when the
        world size is unchanged, else rank 0's (sampler positions are global); RNG
        states are restored only at the same world size. Heads saved at another world
        size are resharded as they load: each rank reads only the rows of its own
        classes, from the one or few shards that hold them (safetensors slices), so
        its memory is about that of its own shard, never the whole head."""
        return checkpointing.load(self, load_dir, tag, restore_rng=restore_rng)
