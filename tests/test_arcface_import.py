"""Import of arcface_torch checkpoints (ds_pfc.app.arcface_import, launch/export.py import-arcface).

The arcface_torch files are made here as its training script writes them: the
backbone is a module of this file with arcface_torch's module names and registration
order (narrower than published, as ds_pfc's ``width`` builds it), saved with
``torch.save(module.state_dict())``; the head files are per-rank dicts with
``state_dict_softmax_fc`` and the SGD optimizer's state, or the older plain tensors,
split over the ranks by arcface_torch's rule written out below.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import safetensors.torch
import torch
from torch import nn

from ds_pfc import PartialFC
from ds_pfc.app.config import ConfigError
from ds_pfc.app import arcface_import as ai
from ds_pfc.checkpoint import shards as ckpt
from ds_pfc.app.export import load_backbone
from ds_pfc.models import build_backbone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPORT = os.path.join(ROOT, "launch", "export.py")


# ------------------------------------------------------- arcface_torch-format modules
class _IBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin, eps=1e-5)
        self.conv1 = nn.Conv2d(cin, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout, eps=1e-5)
        self.prelu = nn.PReLU(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout, eps=1e-5)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout, eps=1e-5))

    def forward(self, x):
        out = self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))
        return out + (x if self.downsample is None else self.downsample(x))


class ArcIResNet(nn.Module):
    """arcface_torch's IResNet layout (conv1, bn1, prelu, layer1..4, bn2, fc, features)."""

    def __init__(self, layers, base=64, num_features=512):
        super().__init__()
        self.conv1 = nn.Conv2d(3, base, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(base, eps=1e-5)
        self.prelu = nn.PReLU(base)
        cin = base
        for i, n in enumerate(layers):
            cout = base * 2 ** i
            blocks = [_IBlock(cin, cout, 2)] + [_IBlock(cout, cout, 1) for _ in range(n - 1)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
            cin = cout
        self.bn2 = nn.BatchNorm2d(cin, eps=1e-5)
        self.dropout = nn.Dropout(0.0)
        self.fc = nn.Linear(cin * 7 * 7, num_features)
        self.features = nn.BatchNorm1d(num_features, eps=1e-5)

    def forward(self, x):
        x = self.prelu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = self.dropout(torch.flatten(self.bn2(x), 1))
        return self.features(self.fc(x))


class _ConvBlock(nn.Module):
    def __init__(self, cin, cout, k=1, s=1, p=0, groups=1, act=True):
        super().__init__()
        mods = [nn.Conv2d(cin, cout, k, s, p, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        self.layers = nn.Sequential(*(mods + [nn.PReLU(cout)] if act else mods))

    def forward(self, x):
        return self.layers(x)


class _DepthWise(nn.Module):
    def __init__(self, cin, cout, residual, stride, groups):
        super().__init__()
        self.residual = residual
        self.layers = nn.Sequential(_ConvBlock(cin, groups), _ConvBlock(groups, groups, 3, stride, 1, groups),
                                    _ConvBlock(groups, cout, act=False))

    def forward(self, x):
        return x + self.layers(x) if self.residual else self.layers(x)


class _Residual(nn.Module):
    def __init__(self, c, n, groups):
        super().__init__()
        self.layers = nn.Sequential(*(_DepthWise(c, c, True, 1, groups) for _ in range(n)))

    def forward(self, x):
        return self.layers(x)


class _Flatten(nn.Module):
    def forward(self, x):
        return x.view(x.size(0), -1)


class ArcMobileFaceNet(nn.Module):
    """arcface_torch's MobileFaceNet layout (layers, conv_sep, features = GDC); ``c`` is
    its (64, 128, 256, 512), here narrowed."""

    def __init__(self, c=(64, 128, 256, 512), blocks=(1, 4, 6, 2), scale=2, num_features=512):
        super().__init__()
        c64, c128, c256, c512 = c
        self.layers = nn.ModuleList([_ConvBlock(3, c64 * scale, 3, 2, 1)])
        if blocks[0] == 1:
            self.layers.append(_ConvBlock(c64 * scale, c64 * scale, 3, 1, 1, groups=c64))
        else:
            self.layers.append(_Residual(c64 * scale, blocks[0], c128))
        self.layers.extend([
            _DepthWise(c64 * scale, c64 * scale, False, 2, c128), _Residual(c64 * scale, blocks[1], c128),
            _DepthWise(c64 * scale, c128 * scale, False, 2, c256), _Residual(c128 * scale, blocks[2], c256),
            _DepthWise(c128 * scale, c128 * scale, False, 2, c512), _Residual(c128 * scale, blocks[3], c256)])
        self.conv_sep = _ConvBlock(c128 * scale, c512)
        self.features = nn.Module()
        self.features.layers = nn.Sequential(_ConvBlock(c512, c512, 7, groups=c512, act=False), _Flatten(),
                                             nn.Linear(c512, num_features, bias=False), nn.BatchNorm1d(num_features))

    def forward(self, x):
        for f in self.layers:
            x = f(x)
        return self.features.layers(self.conv_sep(x))


class _Attn(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(x).reshape(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        attn = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(B, T, D))


class _Mlp(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, 4 * dim), nn.ReLU6(), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class _Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn, self.mlp = _Attn(dim, heads), _Mlp(dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ArcViT(nn.Module):
    """arcface_torch's VisionTransformer layout (patch 9, ReLU6 MLP, head BNs eps 2e-5)."""

    def __init__(self, dim, depth=12, heads=8, num_features=512):
        super().__init__()
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, dim, 9, 9)
        self.pos_embed = nn.Parameter(torch.zeros(1, 144, dim))
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.feature = nn.Sequential(nn.Linear(144 * dim, dim, bias=False), nn.BatchNorm1d(dim, eps=2e-5),
                                     nn.Linear(dim, num_features, bias=False), nn.BatchNorm1d(num_features, eps=2e-5))
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))

    def forward(self, x):
        x = self.patch_embed.proj(x).flatten(2).transpose(1, 2) + self.pos_embed
        for b in self.blocks:
            x = b(x)
        return self.feature(self.norm(x).reshape(x.shape[0], -1))


def _randomize(module, seed):
    """Every parameter and BatchNorm statistic random (variances positive)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in module.state_dict().items():
            if not t.is_floating_point():
                t.fill_(7)
            elif name.endswith("running_var"):
                t.copy_(torch.rand(t.shape, generator=gen) + 0.5)
            else:
                t.copy_(torch.randn(t.shape, generator=gen) * (0.1 if t.dim() > 1 else 0.5))
    return module.eval()


def _save(module, path):
    torch.save(module.state_dict(), path)
    return path


def _images(n=2, seed=0):
    return torch.randn(n, 3, 112, 112, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("network,make,width", [
    ("r18", lambda: ArcIResNet((2, 2, 2, 2), base=16, num_features=24), 0.25),
    ("mbf", lambda: ArcMobileFaceNet(c=(16, 32, 64, 128), num_features=24), 0.25),
])
def test_backbone_outputs_identical(tmp_path, network, make, width):
    ref = _randomize(make(), seed=1)
    path = _save(ref, tmp_path / "model.pt")
    model, block = ai.read_backbone(str(path), network, width=width)
    assert block["name"] == {"r18": "iresnet18", "mbf": "mobilefacenet"}[network]
    x = _images()
    with torch.no_grad():
        want = ref.double()(x)
        got = model.double()(x)
    assert want.shape == (2, 24)
    assert torch.equal(got, want), (got - want).abs().max()


def test_vit_outputs(tmp_path):
    ref = _randomize(ArcViT(32, num_features=16), seed=2)
    path = _save(ref, tmp_path / "model.pt")
    try:
        build_backbone("vit_t", width=0.125, style="arcface")
    except TypeError:
        with pytest.raises(ai.ArcfaceImportError, match="ReLU6"):
            ai.read_backbone(str(path), "vit_t", width=0.125)
        pytest.skip("this ds_pfc's ViT has no arcface_torch style (ReLU6 MLP): the import refuses it (checked)")
    model, block = ai.read_backbone(str(path), "vit_t", width=0.125)
    assert block["options"]["style"] == "arcface"
    x = _images()
    with torch.no_grad():
        want = ref.double()(x)
        got = model.double()(x)
    # ds_pfc's attention is torch's scaled_dot_product_attention, the reference's the
    # explicit softmax(q k^T / sqrt(d)) v: the same math, rounded differently.
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_backbone_export_loads_for_eval(tmp_path):
    ref = _randomize(ArcIResNet((2, 2, 2, 2), base=16, num_features=24), seed=3)
    path = _save(ref, tmp_path / "model.pt")
    out = ai.import_backbone(str(path), "r18", str(tmp_path / "out" / "model.safetensors"), width=0.25)
    backbone, config = load_backbone(out)        # as launch/eval.py --model reads it
    assert config["ds_pfc"]["backbone"]["name"] == "iresnet18"
    x = _images(seed=4).float()
    with torch.no_grad():
        assert torch.equal(backbone(x), ref.float()(x))


def test_backbone_export_with_job_config(tmp_path):
    """A job config given with the import is stored with its backbone block set to the
    imported network (what a fine-tune from the export builds)."""
    ref = _randomize(ArcMobileFaceNet(c=(16, 32, 64, 128), num_features=24), seed=7)
    path = _save(ref, tmp_path / "model.pt")
    job = {"gradient_clipping": 5.0, "train_micro_batch_size_per_gpu": 8,
           "ds_pfc": {"head": {"num_classes": 100, "embedding_size": 24}, "backbone": {"name": "iresnet50"},
                      "evaluation": {"synthetic_pairs": 0}}}
    out = ai.import_backbone(str(path), "mbf", str(tmp_path / "model.safetensors"), config=job, width=0.25)
    backbone, config = load_backbone(out)
    assert config["ds_pfc"]["backbone"] == {"name": "mobilefacenet", "width": 0.25, "options": {}}
    assert config["ds_pfc"]["head"]["num_classes"] == 100 and config["train_micro_batch_size_per_gpu"] == 8
    x = _images(seed=8).float()
    with torch.no_grad():
        assert torch.equal(backbone(x), ref.float()(x))
    job["ds_pfc"]["head"]["embedding_size"] = 512
    with pytest.raises(ai.ArcfaceImportError, match="embedding_size is 512, the imported backbone's is 24"):
        ai.import_backbone(str(path), "mbf", str(tmp_path / "other.safetensors"), config=job, width=0.25)


def test_backbone_errors(tmp_path):
    ref = _randomize(ArcIResNet((2, 2, 2, 2), base=16, num_features=24), seed=5)
    good = _save(ref, tmp_path / "model.pt")
    with pytest.raises(ai.ArcfaceImportError, match="unknown arcface_torch network 'r17'"):
        ai.read_backbone(str(good), "r17")
    with pytest.raises(ai.ArcfaceImportError, match=r"model\.pt: 187 tensors, but arcface_torch's r34 has 331; "
                                                    r"the file matches \['r18'\]"):
        ai.read_backbone(str(good), "r34", width=0.25)
    with pytest.raises(ai.ArcfaceImportError, match=r"first tensor is 'conv1.weight'.*looks like a iresnet"):
        ai.read_backbone(str(good), "mbf", width=0.25)
    # A tensor missing: the count and the first difference, naming both keys.
    state = ref.state_dict()
    del state["layer2.0.bn1.running_mean"]
    torch.save(state, tmp_path / "missing.pt")
    with pytest.raises(ai.ArcfaceImportError, match=r"missing\.pt: .*'layer2.0.bn1.running_var'.*"
                                                    r"'stages.1.0.bn1.running_mean'"):
        ai.read_backbone(str(tmp_path / "missing.pt"), "r18", width=0.25)
    # A shape mismatch names both keys.
    state = ref.state_dict()
    state["fc.weight"] = state["fc.weight"][:, :-1]
    torch.save(state, tmp_path / "shape.pt")
    with pytest.raises(ai.ArcfaceImportError, match=r"shape\.pt: tensor 'fc.weight' \(24, 6271\) does not match "
                                                    r"ds_pfc's 'fc.weight' \(24, 6272\)"):
        ai.read_backbone(str(tmp_path / "shape.pt"), "r18", width=0.25)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ai.ArcfaceImportError, match=r"junk\.pt: cannot read it"):
        ai.read_backbone(str(tmp_path / "junk.pt"), "r18")
    with pytest.raises(FileNotFoundError, match="absent.pt"):
        ai.read_backbone(str(tmp_path / "absent.pt"), "r18")


# ---------------------------------------------------------------------------- head
C, D, W = 11, 6, 3


def _arcface_split(C, W, r):
    """arcface_torch's PartialFC: num_local and class_start of rank r."""
    return C // W * r + min(r, C % W), C // W + int(r < C % W)


class _Margin(nn.Module):          # CombinedMarginLoss holds no tensors
    def forward(self, x):
        return x


class _PFC(nn.Module):
    """The tensors of arcface_torch's PartialFC_V2 on one rank."""

    def __init__(self, num_local, d, gen):
        super().__init__()
        self.margin_softmax = _Margin()
        self.weight = nn.Parameter(torch.randn(num_local, d, generator=gen) * 0.01)


def _write_v2(directory, seed=0, optimizer="sgd", steps=1):
    """``checkpoint_gpu_{r}.pt`` of W ranks after ``steps`` optimizer steps, as
    train_v2.py saves them; returns the concatenated weight and optimizer states."""
    gen = torch.Generator().manual_seed(seed)
    weights, states = [], []
    for r in range(W):
        _, num_local = _arcface_split(C, W, r)
        backbone, pfc = nn.Linear(4, 3), _PFC(num_local, D, gen)
        groups = [{"params": backbone.parameters()}, {"params": pfc.parameters()}]
        opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9, weight_decay=5e-4) if optimizer == "sgd" else \
            torch.optim.AdamW(groups, lr=0.1, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=10)
        for _ in range(steps):
            for p in list(backbone.parameters()) + list(pfc.parameters()):
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
            sched.step()
        torch.save({"epoch": 1, "global_step": 5, "state_dict_backbone": backbone.state_dict(),
                    "state_dict_softmax_fc": pfc.state_dict(), "state_optimizer": opt.state_dict(),
                    "state_lr_scheduler": sched.state_dict()}, os.path.join(directory, f"checkpoint_gpu_{r}.pt"))
        weights.append(pfc.weight.detach().clone())
        states.append({k: v.clone() for k, v in opt.state[pfc.weight].items()})
    if optimizer == "sgd":
        return torch.cat(weights), torch.cat([s["momentum_buffer"] for s in states])
    return torch.cat(weights), {k: torch.cat([s[k] for s in states]) for k in ("exp_avg", "exp_avg_sq")}


def _check_shards(directory, world, weight, momentum):
    for r in range(world):
        start = C // world * r + min(r, C % world)
        stop = start + C // world + int(r < C % world)
        tensors = safetensors.torch.load_file(os.path.join(directory, ckpt.shard_file_name("head", r, world)))
        assert torch.equal(tensors["weight"], weight[start:stop])
        if momentum is None:
            assert "momentum_buffer" not in tensors
        else:
            assert torch.equal(tensors["momentum_buffer"], momentum[start:stop])
    merged, meta = ckpt.merge_shards(directory)          # the checks of a ds_pfc shard set pass
    assert meta["num_classes"] == C and torch.equal(merged["weight"], weight)


def test_head_v2_any_world_size(tmp_path):
    src = tmp_path / "arc"
    src.mkdir()
    weight, momentum = _write_v2(src)
    for world in (2, 4):
        out = tmp_path / f"w{world}"
        paths = ai.import_head(str(src), str(out), world)
        assert len(paths) == world
        _check_shards(out, world, weight, momentum)
    ai.import_head(str(src), str(tmp_path / "plain"), 2, optimizer_states="none")
    _check_shards(tmp_path / "plain", 2, weight, None)
    # A single-process ds_pfc head with SGD momentum loads the shard and holds the rows.
    ai.import_head(str(src), str(tmp_path / "w1"), 1)
    head = PartialFC(C, D, optimizer="sgd", momentum=0.9)
    ckpt.load_head_shard(head, str(tmp_path / "w1"))
    assert torch.equal(head.state_dict()["weight"], weight)
    assert torch.equal(head.state_dict()["momentum_buffer"], momentum)


def test_head_v2_adamw(tmp_path):
    """arcface_torch's ViT recipes train with AdamW: its moments and step go to RowAdamW."""
    src = tmp_path / "arc"
    src.mkdir()
    weight, moments = _write_v2(src, optimizer="adamw", steps=2)
    ai.import_head(str(src), str(tmp_path / "w2"), 2)
    for r, (start, stop) in enumerate(((0, 6), (6, 11))):
        tensors = safetensors.torch.load_file(os.path.join(tmp_path / "w2", ckpt.shard_file_name("head", r, 2)))
        assert sorted(tensors) == ["exp_avg", "exp_avg_sq", "step", "weight"]
        assert torch.equal(tensors["weight"], weight[start:stop])
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(tensors[k], moments[k][start:stop])
        assert torch.equal(tensors["step"], torch.full((stop - start,), 2, dtype=torch.int32))
    ai.import_head(str(src), str(tmp_path / "w1"), 1)
    head = PartialFC(C, D, optimizer="adamw")
    ckpt.load_head_shard(head, str(tmp_path / "w1"))
    assert torch.equal(head.state_dict()["exp_avg_sq"], moments["exp_avg_sq"])


def test_head_v1_files(tmp_path):
    gen = torch.Generator().manual_seed(9)
    weights, moms = [], []
    for r in range(W):
        _, num_local = _arcface_split(C, W, r)
        w, m = torch.randn(num_local, D, generator=gen), torch.randn(num_local, D, generator=gen)
        torch.save(w, tmp_path / f"rank_{r}_softmax_weight.pt")
        torch.save(m, tmp_path / f"rank_{r}_softmax_weight_mom.pt")
        weights.append(w)
        moms.append(m)
    ai.import_head(str(tmp_path), str(tmp_path / "out"), 2)
    _check_shards(tmp_path / "out", 2, torch.cat(weights), torch.cat(moms))
    for r in range(W):                       # weights only: a zero momentum on request
        os.remove(tmp_path / f"rank_{r}_softmax_weight_mom.pt")
    ai.import_head(str(tmp_path), str(tmp_path / "zero"), 4, optimizer_states="zero_momentum")
    _check_shards(tmp_path / "zero", 4, torch.cat(weights), torch.zeros(C, D))


@pytest.mark.parametrize("route", ["zero_adamw", "weights only"])
def test_weights_only_head_starts_adamw_like_a_fresh_torch_adamw(tmp_path, route):
    """A head saved without optimizer states (arcface_torch's legacy weight files) into an
    AdamW job: imported with zero_adamw (zero moments, step 0), or as the centers alone
    and loaded by the training app's init, which starts AdamW at zero. Either way two
    steps at r = 1 follow torch.optim.AdamW started on the same weights, with gradients
    from an independent float64 margin softmax."""
    from _reference import arcface_ref_loss
    from ds_pfc import ArcFace
    from ds_pfc.app.finetune import load_head_weights
    gen = torch.Generator().manual_seed(5)
    weights = []
    for r in range(W):
        _, num_local = _arcface_split(C, W, r)
        weights.append(torch.randn(num_local, D, generator=gen, dtype=torch.float64))
        torch.save(weights[-1], tmp_path / f"rank_{r}_softmax_weight.pt")
    weight = torch.cat(weights)
    out = tmp_path / "out"
    ai.import_head(str(tmp_path), str(out), 1, optimizer_states="zero_adamw" if route == "zero_adamw" else "auto")
    tensors = safetensors.torch.load_file(os.path.join(out, ckpt.shard_file_name("head", 0, 1)))
    if route == "zero_adamw":
        assert sorted(tensors) == ["exp_avg", "exp_avg_sq", "step", "weight"]
        assert not tensors["exp_avg"].any() and not tensors["exp_avg_sq"].any() and not tensors["step"].any()
    else:
        assert sorted(tensors) == ["weight"]
    betas, eps, wd, scale, margin = (0.8, 0.95), 1e-3, 0.05, 16.0, 0.3
    head = PartialFC(C, D, sample_rate=1.0, margin=ArcFace(scale, margin), optimizer="adamw", betas=betas,
                     eps=eps, weight_decay=wd)
    said = load_head_weights(head, str(out))
    assert ("starts at zero" in said) == (route != "zero_adamw")
    assert torch.equal(head.state_dict()["weight"], weight.float())      # the importer writes float32 centers
    ref = torch.nn.Parameter(weight.float().double())
    opt = torch.optim.AdamW([ref], lr=1.0, betas=betas, eps=eps, weight_decay=wd, foreach=False)
    for lr in (0.1, 0.05):
        x = torch.randn(7, D, generator=gen, dtype=torch.float64)
        y = torch.randint(0, C, (7,), generator=gen)
        w = ref.detach().clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(arcface_ref_loss(x, w, y, scale, margin), w)
        head(x.float(), y).backward()
        head.step(lr)
        ref.grad = grad
        opt.param_groups[0]["lr"] = lr
        opt.step()
        state = head.state_dict()
        torch.testing.assert_close(state["weight"].double(), ref.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state["exp_avg_sq"].double(), opt.state[ref]["exp_avg_sq"], rtol=1e-4,
                                   atol=1e-9)
        assert torch.equal(state["step"], torch.full((C,), int(opt.state[ref]["step"]), dtype=state["step"].dtype))


def test_centers_alone_into_another_optimizer(tmp_path):
    """init.optimizer_states false loads SGD-momentum shards into an AdamW head (states at
    zero); with the default, a head of another optimizer than the shards' is refused,
    naming the way to load the centers alone."""
    from ds_pfc.app.finetune import load_head_weights
    src = tmp_path / "arc"
    src.mkdir()
    weight, _ = _write_v2(src)
    ai.import_head(str(src), str(tmp_path / "w1"), 1)
    head = PartialFC(C, D, optimizer="adamw")
    before = head.state_dict()
    with pytest.raises(ConfigError, match="optimizer_states='zero'"):
        load_head_weights(head, str(tmp_path / "w1"))
    assert all(torch.equal(before[k], v) for k, v in head.state_dict().items() if k in before)
    assert load_head_weights(head, str(tmp_path / "w1"), optimizer_states=False).endswith("zeroed")
    state = head.state_dict()
    assert torch.equal(state["weight"], weight) and not state["exp_avg"].any() and not state["step"].any()


def test_head_errors(tmp_path):
    src = tmp_path / "arc"
    src.mkdir()
    _write_v2(src)
    with pytest.raises(ai.ArcfaceImportError, match=r"checkpoint_gpu_2\.pt: 3 classes, .* = 4 of C=12"):
        ai.read_head(str(src), num_classes=12)
    os.rename(src / "checkpoint_gpu_1.pt", tmp_path / "moved.pt")
    with pytest.raises(ai.ArcfaceImportError, match=r"missing checkpoint_gpu_1\.pt"):
        ai.read_head(str(src))
    # Rows not split as arcface_torch splits them (rank 0 short of one class).
    torch.save(torch.load(tmp_path / "moved.pt", weights_only=True), src / "checkpoint_gpu_1.pt")
    blob = torch.load(src / "checkpoint_gpu_0.pt", weights_only=True)
    blob["state_dict_softmax_fc"]["weight"] = blob["state_dict_softmax_fc"]["weight"][:-1]
    (pid,) = blob["state_optimizer"]["param_groups"][-1]["params"]
    state = blob["state_optimizer"]["state"][pid]
    state["momentum_buffer"] = state["momentum_buffer"][:-1]
    torch.save(blob, src / "checkpoint_gpu_0.pt")
    with pytest.raises(ai.ArcfaceImportError, match=r"checkpoint_gpu_0\.pt: 3 classes, but arcface_torch's rank 0 "
                                                    r"of 3 holds .* = 4 of C=10"):
        ai.read_head(str(src), num_classes=10)
    state["momentum_buffer"] = state["momentum_buffer"][:-1]       # not the weight's shape
    torch.save(blob, src / "checkpoint_gpu_0.pt")
    with pytest.raises(ai.ArcfaceImportError, match=r"checkpoint_gpu_0\.pt: the head weight's momentum_buffer is "
                                                    r"\(2, 6\), expected the weight's shape \(3, 6\)"):
        ai.read_head(str(src))
    blob["state_optimizer"]["state"] = {}                          # rank 0 without momentum, the others with
    torch.save(blob, src / "checkpoint_gpu_0.pt")
    with pytest.raises(ai.ArcfaceImportError, match=r"checkpoint_gpu_1\.pt: holds \['momentum_buffer', 'weight'\], "
                                                    r"rank 0's file \['weight'\]"):
        ai.read_head(str(src))
    torch.save({"weight": torch.zeros(2, 2)}, src / "checkpoint_gpu_0.pt")
    with pytest.raises(ai.ArcfaceImportError, match=r"checkpoint_gpu_0\.pt: expected arcface_torch's checkpoint dict "
                                                    "with 'state_dict_softmax_fc'"):
        ai.read_head(str(src))
    with pytest.raises(FileNotFoundError, match="holds no arcface_torch head files"):
        ai.read_head(str(tmp_path / "arc" / ".."))


def _cli(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, EXPORT, "import-arcface", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


def test_cli(tmp_path):
    """A backbone and a head imported together; the export holds the merged head."""
    ref = _randomize(ArcIResNet((2, 2, 2, 2), base=64, num_features=D), seed=6)
    _save(ref, tmp_path / "model.pt")
    weight, momentum = _write_v2(tmp_path)
    job = {"gradient_clipping": 5.0, "ds_pfc": {"head": {"num_classes": C, "embedding_size": D,
                                                         "sample_rate": 0.5}}}
    (tmp_path / "job.json").write_text(json.dumps(job))
    res = _cli("--network", "r18", "--backbone", str(tmp_path / "model.pt"), "--head", str(tmp_path),
               "--world_size", "2", "--config", str(tmp_path / "job.json"), "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    printed = res.stdout.split()
    assert printed[0].endswith("model.safetensors") and len(printed) == 3
    tensors = safetensors.torch.load_file(printed[0])
    assert torch.equal(tensors["heads.head.weight"], weight)
    metadata = safetensors.safe_open(printed[0], "pt").metadata()
    assert json.loads(metadata["heads"]) == ["head"]
    config = json.loads(metadata["config"])["ds_pfc"]
    assert config["head"]["sample_rate"] == 0.5 and config["backbone"]["name"] == "iresnet18"
    _check_shards(tmp_path / "out", 2, weight, momentum)


@pytest.mark.parametrize("args,message", [
    (["--network", "r17", "--backbone", "{tmp}/model.pt"], "error: unknown arcface_torch network 'r17'"),
    (["--network", "r18", "--backbone", "{tmp}/model.pt"], "error: {tmp}/model.pt: tensor 'conv1.weight' (16, 3, 3, 3) "
                                                          "does not match ds_pfc's 'stem.0.weight' (64, 3, 3, 3)"),
    (["--head", "{tmp}", "--world_size", "2"], "error: {tmp}: missing checkpoint_gpu_1.pt"),
])
def test_cli_errors(tmp_path, args, message):
    _save(ArcIResNet((2, 2, 2, 2), base=16, num_features=24), tmp_path / "model.pt")
    torch.save({"state_dict_softmax_fc": {"weight": torch.zeros(2, 3)}}, tmp_path / "checkpoint_gpu_2.pt")
    torch.save({"state_dict_softmax_fc": {"weight": torch.zeros(2, 3)}}, tmp_path / "checkpoint_gpu_0.pt")
    res = _cli(*[a.format(tmp=tmp_path) for a in args], "--out", str(tmp_path / "out"))
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message.format(tmp=tmp_path)), res.stderr
