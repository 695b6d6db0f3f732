"""IJB-B / IJB-C template verification (``ds_pfc.eval.ijb``) and ``launch/eval.py --ijb``.

References here share no code with the module:
- alignment: similarities built from an angle, a scale and a shift and recovered from
  exact point sets; reference matrices of ``skimage.transform.SimilarityTransform``
  and reference outputs of ``cv2.warpAffine`` (OpenCV 4.10), stored as literals;
- pooling: a plain-Python loop over templates and media (insightface's recipe);
- ROC: small cases worked out by hand, and sklearn ``roc_curve`` output stored as
  literals; TAR at FAR by insightface's nearest-point rule, by hand;
- synthetic landmarks: the darkest blob (the pupil) found in renders at 448 pixels;
- the CLI: its JSON against :func:`evaluate` on features computed here, and a model
  trained through the app against an untrained one of the same architecture.

The training app and ``launch/eval.py`` run through their commands' entries in this
process (``ds_pfc.cli.train.run`` in a one-process world, ``ds_pfc.cli.eval.main``): a
fresh interpreter for each would spend seconds importing torch, DeepSpeed and
torch._dynamo again.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import shutil

import numpy as np
import pytest
import torch

from ds_pfc.data import SyntheticFaces
from ds_pfc.data.transforms import decode_image
from ds_pfc.eval import ijb
from _inprocess import call_main, one_thread as single_thread, train_here
from make_synthetic_ijb import make_synthetic_ijb

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def one_thread():
    with single_thread():
        yield


def similarity(angle_deg: float, scale: float, tx: float, ty: float) -> torch.Tensor:
    a = math.radians(angle_deg)
    return torch.tensor([[scale * math.cos(a), -scale * math.sin(a), tx],
                         [scale * math.sin(a), scale * math.cos(a), ty], [0.0, 0.0, 1.0]], dtype=torch.float64)


def apply(T: torch.Tensor, pts: torch.Tensor) -> torch.Tensor:
    return pts @ T[:2, :2].T + T[:2, 2]


# -- similarity transform -------------------------------------------------------------
@pytest.mark.parametrize("angle, scale, tx, ty", [(0.0, 1.0, 0.0, 0.0), (17.0, 0.73, -12.5, 40.25),
                                                  (-163.0, 2.4, 101.0, -7.0), (90.0, 0.05, 3.0, 3.0)])
def test_similarity_transform_recovers_a_known_similarity(angle, scale, tx, ty):
    src = torch.tensor([[3.0, 7.0], [40.0, 2.0], [22.0, 30.0], [9.0, 51.0], [37.0, 49.0]], dtype=torch.float64)
    T = similarity(angle, scale, tx, ty)
    est = ijb.similarity_transform(src, apply(T, src))
    torch.testing.assert_close(est, T, rtol=0, atol=1e-11)
    # numpy input, and the inverse direction
    est_inv = ijb.similarity_transform(apply(T, src).numpy(), src.numpy())
    torch.testing.assert_close(est_inv @ T, torch.eye(3, dtype=torch.float64), rtol=0, atol=1e-11)


def test_similarity_transform_matches_skimage_reference_values():
    lmk = [[101.5, 120.25], [150.0, 112.0], [128.0, 150.5], [108.0, 180.0], [146.0, 176.0]]
    dst = torch.tensor(ijb.ARCFACE_TEMPLATE, dtype=torch.float64)
    # skimage.transform.SimilarityTransform().estimate(lmk, dst).params (float64 input)
    ref = [[0.6792383842402021, -0.040213630703241215, -24.091779346829725],
           [0.040213630703241215, 0.6792383842402023, -33.55175828159054], [0.0, 0.0, 1.0]]
    torch.testing.assert_close(ijb.similarity_transform(lmk, dst), torch.tensor(ref, dtype=torch.float64),
                               rtol=0, atol=1e-12)
    # a mirrored face: the best orthogonal map is a reflection; a rotation is fitted instead
    mirrored = torch.stack([-dst[:, 0], dst[:, 1]], 1)
    ref = [[0.22530217460689397, 0.0025334541616451717, 68.46681835255725],
           [-0.002533454161645172, 0.22530217460689403, 55.55943820185513], [0.0, 0.0, 1.0]]
    est = ijb.similarity_transform(mirrored, dst)
    torch.testing.assert_close(est, torch.tensor(ref, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.linalg.det(est[:2, :2]) > 0


def test_similarity_transform_refuses_degenerate_and_misshaped_points():
    with pytest.raises(ValueError, match="src points all coincide"):
        ijb.similarity_transform([[1.0, 2.0]] * 5, ijb.ARCFACE_TEMPLATE)
    with pytest.raises(ValueError, match=r"dst must have shape \[5, 2\]"):
        ijb.similarity_transform(ijb.ARCFACE_TEMPLATE, [[0.0, 0.0]] * 4)
    with pytest.raises(ValueError, match="src contains NaN"):
        ijb.similarity_transform([[math.nan, 0.0], [1.0, 1.0]], [[0.0, 0.0], [1.0, 1.0]])


# -- warp and align -------------------------------------------------------------------
# cv2.warpAffine(img, M, (14, 12)) of img = torch.randint(0, 256, (23, 19), uint8) from
# torch.Generator().manual_seed(3), then cv2.warpAffine(img3, M3, (10, 8),
# borderValue=(9, 9, 9)) of the next draw img3 [9, 11, 3] (OpenCV 4.10).
CV2_WARP = ("00005f997697b294020d0000000000047b838c8bba8322ad905a0f00001272c27074cc562ede908286a80035851a4a74"
            "382b8cd36b35717c0c9f9d7fae86a3c6c254588f568a64e69fa0b6bfa56196c97cbdaca47fbec0be519bc27e882ba1c9"
            "e08b8abfac5aa37f9d8d716371c9e3317465a345dd550636b6494043235e7986b94fa9875c5d4d80a453cf54bb84c18a"
            "7acd8a97486853665d78e4786459528048b9753b10225894")
CV2_WARP3 = ("148a8d1360891510994d188a9a3a899a8e6db0a66aec39aac817c05f45cc12777a0b6d681119886a20a0c14abc9c8e99"
             "90b283cc637ed450735e9aad256b7f278b7e61647f88608b6065c4487bcc5090cb9e7e80cf7c40739c6f555f8849a2cf"
             "a8a38fb2966e4788af228fd3479bd971a5ab8fbb5f7a934475475b6a807c7b84616c7d5b2c949513b2c442abd660bdc1"
             "7cd4a48fb8a2812a3288541270742f507a764f7ba06465ae669aaa5cdca37ee2cf98d0f9502e776275606fa6656698af"
             "806fcbac2aa88b6e984ede935edec667cde60d4bcd3b7e9c619d607972a09b48c5ab22a98d4e9e49bca443d4bb65d6d5")


def test_warp_affine_matches_opencv_reference_outputs():
    g = torch.Generator().manual_seed(3)
    img = torch.randint(0, 256, (23, 19), generator=g, dtype=torch.uint8)
    out = ijb.warp_affine(img.numpy(), [[0.83, -0.31, 2.7], [0.29, 0.91, -1.35]], (12, 14))
    assert isinstance(out, np.ndarray) and out.shape == (12, 14, 1) and out.dtype == np.uint8
    assert out.tobytes().hex() == CV2_WARP
    img3 = torch.randint(0, 256, (9, 11, 3), generator=g, dtype=torch.uint8)
    out3 = ijb.warp_affine(img3, torch.tensor([[1.7, 0.4, -3.2], [-0.4, 1.7, 0.6]]), (8, 10), border_value=9)
    assert isinstance(out3, torch.Tensor) and out3.shape == (8, 10, 3)
    assert out3.numpy().tobytes().hex() == CV2_WARP3


def test_warp_affine_identity_shift_and_border():
    img = torch.randint(0, 256, (13, 17, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    assert torch.equal(ijb.warp_affine(img, torch.eye(3), (13, 17)), img)
    shifted = ijb.warp_affine(img, [[1, 0, 3], [0, 1, -2]], (13, 17), border_value=200)
    assert torch.equal(shifted[:11, 3:], img[2:, :14])
    assert (shifted[:, :3] == 200).all() and (shifted[11:] == 200).all()
    # a half-pixel shift averages neighbours, rounding half up; the border counts as 0
    half = ijb.warp_affine(img, [[1, 0, 0.5], [0, 1, 0]], (13, 17)).long()
    expect = (img[:, :-1].long() + img[:, 1:].long() + 1) // 2
    assert torch.equal(half[:, 1:], expect)
    assert torch.equal(half[:, 0], (img[:, 0].long() + 1) // 2)
    with pytest.raises(ValueError, match="matrix is singular"):
        ijb.warp_affine(img, [[1, 2, 0], [2, 4, 0]], 8)
    with pytest.raises(TypeError, match="dtype uint8"):
        ijb.warp_affine(img.float(), torch.eye(3), 8)
    with pytest.raises(ValueError, match="size must be"):
        ijb.warp_affine(img, torch.eye(3), (0, 4))


def smooth_image(height: int, width: int, seed: int) -> torch.Tensor:
    """uint8 [H, W, 3] of low-frequency structure: bilinear resampling is nearly exact on it."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(1, 3, height // 8 + 2, width // 8 + 2, generator=g)
    up = torch.nn.functional.interpolate(coarse, size=(height, width), mode="bicubic", align_corners=True)
    return (up[0].permute(1, 2, 0).clamp(0, 1) * 255).round().to(torch.uint8)


def test_align_undoes_a_known_similarity():
    face = smooth_image(112, 112, 1)
    template = torch.tensor(ijb.ARCFACE_TEMPLATE, dtype=torch.float64)
    T = similarity(23.0, 1.35, 60.0, 20.0)     # the aligned face placed into a 240x220 "loose crop"
    loose = ijb.warp_affine(face, T, (240, 220))
    aligned = ijb.align(loose, apply(T, template))
    assert aligned.shape == (112, 112, 3) and aligned.dtype == torch.uint8
    # (the outermost pixels blend in the loose crop's black surroundings)
    err = (aligned.float() - face.float()).abs()[2:-2, 2:-2]
    assert err.mean() < 1.0 and err.max() <= 10, (err.mean(), err.max())
    # a wrong alignment (landmarks off by 3 pixels) is far worse
    wrong = ijb.align(loose, apply(T, template) + 3.0)
    assert (wrong.float() - face.float()).abs()[2:-2, 2:-2].mean() > 4 * err.mean()
    # numpy in, numpy out; the 10-number landmark form of the IJB files
    flat = ijb.align(loose.numpy(), apply(T, template).reshape(-1).numpy())
    assert isinstance(flat, np.ndarray) and np.array_equal(flat, aligned.numpy())
    with pytest.raises(ValueError, match=r"landmarks must have shape \[5, 2\]"):
        ijb.align(loose, template[:4])
    with pytest.raises(TypeError, match="uint8"):
        ijb.align(loose.float(), template)
    # other crop sizes: insightface's scaled template
    assert ijb.align(loose, apply(T, template), image_size=224).shape == (224, 224, 3)
    torch.testing.assert_close(ijb.reference_landmarks(128)[0], torch.tensor([38.2946 * 1 + 8, 51.6963],
                                                                              dtype=torch.float64))


# -- synthetic landmarks --------------------------------------------------------------
def test_synthetic_landmarks_sit_on_the_pupils_and_scale_with_the_image():
    size = 448
    faces = SyntheticFaces(12, 4, image_size=size, seed=0)
    ids, nums = torch.arange(12), torch.arange(12) * 5 + 1
    images = faces.render(ids, nums).float().mean(1)          # grey [B, H, W]
    lm = faces.landmarks(ids, nums)
    assert lm.shape == (12, 5, 2) and lm.dtype == torch.float64
    _, _, img_v, _ = faces._draw(ids.tolist(), nums.tolist())
    from ds_pfc.data.faces import _IMG_INDEX
    checked = 0
    for b in range(12):
        if img_v[b, _IMG_INDEX["occlude"]] < 0.15 or img_v[b, _IMG_INDEX["eye_open"]] < 0.7:
            continue                     # an occluder or nearly closed eyes hide the pupil
        for e in range(2):
            x, y = lm[b, e].tolist()
            r = 7
            x0, y0 = round(x) - r, round(y) - r
            win = images[b, y0:y0 + 2 * r + 1, x0:x0 + 2 * r + 1]
            dark = (win < win.min() + 0.35 * (win.median() - win.min())).float()
            yy, xx = torch.meshgrid(torch.arange(2 * r + 1) + y0, torch.arange(2 * r + 1) + x0, indexing="ij")
            cx, cy = (dark * xx).sum() / dark.sum(), (dark * yy).sum() / dark.sum()
            assert abs(cx - x) < 1.5 and abs(cy - y) < 1.5, (b, e, (x, y), (float(cx), float(cy)))
            checked += 1
    assert checked >= 8
    # the same faces at 112 pixels: (x + 0.5) scales with the image
    small = SyntheticFaces(12, 4, image_size=112, seed=0).landmarks(ids, nums)
    torch.testing.assert_close((small + 0.5) * 4 - 0.5, lm, rtol=0, atol=1e-9)
    # left before right, the eyes above the mouth, in every pose
    assert (lm[:, 0, 0] < lm[:, 1, 0]).all() and (lm[:, 3, 0] < lm[:, 4, 0]).all()
    assert (lm[:, :2, 1].max(1).values < lm[:, 3:, 1].min(1).values).all()
    with pytest.raises(ValueError, match="same shape"):
        faces.landmarks(ids, nums[:3])


# -- pooling, ROC, TAR ----------------------------------------------------------------
def naive_template_scores(feats, templates, medias, pairs):
    """insightface's recipe as plain loops: media means, summed per template, normalised."""
    feats, templates, medias = feats.tolist(), templates.tolist(), medias.tolist()
    pooled = {}
    for t in sorted(set(templates)):
        rows = [i for i in range(len(feats)) if templates[i] == t]
        total = [0.0] * len(feats[0])
        for m in sorted({medias[i] for i in rows}):
            group = [feats[i] for i in rows if medias[i] == m]
            mean = [sum(col) / len(group) for col in zip(*group)]
            total = [a + b for a, b in zip(total, mean)]
        norm = math.sqrt(sum(v * v for v in total))
        pooled[t] = [v / norm for v in total] if norm > 0 else total
    return pooled, [sum(a * b for a, b in zip(pooled[t1], pooled[t2])) for t1, t2 in pairs.tolist()]


def test_pool_templates_matches_a_naive_loop():
    g = torch.Generator().manual_seed(7)
    num, dim = 37, 5
    templates = torch.randint(100, 109, (num,), generator=g)
    medias = torch.randint(0, 6, (num,), generator=g)      # media ids recur across templates
    feats = torch.randn(num, dim, generator=g, dtype=torch.float64)
    ids, pooled = ijb.pool_templates(feats, templates, medias)
    ref, _ = naive_template_scores(feats, templates, medias, torch.zeros(0, 2, dtype=torch.int64))
    assert ids.tolist() == sorted(ref)
    torch.testing.assert_close(pooled, torch.tensor([ref[t] for t in ids.tolist()], dtype=torch.float64),
                               rtol=0, atol=1e-12)
    # through evaluate, with detector scores and without the norm
    faceness = torch.rand(num, generator=g, dtype=torch.float64) + 0.1
    present = ids.tolist()
    pairs = torch.tensor([[present[i], present[j]] for i in range(len(present)) for j in range(len(present))
                          if i < j])
    labels = (torch.arange(pairs.shape[0]) % 3 == 0).long()
    for norm_score in (True, False):
        x = feats if norm_score else feats / feats.norm(dim=1, keepdim=True)
        _, scores = naive_template_scores(x * faceness.unsqueeze(1), templates, medias, pairs)
        r = ijb.evaluate(feats.float(), templates, medias, pairs, labels, faceness=faceness,
                         use_norm_score=norm_score)
        torch.testing.assert_close(r.scores, torch.tensor(scores, dtype=torch.float64), rtol=0, atol=1e-6)


def hand_case():
    """Six images, three templates, 2-d features (see the expected values below)."""
    feats = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0], [0.0, 3.0], [1.0, 1.0], [-1.0, 1.0]])
    templates = torch.tensor([1, 1, 1, 2, 3, 3])
    medias = torch.tensor([10, 10, 11, 20, 30, 31])
    faceness = torch.tensor([1.0, 0.5, 0.25, 1.0, 1.0, 1.0])
    pairs = torch.tensor([[1, 2], [1, 3], [2, 3]])
    labels = torch.tensor([0, 0, 1])
    return feats, templates, medias, pairs, labels, faceness


@pytest.mark.parametrize("norm_score, detector, t1", [
    # template 1 = mean(media 10) + media 11; templates 2 and 3 both point along (0, 1)
    (True, False, (0.5 + 2.0, 0.5)),                     # (1,0),(0,1) -> (.5,.5); + (2,0)
    (False, False, (0.5 + 1.0, 0.5)),                    # normalised: (2,0) -> (1,0)
    (True, True, (0.5 + 0.5, 0.25)),                     # (1,0),(0,.5) -> (.5,.25); + .25 (2,0)
    (False, True, (0.5 + 0.25, 0.25)),
])
def test_evaluate_hand_computed_scores(norm_score, detector, t1):
    feats, templates, medias, pairs, labels, faceness = hand_case()
    feats = feats.double()
    before = feats.clone()
    r = ijb.evaluate(feats, templates, medias, pairs, labels, faceness=faceness, use_norm_score=norm_score,
                     use_detector_score=detector)
    assert torch.equal(feats, before)      # the caller's features are left alone
    cos = t1[1] / math.hypot(*t1)      # template 1 against (0, 1)
    torch.testing.assert_close(r.scores, torch.tensor([cos, cos, 1.0], dtype=torch.float64), rtol=0, atol=1e-12)
    # two impostor pairs at one score below the genuine pair: a perfect ROC
    assert r.fpr.tolist() == [0.0, 0.0, 1.0] and r.tpr.tolist() == [0.0, 1.0, 1.0]
    assert r.thresholds[0] == math.inf and r.thresholds[1:].tolist() == pytest.approx([1.0, cos])
    assert r.auc == 1.0 and all(v == 1.0 for v in r.tar_at_far.values())


def test_evaluate_refuses_bad_input():
    feats, templates, medias, pairs, labels, faceness = hand_case()
    with pytest.raises(ValueError, match="faceness is required"):
        ijb.evaluate(feats, templates, medias, pairs, labels)
    with pytest.raises(ValueError, match=r"templates without images: \[9\]"):
        ijb.evaluate(feats, templates, medias, torch.tensor([[1, 9], [1, 2], [2, 3]]), labels, faceness=faceness)
    with pytest.raises(ValueError, match="genuine and impostor"):
        ijb.evaluate(feats, templates, medias, pairs, torch.zeros(3, dtype=torch.int64), faceness=faceness)
    with pytest.raises(ValueError, match=r"medias must have shape \[6\]"):
        ijb.evaluate(feats, templates, medias[:5], pairs, labels, faceness=faceness)
    with pytest.raises(TypeError, match="templates must hold integers"):
        ijb.evaluate(feats, templates.float(), medias, pairs, labels, faceness=faceness)
    with pytest.raises(ValueError, match="faceness must hold 6"):
        ijb.evaluate(feats, templates, medias, pairs, labels, faceness=faceness[:2])


def test_roc_drop_intermediate_and_nearest_far_rule():
    # genuine at .9 .8 .7 .6, impostors at .8 .7 .6 .3 .2: three ties of one genuine
    # and one impostor make a straight run of the curve
    scores = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.8, 0.7, 0.6, 0.3, 0.2])
    labels = torch.tensor([1, 1, 1, 1, 0, 0, 0, 0, 0])
    fpr, tpr, thr = ijb.roc_curve(scores, labels, drop_intermediate=False)
    assert fpr.tolist() == [0.0, 0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert tpr.tolist() == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert thr.tolist() == pytest.approx([math.inf, 0.9, 0.8, 0.7, 0.6, 0.3, 0.2])
    # sklearn's default (insightface's) keeps the ends of straight runs only
    fpr_d, tpr_d, thr_d = ijb.roc_curve(scores, labels)
    assert fpr_d.tolist() == [0.0, 0.0, 0.6, 1.0] and tpr_d.tolist() == [0.0, 0.25, 1.0, 1.0]
    assert thr_d.tolist() == pytest.approx([math.inf, 0.9, 0.6, 0.2])
    # nearest-FPR rule: FAR 0.2 reads 0.5 on the full curve, 0.25 (at FPR 0) on the dropped one
    tar, achieved = ijb.tar_at_far(fpr, tpr, (0.2, 1e-3))
    assert tar == {0.2: 0.5, 1e-3: 0.25} and achieved == {0.2: 0.2, 1e-3: 0.0}
    tar, achieved = ijb.tar_at_far(fpr_d, tpr_d, (0.2, 0.5))
    assert tar == {0.2: 0.25, 0.5: 1.0} and achieved == {0.2: 0.0, 0.5: 0.6}


def test_roc_matches_sklearn_reference_output():
    s = torch.tensor([0.9, 0.8, 0.8, 0.7, 0.7, 0.7, 0.6, 0.5, 0.5, 0.4, 0.3, 0.2, 0.2, 0.1])
    y = torch.tensor([1, 1, 0, 1, 1, 0, 1, 0, 0, 1, 0, 0, 0, 0])
    # sklearn.metrics.roc_curve(y, s) (drop_intermediate=True and False agree here)
    ref_fpr = [0.0, 0.0, 0.125, 0.25, 0.25, 0.5, 0.5, 0.625, 0.875, 1.0]
    ref_tpr = [0.0, 1 / 6, 1 / 3, 2 / 3, 5 / 6, 5 / 6, 1.0, 1.0, 1.0, 1.0]
    for drop in (True, False):
        fpr, tpr, thr = ijb.roc_curve(s, y, drop_intermediate=drop)
        assert fpr.tolist() == ref_fpr
        torch.testing.assert_close(tpr, torch.tensor(ref_tpr, dtype=torch.float64), rtol=0, atol=1e-15)
        assert thr[1:].tolist() == pytest.approx([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1])
    # equal FPRs: the largest TPR among them (FPR 0.25 has TPR 2/3 and 5/6)
    tar, _ = ijb.tar_at_far(*ijb.roc_curve(s, y)[:2], (0.25, 0.3))
    assert tar[0.25] == pytest.approx(5 / 6) and tar[0.3] == pytest.approx(5 / 6)
    # evaluate on templates built to score s: pair i joins template 2i, feature (1, 0),
    # and template 2i+1, feature (s_i, sqrt(1 - s_i^2)). Its AUC is the probability
    # that a genuine pair outscores an impostor pair, ties counting one half.
    feats = torch.cat([torch.tensor([[1.0, 0.0]]).expand(14, 2), torch.stack([s, (1 - s * s).sqrt()], 1)], 1)
    feats = feats.reshape(28, 2).double()
    pairs = torch.arange(28).view(14, 2)
    r = ijb.evaluate(feats, torch.arange(28), torch.arange(28), pairs, y, use_detector_score=False)
    torch.testing.assert_close(r.scores, s.double(), rtol=0, atol=1e-7)
    pos, neg = s[y == 1].tolist(), s[y == 0].tolist()
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p in pos for n in neg)
    assert r.auc == pytest.approx(wins / (len(pos) * len(neg)), abs=1e-12)


# -- the synthetic IJB set, meta reading, embedding -----------------------------------
@pytest.fixture(scope="module")
def ijb_dir(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("synthetic_ijb"))
    summary = make_synthetic_ijb(root, num_identities=30)
    return root, summary


def test_read_meta_on_the_synthetic_set(ijb_dir):
    root, summary = ijb_dir
    meta = ijb.read_meta(root, "ijbc")
    assert meta.target == "IJBC" and meta.num_images == summary["num_images"]
    assert meta.landmarks.shape == (meta.num_images, 5, 2) and meta.faceness.shape == (meta.num_images,)
    assert meta.num_pairs == summary["num_pairs"] == 90 * 89 // 2 and int(meta.labels.sum()) == 90
    assert torch.unique(meta.templates).numel() == 90 and os.path.isfile(meta.image_path(0))
    # every genuine pair joins two templates of one identity
    who = summary["template_identity"]
    for (t1, t2), label in zip(meta.pairs.tolist(), meta.labels.tolist()):
        assert label == int(who[t1] == who[t2])


def test_read_meta_errors_name_the_file(ijb_dir, tmp_path):
    root, _ = ijb_dir
    copy_root = str(tmp_path / "ijb")
    shutil.copytree(os.path.join(root, "meta"), os.path.join(copy_root, "meta"))
    os.makedirs(os.path.join(copy_root, "loose_crop"))
    ijb.read_meta(copy_root, "IJBC")
    with pytest.raises(FileNotFoundError, match="ijbb_face_tid_mid.txt"):
        ijb.read_meta(copy_root, "IJBB")
    lmk = os.path.join(copy_root, "meta", "ijbc_name_5pts_score.txt")
    with open(lmk) as f:
        lines = f.readlines()
    with open(lmk, "w") as f:
        f.writelines([lines[1], lines[0]] + lines[2:])
    with pytest.raises(ValueError, match=r"ijbc_name_5pts_score.txt:1 names '2.jpg'"):
        ijb.read_meta(copy_root, "IJBC")
    with open(lmk, "w") as f:
        f.writelines(lines[:-1])
    with pytest.raises(ValueError, match="lists .* images"):
        ijb.read_meta(copy_root, "IJBC")
    with open(lmk, "w") as f:
        f.writelines(lines[:2] + [" ".join(lines[2].split()[:-1]) + "\n"] + lines[3:])   # the score dropped
    with pytest.raises(ValueError, match=r"ijbc_name_5pts_score.txt:3: expected .* \(12 fields\), got 11"):
        ijb.read_meta(copy_root, "IJBC")
    with open(lmk, "w") as f:
        f.writelines(lines)
    tid_mid = os.path.join(copy_root, "meta", "ijbc_face_tid_mid.txt")
    with open(tid_mid) as f:
        tid_lines = f.readlines()
    with open(tid_mid, "w") as f:
        f.writelines(["\n", tid_lines[0].rstrip() + " 7\n"] + tid_lines[1:])    # a blank line, then 4 fields
    with pytest.raises(ValueError, match=r"ijbc_face_tid_mid.txt:2: expected 'name template_id media_id' "
                                         r"\(3 fields\), got 4"):
        ijb.read_meta(copy_root, "IJBC")
    with open(tid_mid, "w") as f:
        f.writelines(tid_lines)
    with open(os.path.join(copy_root, "meta", "ijbc_template_pair_label.txt"), "a") as f:
        f.write("1 99999 0\n")
    with pytest.raises(ValueError, match=r"templates \[99999\] have no images"):
        ijb.read_meta(copy_root, "IJBC")
    shutil.copy(os.path.join(root, "meta", "ijbc_template_pair_label.txt"), os.path.join(copy_root, "meta"))
    shutil.rmtree(os.path.join(copy_root, "loose_crop"))
    with pytest.raises(FileNotFoundError, match="image directory not found"):
        ijb.read_meta(copy_root, "IJBC")
    os.remove(lmk)
    with pytest.raises(FileNotFoundError, match="ijbc_name_5pts_score.txt"):
        ijb.read_meta(copy_root, "IJBC")


class PixelModel(torch.nn.Module):
    """A fixed random projection of 8x8-pooled pixels: cheap, and flip-sensitive."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.proj = torch.nn.Parameter(torch.randn(3 * 14 * 14, 16, generator=g), requires_grad=False)

    def forward(self, x):
        return torch.nn.functional.avg_pool2d(x, 8).flatten(1) @ self.proj


def test_embed_images_aligns_flips_and_keeps_the_order(ijb_dir):
    root, _ = ijb_dir
    meta = ijb.read_meta(root, "IJBC")
    model = PixelModel()
    calls = []
    feats = ijb.embed_images(model, meta, batch_size=50, progress=lambda done, total: calls.append((done, total)))
    assert feats.shape == (meta.num_images, 16) and feats.dtype == torch.float32
    assert calls[-1] == (meta.num_images, meta.num_images) and len(calls) == math.ceil(meta.num_images / 50)
    for i in (0, 7, meta.num_images - 1):
        with open(os.path.join(root, "loose_crop", meta.names[i]), "rb") as f:
            image = decode_image(f.read()).permute(1, 2, 0)
        x = (ijb.align(image, meta.landmarks[i]).permute(2, 0, 1).float() / 255 - 0.5) / 0.5
        ref = model(x[None]) + model(x[None].flip(3))
        torch.testing.assert_close(feats[i], ref[0], rtol=1e-5, atol=1e-4)
    inline = ijb.embed_images(model, meta, batch_size=64, num_workers=0, flip=False)
    one = ijb.embed_images(model, meta, batch_size=64, num_workers=3, flip=False)
    assert torch.equal(inline, one) and not torch.allclose(inline, feats)


def test_embed_images_names_a_missing_or_broken_image(ijb_dir, tmp_path):
    import dataclasses
    root, _ = ijb_dir
    meta = ijb.read_meta(root, "IJBC")
    (tmp_path / "1.jpg").write_bytes(b"not a jpeg")
    broken = dataclasses.replace(meta, image_dir=str(tmp_path))
    with pytest.raises(ValueError, match="1.jpg could not be decoded"):
        ijb.embed_images(PixelModel(), broken, num_workers=1)
    with pytest.raises(FileNotFoundError, match="2.jpg could not be read"):
        ijb.embed_images(PixelModel(), dataclasses.replace(broken, names=("2.jpg",) + meta.names[1:]), num_workers=0)


# -- the CLI, and a trained model against an untrained one ----------------------------
TRAIN = {
    "train_micro_batch_size_per_gpu": 32,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 5.0,
    "steps_per_print": 10 ** 9,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4}},
    "zero_optimization": {"stage": 0},
    "ds_pfc": {
        "head": {"num_classes": 150, "embedding_size": 64, "sample_rate": 1.0,
                 "margin": {"type": "cosface", "scale": 16.0, "margin": 0.1}},
        "backbone": {"name": "mobilefacenet", "width": 0.25},
        "data": {"synthetic": {"images_per_identity": 8, "held_out_identities": 10}, "workers": 1,
                 "prefetch_batches": 2},
        "train": {"epochs": 10, "max_steps": 60, "log_every": 20,
                  "schedule": {"type": "poly", "warmup_epochs": 0.0, "power": 1.0}},
        "evaluation": {"synthetic_pairs": 0},
        "checkpoint": {"every_steps": 1000, "keep": 1},
    },
}


def _eval_cli(*args):
    """``launch/eval.py *args`` in this process: (exit status, stdout, stderr). An
    ``error: ...`` exit reads as it does from the script (status 1, the message on
    stderr); any other exception escapes, failing the test as a traceback would."""
    from ds_pfc.cli.eval import main
    return call_main(main, args)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """(trained, untrained) exports: 60 steps of the training app (about 25 s on one
    core), and the weights it started from (the app seeds torch with
    ``ds_pfc.train.seed`` before building the backbone), written in the export format."""
    from safetensors.torch import save_file

    from ds_pfc.app.config import split_config
    from ds_pfc.checkpoint.export import EXPORT_FORMAT
    tmp = tmp_path_factory.mktemp("models")
    config = os.path.join(tmp, "tiny.json")
    with open(config, "w") as f:
        json.dump(TRAIN, f)
    run = os.path.join(tmp, "run")
    train_here(["--deepspeed_config", config, "--output_dir", run])
    trained = os.path.join(run, "export", "model.safetensors")
    _, cfg = split_config(copy.deepcopy(TRAIN))
    torch.manual_seed(cfg.train.seed)
    backbone = cfg.backbone.build(cfg.head.embedding_size)
    untrained = os.path.join(tmp, "untrained", "model.safetensors")
    os.makedirs(os.path.dirname(untrained))
    save_file({f"backbone.{k}": v.float().contiguous() for k, v in backbone.state_dict().items()}, untrained,
              metadata={"format": EXPORT_FORMAT, "config": json.dumps(TRAIN)})
    return trained, untrained


@pytest.fixture(scope="module")
def cli_run(ijb_dir, exports, tmp_path_factory):
    root, _ = ijb_dir
    out = str(tmp_path_factory.mktemp("ijb_out"))
    trained, untrained = exports
    status, stdout, stderr = _eval_cli("--ijb", root, "--target", "IJBC", "--model", trained, "--model", untrained,
                                       "--batch-size", "48", "--out", out)
    assert status == 0, stdout[-3000:] + stderr[-3000:]
    with open(os.path.join(out, "ijb_ijbc.json")) as f:
        return json.load(f), out, stdout


def test_cli_writes_json_and_roc_consistent_with_evaluate(ijb_dir, exports, cli_run):
    from PIL import Image

    from ds_pfc.app.export import load_backbone
    result, out, stdout = cli_run
    root, summary = ijb_dir
    trained, untrained = exports
    assert result["target"] == "IJBC" and result["num_pairs"] == summary["num_pairs"]
    assert result["settings"]["flip"] and result["settings"]["use_detector_score"]
    assert [m["label"] for m in result["models"]] == ["export/model.safetensors", "untrained/model.safetensors"]
    for entry, path in zip(result["models"], (trained, untrained)):
        with open(path, "rb") as f:
            assert entry["sha256"] == hashlib.sha256(f.read()).hexdigest()
        assert set(entry["tar_at_far"]) == {"1e-06", "1e-05", "0.0001", "0.001", "0.01", "0.1"}
    with Image.open(os.path.join(out, "ijb_ijbc.png")) as png:
        assert png.format == "PNG" and png.size[0] > 400
    assert result["roc_png"] == os.path.join(out, "ijb_ijbc.png") and "TAR (%) at FAR on IJBC" in stdout
    # the same numbers from the API
    meta = ijb.read_meta(root, "IJBC")
    backbone, _ = load_backbone(trained)
    feats = ijb.embed_images(backbone, meta, batch_size=64)
    r = ijb.evaluate(feats, meta.templates, meta.medias, meta.pairs, meta.labels, faceness=meta.faceness)
    got = result["models"][0]
    assert got["auc"] == pytest.approx(r.auc, abs=1e-9)
    for far, tar in r.tar_at_far.items():
        assert got["tar_at_far"][f"{far:g}"] == pytest.approx(tar, abs=1e-9)


def test_trained_model_beats_an_untrained_one(cli_run):
    """Training must help on aligned IJB-style crops. The untrained network is the
    trained one's starting point; random convolutional features already separate
    these identities fairly well (AUC about 0.9, from colours), and a minute of
    training moves AUC by about 0.05 and TAR@FAR=0.1 by about 0.15 (measured)."""
    result, _, _ = cli_run
    trained, untrained = result["models"]
    assert trained["auc"] > untrained["auc"] + 0.02, (trained, untrained)
    assert trained["tar_at_far"]["0.1"] > untrained["tar_at_far"]["0.1"] + 0.08, (trained, untrained)


def test_cli_refuses_what_it_cannot_do(tmp_path, ijb_dir, exports):
    root, _ = ijb_dir
    trained, _ = exports
    # (no traceback: _eval_cli lets any exception but the CLI's own exit escape)
    status, _, stderr = _eval_cli("--ijb", str(tmp_path), "--model", trained)
    assert status != 0 and "ijbc_face_tid_mid.txt" in stderr and "Traceback" not in stderr
    status, _, stderr = _eval_cli("--ijb", root, "--target", "IJBA", "--model", trained)
    assert status != 0 and "invalid choice" in stderr
    status, _, stderr = _eval_cli("--model", trained, "--model", trained)
    assert status != 0 and "several --model are for --ijb" in stderr
