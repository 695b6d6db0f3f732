"""The public API, written out: the names of ``ds_pfc`` and ``ds_pfc.deepspeed_plugin`` and
the signatures of the entry points. A rename, a removed name or a reordered or retyped
parameter fails here; a deliberate change updates this file (and the CHANGELOG)."""
from __future__ import annotations

import inspect
import os

import ds_pfc
from ds_pfc import deepspeed_plugin

ROOT_ALL = [
    "PartialFC", "margin_cross_entropy", "ArcFace", "CosFace", "CombinedMargin", "Margin", "AdaFace", "MagFace",
    "CurricularFace", "ElasticArcFace", "ElasticCosFace",
    "ClassBank", "DeviceBank", "TieredBank", "Placement", "StaleRowError", "RowSGD", "RowAdamW", "Partition",
]
PLUGIN_ALL = [
    "attach", "attached_heads", "head_spec", "HeadSpec", "init_distributed", "initialize", "PfcEngine",
    "loss_scale", "DeepSpeedInternalsError", "COMPLETE_MARKER", "CheckpointError", "CheckpointIncompleteError",
    "list_checkpoints", "remove_checkpoint",
]

SIGNATURES = {
    "PartialFC": (
        "(num_classes: 'int', embedding_size: 'int', *, sample_rate: 'float' = 1.0, margin: 'Margin | None' = None, "
        "filter_threshold: 'float | None' = None, group=None, batch_group=None, device=None, seed: 'int' = 0, "
        "optimizer: 'str | RowOptimizer' = 'sgd', compute_dtype: 'torch.dtype | None' = None, "
        "init_std: 'float' = 0.01, dtype: 'torch.dtype' = torch.float32, data_parallel_grad: 'bool' = True, "
        "bank: 'Callable[[int, torch.device], ClassBank] | None' = None, block_bytes: 'int | None' = None, "
        "backend: 'str' = 'auto', validate: 'bool | str' = True, sub_centers: 'int' = 1, keep_bytes: 'int | None' = None, **optimizer_kwargs)"),
    "margin_cross_entropy": (
        "(embeddings: 'torch.Tensor', labels: 'torch.Tensor', centers: 'torch.Tensor', *, margin: 'Margin', "
        "filter_threshold: 'float | None' = None, group=None, batch_group=None, class_start: 'int' = 0, "
        "compute_dtype: 'torch.dtype | None' = None, return_details: 'bool' = False, "
        "block_bytes: 'int | None' = None, backend: 'str' = 'auto', validate: 'bool' = True, "
        "update_state: 'bool | None' = None, sub_centers: 'int' = 1, keep_bytes: 'int | None' = None)"),
    "initialize": (
        "(*, model: 'nn.Module', config: 'dict', heads: 'dict | None' = None, model_parameters=None, "
        "optimizer=None, lr_scheduler=None, mpu=None, **kwargs) -> \"'PfcEngine'\""),
    "attach": (
        "(module: 'nn.Module', name: 'str', head: 'PartialFC | HeadSpec', *, lr_ratio: 'float' = 1.0) "
        "-> 'PartialFC | HeadSpec'"),
    "head_spec": "(num_classes: 'int', embedding_size: 'int', *, shard: 'str' = 'model', **kwargs) -> 'HeadSpec'",
    # environ's default is os.environ itself; it is written as ENVIRON below
    "init_distributed": "(dist_backend: 'str | None' = None, environ=ENVIRON, **kwargs) -> 'None'",
}


class _Environ:
    def __repr__(self):
        return "ENVIRON"


def _signature(obj) -> str:
    sig = inspect.signature(obj)
    params = [p.replace(default=_Environ()) if p.default is os.environ else p for p in sig.parameters.values()]
    return str(sig.replace(parameters=params))


def test_root_names():
    assert list(ds_pfc.__all__) == ROOT_ALL
    for name in ROOT_ALL:
        assert getattr(ds_pfc, name) is not None, name


def test_plugin_names():
    assert list(deepspeed_plugin.__all__) == PLUGIN_ALL
    for name in PLUGIN_ALL:
        assert hasattr(deepspeed_plugin, name), name


def test_signatures():
    objects = {"PartialFC": ds_pfc.PartialFC, "margin_cross_entropy": ds_pfc.margin_cross_entropy,
               "initialize": deepspeed_plugin.initialize, "attach": deepspeed_plugin.attach,
               "head_spec": deepspeed_plugin.head_spec, "init_distributed": deepspeed_plugin.init_distributed}
    assert inspect.signature(deepspeed_plugin.init_distributed).parameters["environ"].default is os.environ
    for name, obj in objects.items():
        assert _signature(obj) == SIGNATURES[name], name


def test_version():
    parts = ds_pfc.__version__.split(".")
    assert len(parts) == 3 and all(p.isdigit() for p in parts), ds_pfc.__version__
