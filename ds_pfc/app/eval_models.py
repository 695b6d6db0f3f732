"""Backbones of other origins for the evaluation protocols.

:func:`load_model` gives a callable ``torch.nn.Module`` for

- a ds_pfc model export (``.safetensors``), a model folder of ``ds-pfc-export
  backbone``/``hub`` (also one downloaded from the Hugging Face Hub) or a checkpoint
  directory (:func:`ds_pfc.app.export.load_backbone`);
- arcface_torch's ``model.pt`` (or a ``checkpoint_gpu_*.pt``) with its network name,
  rebuilt in memory as the ds_pfc backbone by :func:`ds_pfc.app.arcface_import.read_backbone`;
- an ONNX file (``.onnx``) run by onnxruntime (:class:`OnnxBackbone`; ``pip install
  ds_pfc[eval]``).

All of them take images normalised as in training, ``(x / 255 - 0.5) / 0.5`` RGB
``[B, 3, H, W]`` float32, and return unnormalised embeddings ``[B, d]``; the protocols
(:func:`ds_pfc.eval.embed`, :func:`ds_pfc.eval.ijb.embed_images`) call them the same
way, flip-summed features included.
"""
from __future__ import annotations

import os

import torch

__all__ = ["OnnxBackbone", "load_model", "model_kind"]

_ONNX_DTYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64"}


class OnnxBackbone(torch.nn.Module):
    """An ONNX recognition model as a module: ``forward(images [B, 3, H, W]) ->
    float32 [B, d]`` through an onnxruntime session (on the CPU unless
    ``device`` is CUDA and onnxruntime has its CUDA provider). A model with a static
    batch size runs in chunks of that size, the last one padded; inputs are cast to
    the model's input type (float32 or float16)."""

    def __init__(self, path: str, *, device: str | torch.device = "cpu"):
        super().__init__()
        try:
            import onnxruntime as ort
        except ImportError:
            raise RuntimeError("evaluating an ONNX model needs onnxruntime: pip install onnxruntime "
                               "(or ds_pfc[eval])") from None
        if not os.path.isfile(path):
            raise FileNotFoundError(f"ONNX model not found: {path}")
        providers = ["CPUExecutionProvider"]
        if torch.device(device).type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
            providers.insert(0, "CUDAExecutionProvider")
        options = ort.SessionOptions()
        options.log_severity_level = 3
        try:
            self.session = ort.InferenceSession(path, options, providers=providers)
        except Exception as err:     # onnxruntime raises its own exception types
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise ValueError(f"{path} is not an ONNX model onnxruntime can load ({type(err).__name__}: "
                             f"{first})") from None
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        if len(inputs) != 1 or len(inputs[0].shape) != 4:
            raise ValueError(f"{path}: expected one input of shape [B, 3, H, W], got "
                             f"{[(i.name, i.shape) for i in inputs]}")
        if inputs[0].type not in _ONNX_DTYPES:
            raise ValueError(f"{path}: input {inputs[0].name!r} is {inputs[0].type}, expected a float tensor")
        self.path, self.input_name, self.output_name = path, inputs[0].name, outputs[0].name
        self.input_shape = list(inputs[0].shape)
        self.input_dtype = _ONNX_DTYPES[inputs[0].type]
        batch = self.input_shape[0]
        self.static_batch = batch if isinstance(batch, int) and batch > 0 else None

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        import numpy as np
        array = x.detach().cpu().numpy().astype(np.dtype(self.input_dtype), copy=False)
        try:
            out = self.session.run([self.output_name], {self.input_name: array})[0]
        except Exception as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise ValueError(f"{self.path}: onnxruntime failed on input of shape {tuple(x.shape)} (the model "
                             f"expects {self.input_shape}): {first}") from None
        return torch.from_numpy(np.ascontiguousarray(out)).float().reshape(x.shape[0], -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.static_batch
        if n is None:
            return self._run(x).to(x.device)
        out = []
        for start in range(0, x.shape[0], n):
            chunk = x[start:start + n]
            if chunk.shape[0] < n:
                pad = chunk.new_zeros((n - chunk.shape[0],) + tuple(chunk.shape[1:]))
                out.append(self._run(torch.cat([chunk, pad]))[:chunk.shape[0]])
            else:
                out.append(self._run(chunk))
        return torch.cat(out).to(x.device)


def model_kind(path: str) -> str:
    """``"onnx"``, ``"arcface_torch"`` (``.pt`` / ``.pth``) or ``"ds_pfc"`` (anything
    else: an export or a checkpoint directory), from the name."""
    lower = str(path).lower()
    if lower.endswith(".onnx"):
        return "onnx"
    if lower.endswith((".pt", ".pth")):
        return "arcface_torch"
    return "ds_pfc"


def load_model(path: str, *, network: str | None = None, width: float = 1.0, tag: str | None = None,
               device: str | torch.device = "cpu") -> tuple[torch.nn.Module, dict | None, str]:
    """``(model, config, kind)`` for ``path`` (see the module docstring); ``config``
    is the ds_pfc job config of a ds_pfc model, else None. ``network`` (and ``width``
    for narrower networks) names arcface_torch's network of a ``.pt``; it is required
    there and refused elsewhere. Raises ``ValueError`` / ``FileNotFoundError`` naming
    the argument."""
    kind = model_kind(path)
    if kind != "arcface_torch" and (network is not None or width != 1.0):
        raise ValueError(f"--network / --width are for arcface_torch .pt state dicts; {path} is a {kind} model")
    if kind == "onnx":
        return OnnxBackbone(path, device=device), None, kind
    if kind == "arcface_torch":
        from .arcface_import import NETWORKS, read_backbone
        if network is None:
            raise ValueError(f"{path} is an arcface_torch state dict: pass --network, its arcface_torch network "
                             f"name (one of {sorted(NETWORKS)})")
        model, _ = read_backbone(path, network, width=width)
        return model, None, kind
    from .export import load_backbone
    model, config = load_backbone(path, tag)
    return model, config, kind
