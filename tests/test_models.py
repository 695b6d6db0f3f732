"""Backbones (``ds_pfc.models``): shapes, gradients, eval determinism, argument errors,
and the architecture against published compute and parameter counts.

Small models (``width=0.125``) run on CPU for behaviour. The full-size models are
built on the meta device, which allocates and computes nothing, and measured with
``count_macs``: multiply-accumulates and parameter counts pin the architecture (depth,
widths, strides, kernel sizes, expansions) without a real forward pass.

References:
- insightface's README "GFLOPs" (multiply-accumulates, ptflops' convention):
  r18 2.6, r50 6.3, r100 12.1, mbf 0.45, vit_t 1.5, vit_s 5.7; and its WebFace42M
  table: r200 23.5, vit_b 11.4, vit_l 25.3;
- ArcFace's IResNet-50 at 512-d: 43.6M parameters; IResNet-18: 24.0M;
- MobileFaceNet paper (Chen et al. 2018, Table 2): 0.99M parameters and 221M MAdds
  for the original network (``scale=1``, 128-d embedding).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_pfc.models import ALIASES, BACKBONES, MobileFaceNet, build_backbone, count_flops, count_macs

SMALL = 0.125
PUBLISHED_GMACS = {"iresnet18": 2.6, "iresnet50": 6.3, "iresnet100": 12.1, "mobilefacenet": 0.45,
                   "vit_t": 1.5, "vit_s": 5.7, "iresnet200": 23.5, "vit_b": 11.4, "vit_l": 25.3}
PUBLISHED_MPARAMS = {"iresnet18": 24.0, "iresnet50": 43.6}
# The only parameter that does not train: the final BN1d's scale, fixed at 1.
# The embedding BatchNorm's scale: frozen in the IResNets (as arcface_torch's), trained
# in the MobileFaceNets and ViTs (as arcface_torch's).
def frozen_of(name):
    return {"features.weight"} if name.startswith("iresnet") else set()


def images(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 3, 112, 112, generator=torch.Generator().manual_seed(seed))


def small(name: str, seed: int = 0, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    return build_backbone(name, width=SMALL, **kwargs)


def meta(name: str, **kwargs) -> nn.Module:
    with torch.device("meta"):
        return build_backbone(name, **kwargs)


def calibrated(model: nn.Module) -> nn.Module:
    """Eval mode with BN running statistics set from one training batch (fresh ones
    are mean 0 / variance 1, and the untrained IResNet's activations grow to ~1e8)."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()
            m.momentum = None  # cumulative average: one batch sets the statistics exactly
    with torch.no_grad():
        model.train()(images(4, seed=123))
    return model.eval()


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --- behaviour, small width -----------------------------------------------------------

@pytest.mark.parametrize("name", BACKBONES)
def test_train_step_shapes_and_gradient_reaches_every_trainable_parameter(name):
    model = small(name).train()
    out = model(images(4))
    assert out.shape == (4, 512) and out.dtype == torch.float32
    # A plain out.sum() has (near) zero gradient: the final BN1d centres every
    # feature over the batch, so a fixed random weighting of the outputs is used.
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * weights).sum().backward()

    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == frozen_of(name)
    assert torch.equal(model.features.weight, torch.ones(512))
    for n, p in model.named_parameters():
        if n in frozen:
            assert p.grad is None, n
            continue
        assert p.grad is not None, f"{n} has no gradient"
        assert torch.isfinite(p.grad).all(), f"{n} has a non-finite gradient"
        assert p.grad.abs().max() > 0, f"{n} has an all-zero gradient"


@pytest.mark.parametrize("name", BACKBONES)
def test_eval_is_deterministic_and_per_sample(name):
    model = calibrated(small(name, dropout=0.5))
    x = images(3)
    with torch.no_grad():
        first, second = model(x), model(x)
        alone = model(x[1:2])
    assert first.shape == (3, 512)
    assert torch.equal(first, second)
    # Eval BN uses running statistics: a sample's embedding does not depend on its batch.
    torch.testing.assert_close(alone, first[1:2], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("alias", sorted(ALIASES))
def test_aliases_build_the_same_architecture(alias):
    a, b = meta(alias), meta(ALIASES[alias])
    assert type(a) is type(b)
    assert [(n, p.shape) for n, p in a.named_parameters()] == [(n, p.shape) for n, p in b.named_parameters()]


@pytest.mark.parametrize("name", ["iresnet18", "mobilefacenet", "vit_t"])
def test_embedding_size(name):
    model = small(name, embedding_size=96).eval()
    with torch.no_grad():
        assert model(images(2)).shape == (2, 96)


def test_vit_training_options_only_act_in_training():
    masked = small("vit_t", drop_path_rate=0.1, mask_ratio=0.25).train()
    out = masked(images(4))
    assert out.shape == (4, 512)
    (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
    assert masked.mask_token.grad is not None and masked.mask_token.grad.abs().max() > 0

    # In eval, neither masking nor stochastic depth acts: same weights, same output as
    # the plain model.
    plain = small("vit_t").eval()
    state = {k: v for k, v in masked.state_dict().items() if k != "mask_token"}
    plain.load_state_dict(state)
    masked.eval()
    with torch.no_grad():
        torch.testing.assert_close(masked(images(2)), plain(images(2)), rtol=0, atol=0)


# --- errors -----------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(2, 3, 224, 224), (2, 3, 112, 96), (2, 1, 112, 112), (3, 112, 112),
                                   (2, 112, 112, 3)])
@pytest.mark.parametrize("name", ["iresnet18", "mobilefacenet", "vit_t"])
def test_wrong_input_shape_names_the_expected_shape(name, shape):
    model = small(name)
    with pytest.raises(ValueError, match=r"\[B, 3, 112, 112\]"):
        model(torch.zeros(shape))


def test_integer_images_rejected():
    with pytest.raises(TypeError, match="floating-point"):
        small("mobilefacenet")(torch.zeros(2, 3, 112, 112, dtype=torch.uint8))


def test_unknown_name_lists_the_valid_names():
    with pytest.raises(ValueError, match="iresnet50.*mobilefacenet.*vit_s") as info:
        build_backbone("resnet50")
    assert "'resnet50'" in str(info.value)
    with pytest.raises(TypeError, match="name"):
        build_backbone(50)


@pytest.mark.parametrize("arg, value", [
    ("width", 0), ("width", -0.5), ("width", float("nan")), ("width", float("inf")), ("width", "1"),
    ("width", True),
    ("embedding_size", 0), ("embedding_size", 1.5), ("embedding_size", True), ("embedding_size", "512"),
    ("dropout", 1.0), ("dropout", -0.1), ("dropout", None),
])
@pytest.mark.parametrize("name", ["iresnet18", "mobilefacenet", "vit_t"])
def test_bad_arguments_name_the_argument(name, arg, value):
    with pytest.raises(ValueError, match=arg):
        build_backbone(name, **{arg: value})


@pytest.mark.parametrize("arg, value", [("drop_path_rate", 1.0), ("mask_ratio", -0.1), ("mask_ratio", 1.0)])
def test_bad_vit_options_name_the_option(arg, value):
    with pytest.raises(ValueError, match=arg):
        build_backbone("vit_t", **{arg: value})


def test_unknown_option_rejected():
    with pytest.raises(TypeError, match="mask_ratio"):
        build_backbone("iresnet50", mask_ratio=0.1)


# --- architecture against published numbers (full size, meta device) ----------------

@pytest.mark.parametrize("name", sorted(PUBLISHED_GMACS))
def test_published_compute(name):
    gmacs = count_macs(meta(name)) / 1e9
    # Ours counts conv/matmul/attention only; ptflops also counts BN and PReLU
    # (about +3% for MobileFaceNet, under 1% for the others).
    assert gmacs == pytest.approx(PUBLISHED_GMACS[name], rel=0.05), gmacs


@pytest.mark.parametrize("name", sorted(PUBLISHED_MPARAMS))
def test_published_parameter_count(name):
    assert num_params(meta(name)) / 1e6 == pytest.approx(PUBLISHED_MPARAMS[name], rel=0.01)


def test_mobilefacenet_paper_network():
    with torch.device("meta"):
        model = MobileFaceNet((1, 4, 6, 2), scale=1, embedding_size=128)
    assert count_macs(model) / 1e6 == pytest.approx(221, rel=0.01)
    assert num_params(model) / 1e6 == pytest.approx(0.99, rel=0.02)


def test_count_macs_on_a_real_model_matches_meta_and_restores_mode():
    # Real CPU tensors would take the fused attention kernel, which has no flop formula.
    model = small("vit_t").train()
    with torch.device("meta"):
        reference = build_backbone("vit_t", width=SMALL)
    assert count_macs(model) == count_macs(reference) > 0
    assert count_flops(model) == 2 * count_macs(model)
    assert model.training
