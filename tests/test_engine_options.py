"""Engine options around the heads: each one works or is refused at initialize.

- ``gradient_allreduce_op: "sum"`` would scale the backbone W-fold against the heads:
  refused.
- ``managed_gradient_accumulation: false``: every ``step()`` is a boundary for the
  heads as for DeepSpeed (reference: the same steps with managed accumulation).
- ``PfcEngine`` answers every engine attribute and sets the heads' mode with the module's.
"""
from __future__ import annotations

import os

import pytest
import torch

from _dist import free_port, run_ranks

pytest.importorskip("deepspeed")

D_IN, D, C, N = 16, 8, 10, 4


def _init(port):
    import deepspeed
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deepspeed.init_distributed(dist_backend="gloo")


def test_sum_allreduce_is_refused():
    run_ranks(_sum_allreduce, 1, free_port())


def _sum_allreduce(rank, world_size, port):
    from ds_pfc import PartialFC
    from ds_pfc.deepspeed_plugin import initialize
    _init(port)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 9, "gradient_allreduce_op": "sum",
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with pytest.raises(ValueError, match="gradient_allreduce_op"):
        initialize(model=torch.nn.Linear(D_IN, D), config=config,
                   heads={"identity": PartialFC(C, D, sample_rate=1.0, device="cpu")})
    # node-local checkpoint storage: the marker and the reshard need one shared directory
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 9,
              "checkpoint": {"use_node_local_storage": True}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with pytest.raises(ValueError, match="use_node_local_storage"):
        initialize(model=torch.nn.Linear(D_IN, D), config=config,
                   heads={"identity": PartialFC(C, D, sample_rate=1.0, device="cpu")})


def _run_steps(managed: bool, steps: int = 3):
    from ds_pfc import PartialFC
    from ds_pfc.deepspeed_plugin import initialize
    torch.manual_seed(0)
    model = torch.nn.Linear(D_IN, D)
    head = PartialFC(C, D, sample_rate=1.0, optimizer="sgd", momentum=0.9, weight_decay=0.0, device="cpu")
    config = {"train_micro_batch_size_per_gpu": N, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "steps_per_print": 10 ** 9, "optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}}}
    if not managed:
        config["managed_gradient_accumulation"] = False
    engine = initialize(model=model, config=config, heads={"identity": head})
    g = torch.Generator().manual_seed(3)
    applied = []
    for _ in range(steps):
        x, y = torch.randn(N, D_IN, generator=g), torch.randint(0, C, (N,), generator=g)
        engine.backward(head(engine(x), y))
        applied.append(engine.step())
    return {"applied": applied, "step_count": head.step_count, "pending": len(head._pending),
            "centers": head.centers(), "weight": engine.module.weight.detach().clone()}


def _options(rank, world_size, port):
    _init(port)
    managed, unmanaged = _run_steps(True), _run_steps(False)

    from ds_pfc import PartialFC
    from ds_pfc.deepspeed_plugin import initialize
    head = PartialFC(C, D, sample_rate=1.0, device="cpu")
    engine = initialize(model=torch.nn.Linear(D_IN, D), heads={"identity": head},
                        config={"train_micro_batch_size_per_gpu": N, "gradient_accumulation_steps": 3,
                                "gradient_clipping": 0.0, "steps_per_print": 10 ** 9,
                                "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    passthrough = {"gas": engine.gradient_accumulation_steps(), "optimizer": type(engine.optimizer).__name__,
                   "micro": engine.train_micro_batch_size_per_gpu(),
                   "applied": engine.was_step_applied()}     # no step yet
    engine.eval()
    modes = [engine.module.training, head.training]
    engine.train()
    modes += [engine.module.training, head.training]
    return {"managed": managed, "unmanaged": unmanaged, "passthrough": passthrough, "modes": modes}


@pytest.fixture(scope="module")
def options():
    return run_ranks(_options, 1, free_port())[0]


def test_unmanaged_accumulation_steps_the_heads_at_every_step(options):
    managed, unmanaged = options["managed"], options["unmanaged"]
    assert unmanaged["applied"] == [True] * 3 and unmanaged["step_count"] == 3 and unmanaged["pending"] == 0
    assert torch.equal(unmanaged["centers"], managed["centers"])
    assert torch.equal(unmanaged["weight"], managed["weight"])


def test_engine_attributes_and_modes_pass_through(options):
    assert options["passthrough"] == {"gas": 3, "optimizer": "SGD", "micro": N, "applied": False}
    assert options["modes"] == [False, False, True, True]
