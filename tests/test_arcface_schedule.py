"""The learning rate of a converted arcface_torch job at every optimizer step.

Reference: arcface_torch's ``PolynomialLRWarmup`` (recognition/arcface_torch/lr_scheduler.py)
written out here as a torch LR scheduler from its rule, and stepped as its
``train_v2.py`` steps it: ``scheduler.step()`` after every micro batch, the optimizer
stepping at every ``gradient_acc``-th one. Its ``get_lr``: at ``last_epoch == 0`` (and
past ``total_iters``) the group's current lr unchanged; up to ``warmup_iters``
``base_lr * last_epoch / warmup_iters``; after it the current lr times
``((1 - (l - w) / (t - w)) / (1 - (l - 1 - w) / (t - w))) ** power`` (a chained ratio).
``warmup_iters`` and ``total_iters`` are ``num_image // (batch_size * world_size)`` times
``warmup_epoch`` and ``num_epoch``.

The job runs in this process (one rank) with a hook on the backbone optimizer's step and
on the head's step, so what is compared is the learning rate each really used.
"""
from __future__ import annotations

import copy

import pytest
import torch

from _dist import one_process_world

pytest.importorskip("deepspeed")

from ds_pfc.app.config import ConfigError, split_config  # noqa: E402
from ds_pfc.app.training import schedule_factor  # noqa: E402

C, D, MICRO, LR = 24, 16, 8, 0.1
CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 5.0,
    "steps_per_print": 10 ** 9,
    "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9, "weight_decay": 5e-4}},
    "ds_pfc": {
        "head": {"num_classes": C, "embedding_size": D, "sample_rate": 1.0, "seed": 5,
                 "margin": {"type": "arcface", "scale": 16.0, "margin": 0.3, "straight_through": True}},
        "backbone": {"name": "mbf", "width": 0.125, "options": {"image_size": 16}},
        "data": {"synthetic": {"images_per_identity": 5, "image_size": 16, "held_out_identities": 4},
                 "workers": 0},
        "train": {"epochs": 2, "log_every": 100},
        "evaluation": {"synthetic_pairs": 0},
        "checkpoint": {"every_steps": 0, "keep": 0, "export": False},
    },
}
IMAGES = C * 5


class PolynomialLRWarmupReference(torch.optim.lr_scheduler.LRScheduler):
    """arcface_torch's schedule, from its rule (see the module docstring)."""

    def __init__(self, optimizer, warmup_iters, total_iters, power=1.0):
        self.warmup_iters, self.total_iters, self.power = warmup_iters, total_iters, power
        super().__init__(optimizer)

    def get_lr(self):
        step, w, t = self.last_epoch, self.warmup_iters, self.total_iters
        if step == 0 or step > t:
            return [group["lr"] for group in self.optimizer.param_groups]
        if step <= w:
            return [base * step / w for base in self.base_lrs]
        ratio = ((1.0 - (step - w) / (t - w)) / (1.0 - (step - 1 - w) / (t - w))) ** self.power
        return [group["lr"] * ratio for group in self.optimizer.param_groups]


def train_v2_learning_rates(*, num_image, world_size, batch_size, gradient_acc, warmup_epoch, num_epoch,
                            optimizer_steps, power=1.0):
    """The lr of each optimizer step as train_v2.py's loop applies it."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    per_epoch = num_image // (batch_size * world_size)
    scheduler = PolynomialLRWarmupReference(opt, per_epoch * warmup_epoch, per_epoch * num_epoch, power)
    lrs, micro = [], 0
    while len(lrs) < optimizer_steps:
        micro += 1
        if micro % gradient_acc == 0:
            lrs.append(opt.param_groups[0]["lr"])
        scheduler.step()
    return lrs


@pytest.fixture(scope="module", autouse=True)
def single_process_group():
    with one_process_world():
        yield


def _job(*, gas, warmup_epochs, images_per_epoch, max_steps, power=1.0):
    config = copy.deepcopy(CONFIG)
    config["gradient_accumulation_steps"] = gas
    schedule = {"type": "arcface", "warmup_epochs": warmup_epochs, "power": power}
    if images_per_epoch is not None:
        schedule["images_per_epoch"] = images_per_epoch
    config["ds_pfc"]["train"].update(schedule=schedule, max_steps=max_steps)
    return config


def _used_learning_rates(tmp_path, config):
    """(backbone lr, head lr) of every optimizer step of the job."""
    import warnings
    from ds_pfc.app.training import Trainer
    trainer = Trainer(config, output_dir=str(tmp_path / "run"), log=lambda line: None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.setup()
    backbone, head = [], []
    optimizer = trainer.engine.engine.optimizer
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: backbone.append(opt.param_groups[0]["lr"]))
    step = trainer.head.step

    def recording_step(lr, *args, **kwargs):
        head.append(lr)
        return step(lr, *args, **kwargs)
    trainer.head.step = recording_step
    try:
        trainer.run()
    finally:
        trainer.close()
    return backbone, head


# (gradient accumulation, warm-up epochs, the schedule's epoch size, optimizer steps run)
CASES = {
    "warm-up, then past the end": (1, 0.6, 40, 12),       # w = 3, t = 10 micro batches
    "accumulation across the warm-up": (3, 1.0, None, 10),  # the data's 120 images: w = 15, t = 30
    "no warm-up, accumulation 2": (2, 0.0, None, 8),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_optimizer_step_uses_train_v2s_learning_rate(tmp_path, case):
    gas, warmup, images, steps = CASES[case]
    backbone, head = _used_learning_rates(tmp_path, _job(gas=gas, warmup_epochs=warmup, images_per_epoch=images,
                                                         max_steps=steps))
    expected = train_v2_learning_rates(num_image=images or IMAGES, world_size=1, batch_size=MICRO,
                                       gradient_acc=gas, warmup_epoch=warmup, num_epoch=2, optimizer_steps=steps)
    assert len(backbone) == len(head) == steps
    assert backbone == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert head == pytest.approx(expected, rel=1e-12, abs=1e-15)
    if gas == 1:
        assert backbone[0] == LR                       # the first micro batch runs at the full lr
    if case.startswith("warm-up"):
        assert backbone[1] == pytest.approx(LR / 3) and backbone[-1] == 0.0


def test_power_and_the_closed_form_over_a_long_run():
    """Power 2 over 1,000 optimizer steps of 4 micro batches, warm-up and end included,
    against the chained reference (no run: the factor the job's scheduler uses)."""
    from ds_pfc.app.config import ScheduleConfig
    schedule = ScheduleConfig(type="arcface", warmup_epochs=0.5, power=2.0)
    per_epoch, epochs, acc = 700, 5, 4
    factor = schedule_factor(schedule, 0, 0, micro_batches_per_epoch=per_epoch, accumulation=acc, epochs=epochs)
    expected = train_v2_learning_rates(num_image=per_epoch * MICRO, world_size=1, batch_size=MICRO,
                                       gradient_acc=acc, warmup_epoch=0.5, num_epoch=epochs,
                                       optimizer_steps=1000, power=2.0)
    assert [LR * factor(k) for k in range(1000)] == pytest.approx(expected, rel=1e-9, abs=1e-15)


def test_ds_pfc_recipes_keep_their_own_warm_up():
    """The poly schedule of ds_pfc's own configs still starts at 1/w of the lr."""
    from ds_pfc.app.config import ScheduleConfig
    factor = schedule_factor(ScheduleConfig(type="poly", warmup_epochs=1.0, power=2.0), 10, 100)
    assert factor(0) == pytest.approx(0.1) and factor(9) == pytest.approx(1.0)


def test_images_per_epoch_belongs_to_the_arcface_schedule():
    config = copy.deepcopy(CONFIG)
    config["ds_pfc"]["train"]["schedule"] = {"type": "poly", "images_per_epoch": 100}
    with pytest.raises(ConfigError, match="images_per_epoch applies to type arcface"):
        split_config(config)
    config["ds_pfc"]["train"]["schedule"] = {"type": "arcface", "images_per_epoch": 0}
    with pytest.raises(ConfigError, match="images_per_epoch must be a positive integer"):
        split_config(config)


# --- gradient compression -----------------------------------------------------------------
def _gradient_ranks(rank, world_size, keys):
    """One backward of a small model through ds_pfc's engine with the DeepSpeed ``keys``:
    the engine's all-reduced gradients, and this rank's own gradients from a plain copy."""
    import os
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from ds_pfc.deepspeed_plugin import initialize
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ["DS_PFC_TEST_PORT"])
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    plain = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(11 + rank)
    x = torch.randn(5, 16, generator=gen) * torch.logspace(-4, 1, 16)      # gradients over many magnitudes
    target = torch.randn(5, 8, generator=gen)
    config = {"train_micro_batch_size_per_gpu": 5, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "steps_per_print": 10 ** 9, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **keys}
    engine = initialize(model=model, config=config)
    engine.backward(((engine(x) - target) ** 2).mean())
    averaged = [p.grad.detach().clone() for p in engine.module.parameters()]
    ((plain(x) - target) ** 2).mean().backward()
    return averaged, [p.grad.detach().clone() for p in plain.parameters()]


def test_converted_jobs_compress_gradients_as_fp16_compress_hook():
    """communication_data_type fp16 with prescale_gradients (what ds-pfc-migrate writes):
    every rank's gradient rounded to float16, divided by the world size, summed in
    float16 and widened back, as DDP's fp16_compress_hook does in train_v2.py; without
    the keys, the float32 mean."""
    from _dist import run_ranks
    compressed = run_ranks(_gradient_ranks, 2, {"communication_data_type": "fp16", "prescale_gradients": True})
    plain = run_ranks(_gradient_ranks, 2, {})
    local = [grads for _, grads in compressed]
    assert all(torch.equal(a, b) for a, b in zip(local[0], plain[0][1]))     # the same local gradients
    differs = False
    for i, (g0, g1) in enumerate(zip(*local)):
        hook = ((g0.half() / 2) + (g1.half() / 2)).float()
        for averaged, _ in compressed:
            assert torch.equal(averaged[i], hook), i
        for averaged, _ in plain:
            torch.testing.assert_close(averaged[i], (g0 + g1) / 2, rtol=1e-6, atol=0)
        differs |= not torch.equal(hook, (g0 + g1) / 2)
    assert differs
