"""The backbones insightface's arcface_torch trains, tensor for tensor, and activation
checkpointing of backbone blocks.

- Layout: every backbone's state dict (parameters and BatchNorm buffers, in order) has
  the shapes arcface_torch's network of that name has, listed here independently from
  its published architecture numbers (``get_model``: IResNet blocks per stage, the
  MobileFaceNet block counts and scale, the ViT width / depth / patch 9 / MLP ratio 4,
  no qkv bias, a mask token, a Linear-BN-Linear-BN head). Built on the meta device: no
  memory, no compute.
- ``style="arcface"`` ViT (vit_b, vit_l): the forward pass against a plain PyTorch
  float64 transcription of arcface_torch's computation (ReLU6 MLP, explicit softmax
  attention, head BatchNorms with eps 2e-5, mask tokens inserted after the final
  LayerNorm with its per-sample shuffle), in eval and in masked training.
- ``checkpoint_blocks``: float64 training steps with and without it give identical
  outputs, gradients and BatchNorm running statistics (updated once per step), and the
  blocks really run twice.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_pfc.app.config import BackboneConfig, ConfigError
from ds_pfc.models import ALIASES, build_backbone

# --- arcface_torch's layouts, from the architecture numbers ---------------------------

BN = "bn"  # weight, bias, running_mean, running_var, num_batches_tracked
# A BatchNorm whose weight (gamma) arcface_torch never trains. Only its IResNets have one:
# backbones/iresnet.py ends __init__ with ``self.features.weight.requires_grad = False``;
# its mobilefacenet.py (GDC's BatchNorm1d) and vit.py (``feature``'s last BatchNorm1d)
# leave every parameter trainable.
BN_FIXED_SCALE = "bn, weight frozen"
UNUSED = "unused"  # a parameter arcface_torch creates but its forward never reads


def _expand(entries):
    """-> [(shape, is_parameter, trained)] in state-dict order."""
    shapes = []
    for entry in entries:
        if isinstance(entry, tuple) and entry and entry[0] in (BN, BN_FIXED_SCALE):
            c = entry[1]
            shapes += [((c,), True, entry[0] == BN), ((c,), True, True), ((c,), False, False),
                       ((c,), False, False), ((), False, False)]
        elif isinstance(entry, tuple) and entry and entry[0] == UNUSED:
            shapes.append((tuple(entry[1]), True, False))
        else:
            shapes.append((tuple(entry), True, True))
    return shapes


def iresnet_layout(layers, emb=512):
    e = [(64, 3, 3, 3), (BN, 64), (64,)]                     # conv1, bn1, prelu
    inplanes = 64
    for planes, n in zip((64, 128, 256, 512), layers):
        for i in range(n):
            e += [(BN, inplanes), (planes, inplanes, 3, 3), (BN, planes), (planes,),
                  (planes, planes, 3, 3), (BN, planes)]
            if i == 0:                                          # stride 2: 1x1 downsample
                e += [(planes, inplanes, 1, 1), (BN, planes)]
            inplanes = planes
    e += [(BN, 512), (emb, 512 * 7 * 7), (emb,), (BN_FIXED_SCALE, emb)]    # bn2, fc, features
    return _expand(e)


def mbf_layout(blocks, scale, emb=512):
    def conv_block(cin, cout, k, groups=1, act=True):
        out = [(cout, cin // groups, k, k), (BN, cout)]
        return out + [(cout,)] if act else out

    def depthwise(cin, cout, groups):
        return conv_block(cin, groups, 1) + conv_block(groups, groups, 3, groups) + conv_block(groups, cout, 1, act=False)

    c64, c128 = 64 * scale, 128 * scale
    e = conv_block(3, c64, 3)
    if blocks[0] == 1:
        e += conv_block(c64, c64, 3, groups=64)
    else:
        e += [t for _ in range(blocks[0]) for t in depthwise(c64, c64, 128)]
    e += depthwise(c64, c64, 128) + [t for _ in range(blocks[1]) for t in depthwise(c64, c64, 128)]
    e += depthwise(c64, c128, 256) + [t for _ in range(blocks[2]) for t in depthwise(c128, c128, 256)]
    e += depthwise(c128, c128, 512) + [t for _ in range(blocks[3]) for t in depthwise(c128, c128, 256)]
    e += conv_block(c128, 512, 1)                               # conv_sep
    e += conv_block(512, 512, 7, groups=512, act=False)         # GDC
    e += [(emb, 512), (BN, emb)]
    return _expand(e)


def vit_layout(dim, depth, emb=512, mask_token=True, masking=True):
    """``mask_token``: the tensor exists (arcface_torch always creates it); ``masking``:
    training masks tokens (mask_ratio > 0), the only use of the mask token."""
    tokens = (112 // 9) ** 2
    e = [(1, tokens, dim)]                                          # pos_embed
    if mask_token:
        e.append((1, 1, dim) if masking else (UNUSED, (1, 1, dim)))
    e += [(dim, 3, 9, 9), (dim,)]                                   # patch embedding
    for _ in range(depth):
        e += [(dim,), (dim,), (dim,), (dim,),                       # norm1, norm2
              (3 * dim, dim), (dim, dim), (dim,),                   # qkv (no bias), proj
              (4 * dim, dim), (4 * dim,), (dim, 4 * dim), (dim,)]   # mlp
    e += [(dim,), (dim,), (dim, tokens * dim), (BN, dim), (emb, dim), (BN, emb)]
    return _expand(e)


LAYOUTS = {
    "r18": lambda: iresnet_layout((2, 2, 2, 2)),
    "r34": lambda: iresnet_layout((3, 4, 6, 3)),
    "r50": lambda: iresnet_layout((3, 4, 14, 3)),
    "r100": lambda: iresnet_layout((3, 13, 30, 3)),
    "r200": lambda: iresnet_layout((6, 26, 60, 6)),
    "mbf": lambda: mbf_layout((1, 4, 6, 2), 2),
    "mbf_large": lambda: mbf_layout((2, 8, 12, 4), 4),
    "vit_t": lambda: vit_layout(256, 12),
    "vit_s": lambda: vit_layout(512, 12),
    "vit_b": lambda: vit_layout(512, 24),
    "vit_l": lambda: vit_layout(768, 24),
}
# vit_t and vit_s train without masking unless asked; arcface_torch's have a mask token.
MASKED = {"vit_t": {"mask_ratio": 0.1}, "vit_s": {"mask_ratio": 0.1}}


def meta(name, **kwargs):
    with torch.device("meta"):
        return build_backbone(name, **kwargs)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_state_dict_shapes_in_order_match_the_arcface_torch_network(name):
    model = meta(name, **MASKED.get(name, {}))
    shapes = [tuple(t.shape) for t in model.state_dict().values()]
    expected = LAYOUTS[name]()
    assert len(shapes) == len(expected)
    assert shapes == [shape for shape, _, _ in expected]
    assert sum(p.numel() for p in model.parameters()) == sum(
        torch.Size(shape).numel() for shape, is_parameter, _ in expected if is_parameter)


# Every network name of arcface_torch's get_model that ds-pfc-migrate converts -> its
# layout in arcface_torch (the WebFace42M ViT variants differ only in drop path and mask
# ratio; with mask ratio 0 the mask token exists but never trains).
ARCFACE_NETWORKS = {
    "r18": LAYOUTS["r18"], "r34": LAYOUTS["r34"], "r50": LAYOUTS["r50"], "r100": LAYOUTS["r100"],
    "r200": LAYOUTS["r200"], "mbf": LAYOUTS["mbf"], "mbf_large": LAYOUTS["mbf_large"],
    "vit_t": LAYOUTS["vit_t"], "vit_t_dp005_mask0": lambda: vit_layout(256, 12, masking=False),
    "vit_s": LAYOUTS["vit_s"], "vit_s_dp005_mask_0": lambda: vit_layout(512, 12, masking=False),
    "vit_b": LAYOUTS["vit_b"], "vit_b_dp005_mask_005": LAYOUTS["vit_b"],
    "vit_l_dp005_mask_005": LAYOUTS["vit_l"],
}


def test_the_converter_accepts_exactly_the_networks_checked_here():
    from ds_pfc.app import migrate
    accepted = {name for name in migrate._NETWORKS if migrate._network(name)[0] is not None}
    assert accepted == set(ARCFACE_NETWORKS)


@pytest.mark.parametrize("network", sorted(ARCFACE_NETWORKS))
def test_trained_tensors_are_those_arcface_torch_trains(network):
    """The backbone a converted config builds trains the tensors arcface_torch's network
    of that name trains, in order (the embedding BatchNorm's scale: frozen in the
    IResNets only), and no other."""
    from ds_pfc.app import migrate
    name, options, _ = migrate._network(network)
    with torch.device("meta"):
        model = BackboneConfig(name=name, options=options).build(512)
    trained = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
    expected = [shape for shape, is_parameter, train in ARCFACE_NETWORKS[network]() if is_parameter and train]
    assert trained == expected
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen == (["features.weight"] if name.startswith("r") else [])


def test_trained_tensor_counts():
    """The counts of trained tensors in arcface_torch's networks (mbf 183, mbf_large 333,
    vit_t 144 with its mask token, r50 237 of its 238): what the layouts above must give."""
    def count(network):
        return sum(1 for _, is_parameter, train in ARCFACE_NETWORKS[network]() if is_parameter and train)
    assert (count("mbf"), count("mbf_large"), count("vit_t"), count("r50")) == (183, 333, 144, 237)
    assert count("vit_t_dp005_mask0") == 143


@pytest.mark.parametrize("name", ["r18", "mbf", "vit_t"])
def test_train_embedding_scale_overrides_the_family_rule(name):
    for value in (True, False):
        model = meta(name, train_embedding_scale=value)
        assert model.features.weight.requires_grad is value
        assert model.features.bias.requires_grad
    with pytest.raises(ConfigError, match="train_embedding_scale"):
        BackboneConfig(name=name, options={"train_embedding_scale": "yes"}).build(512)


def test_new_names_and_their_defaults():
    assert ALIASES["r200"] == "iresnet200" and ALIASES["mbf_large"] == "mobilefacenet_large"
    for name, rate, ratio in (("vit_b", 0.1, 0.1), ("vit_l", 0.05, 0.05)):
        model = meta(name)
        assert model.style == "arcface" and model.mask_ratio == ratio
        assert model.blocks[-1].drop_path_rate == pytest.approx(rate) and model.blocks[0].drop_path_rate == 0
        assert isinstance(model.blocks[0].mlp[1], nn.ReLU6)
        assert model.head[1].eps == model.features.eps == 2e-5
        # options override the defaults
        plain = meta(name, mask_ratio=0.0, drop_path_rate=0.0, style="default")
        assert plain.mask_token is None and isinstance(plain.blocks[0].mlp[1], nn.GELU)
    assert meta("vit_t").style == "default"


# --- style="arcface" against a transcription of arcface_torch's forward -------------

def arcface_vit_reference(sd, x, *, heads, training, mask_ratio=0.0, seed=0):
    """arcface_torch's ViT forward in plain float64 ops on state dict ``sd`` (no drop path)."""
    B = x.shape[0]
    dim = sd["pos_embed"].shape[-1]
    t = F.conv2d(x, sd["patch_embed.weight"], sd["patch_embed.bias"], stride=9).flatten(2).transpose(1, 2)
    t = t + sd["pos_embed"]
    L = t.shape[1]
    if training and mask_ratio > 0:
        noise = torch.rand(B, L, generator=torch.Generator().manual_seed(seed))
        ids_shuffle = torch.argsort(noise, dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        keep = int(L * (1 - mask_ratio))
        t = torch.gather(t, 1, ids_shuffle[:, :keep, None].repeat(1, 1, dim))
    depth = len({k.split(".")[1] for k in sd if k.startswith("blocks.")})
    for i in range(depth):
        p = lambda n: sd[f"blocks.{i}.{n}"]  # noqa: E731
        h = F.layer_norm(t, (dim,), p("norm1.weight"), p("norm1.bias"), 1e-5)
        n, T = h.shape[:2]
        qkv = (h @ p("attn.qkv.weight").T).reshape(n, T, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = ((q @ k.transpose(-2, -1)) * (dim // heads) ** -0.5).softmax(-1)
        a = (attn @ v).transpose(1, 2).reshape(n, T, dim)
        t = t + a @ p("attn.proj.weight").T + p("attn.proj.bias")
        h = F.layer_norm(t, (dim,), p("norm2.weight"), p("norm2.bias"), 1e-5)
        h = torch.clamp(h @ p("mlp.0.weight").T + p("mlp.0.bias"), 0, 6)
        t = t + h @ p("mlp.2.weight").T + p("mlp.2.bias")
    t = F.layer_norm(t, (dim,), sd["norm.weight"], sd["norm.bias"], 1e-5)
    if training and mask_ratio > 0:
        mask = sd["mask_token"].repeat(B, L - t.shape[1], 1)
        t = torch.gather(torch.cat([t, mask], 1), 1, ids_restore[:, :, None].repeat(1, 1, dim))
    f = t.reshape(B, L * dim) @ sd["head.0.weight"].T

    def bn(z, prefix):
        if training:
            return F.batch_norm(z, None, None, sd[prefix + "weight"], sd[prefix + "bias"], True, 0.0, 2e-5)
        return F.batch_norm(z, sd[prefix + "running_mean"], sd[prefix + "running_var"], sd[prefix + "weight"],
                            sd[prefix + "bias"], False, 0.0, 2e-5)

    f = bn(f, "head.1.")
    return bn(f @ sd["head.2.weight"].T, "features.")


def _randomised(model):
    """Non-trivial BN statistics and affine parameters, so eps and every term matter."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.LayerNorm)):
                m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=g, dtype=m.weight.dtype))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g, dtype=m.bias.dtype))
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=g, dtype=torch.float64))
                m.running_var.copy_(1e-4 + 1e-3 * torch.rand(m.running_var.shape, generator=g, dtype=torch.float64))
    return model


@pytest.mark.parametrize("name", ["vit_b", "vit_l"])
def test_arcface_style_vit_eval_matches_arcface_forward(name):
    torch.manual_seed(0)
    model = _randomised(build_backbone(name, width=0.0625, embedding_size=32).double()).eval()
    x = torch.randn(2, 3, 112, 112, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(x)
        ref = arcface_vit_reference(model.state_dict(), x, heads=8, training=False)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    # The default style is another function of the same weights (GELU, eps 1e-5).
    other = build_backbone(name, width=0.0625, embedding_size=32, style="default").double().eval()
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert (other(x) - ref).abs().max() > 1e-3


def test_arcface_style_vit_masked_training_matches_arcface_forward():
    torch.manual_seed(0)
    model = _randomised(build_backbone("vit_b", width=0.0625, embedding_size=32, drop_path_rate=0.0,
                                       mask_ratio=0.25).double()).train()
    with torch.no_grad():
        model.mask_token.normal_(0, 1.0)
    x = torch.randn(4, 3, 112, 112, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(5)  # the per-sample shuffle draws torch.rand(B, 144) from the global generator
    with torch.no_grad():
        out = model(x)
    ref = arcface_vit_reference(sd, x, heads=8, training=True, mask_ratio=0.25, seed=5)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)


# --- activation checkpointing ---------------------------------------------------------

def _step(model, x, weights, seed):
    torch.manual_seed(seed)
    out = model(x)
    (out * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads, {n: b.clone() for n, b in model.named_buffers()}


def _block_calls(name, model):
    block = {"iresnet18": lambda m: m.stages[0][0], "mobilefacenet": lambda m: m.body[2],
             "vit_t": lambda m: m.blocks[0]}[name](model)
    calls = []
    block.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("name, options", [
    ("iresnet18", {}),
    ("mobilefacenet", {"image_size": 32}),
    ("vit_t", {"drop_path_rate": 0.2, "mask_ratio": 0.25}),
    ("vit_t", {"drop_path_rate": 0.2, "mask_ratio": 0.25, "style": "arcface"}),
])
def test_checkpoint_blocks_gives_the_same_step(name, options):
    width = 0.0625
    size = options.get("image_size", 112)
    torch.manual_seed(0)
    plain = build_backbone(name, width=width, embedding_size=32, dropout=0.3, **options).double().train()
    ckpt = build_backbone(name, width=width, embedding_size=32, dropout=0.3, checkpoint_blocks=True,
                          **options).double().train()
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randn(4, 3, size, size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    weights = torch.randn(4, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    calls = _block_calls(name, ckpt)
    out_a, grads_a, buffers_a = _step(plain, x, weights, seed=3)
    out_b, grads_b, buffers_b = _step(ckpt, x, weights, seed=3)
    assert len(calls) == 2, "the checkpointed block should run in forward and again in backward"

    assert torch.equal(out_a, out_b)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) == sum(p.requires_grad for p in plain.parameters())
    for n in grads_a:
        assert torch.equal(grads_a[n], grads_b[n]), n
    # BatchNorm running statistics updated once per step, as without checkpointing.
    assert buffers_a.keys() == buffers_b.keys()
    for n in buffers_a:
        assert torch.equal(buffers_a[n], buffers_b[n]), n

    # Eval and no-grad forwards do not checkpoint.
    calls.clear()
    with torch.no_grad():
        ckpt.eval()(x)
    assert len(calls) == 1


def test_checkpoint_blocks_option_errors():
    with pytest.raises(ValueError, match="checkpoint_blocks"):
        build_backbone("r18", checkpoint_blocks="yes")
    with pytest.raises(ValueError, match="style"):
        build_backbone("vit_b", style="timm")
    with pytest.raises(TypeError, match="style"):
        build_backbone("r200", style="arcface")


def test_config_accepts_the_new_names_and_the_option():
    for name in ("r200", "iresnet200", "mbf_large", "mobilefacenet_large", "vit_b", "vit_l"):
        BackboneConfig(name=name)
    with pytest.raises(ConfigError, match="vit_l"):
        BackboneConfig(name="vit_h")
    model = BackboneConfig(name="mbf_large", width=0.125, options={"checkpoint_blocks": True}).build(64)
    assert model.checkpoint_blocks is True
    # A bad option value is a configuration error naming it (the app prints "error: ...").
    with pytest.raises(ConfigError, match="ds_pfc.backbone: checkpoint_blocks must be true or false, got 'yes'"):
        BackboneConfig(name="r18", options={"checkpoint_blocks": "yes"}).build(64)
    with pytest.raises(ConfigError, match="ds_pfc.backbone: style"):
        BackboneConfig(name="vit_l", options={"style": "timm"}).build(64)


@pytest.mark.slow
def test_vit_b_full_size_forward():
    torch.manual_seed(0)
    start = time.perf_counter()
    model = build_backbone("vit_b").eval()
    with torch.no_grad():
        out = model(torch.randn(1, 3, 112, 112))
    assert out.shape == (1, 512) and torch.isfinite(out).all()
    assert time.perf_counter() - start < 30
