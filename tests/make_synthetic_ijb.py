"""A small IJB-format directory of rendered synthetic faces (insightface's IJB layout).

    python tests/make_synthetic_ijb.py /tmp/synthetic_ijb            # IJBC, 40 identities
    python launch/eval.py --ijb /tmp/synthetic_ijb --target IJBC --model runs/cpu_quickstart/export/model.safetensors

Identities come from :class:`ds_pfc.data.SyntheticFaces` far beyond the ones any
config trains on (``first_identity`` 100000 by default). Each identity has
``templates_per_identity`` templates; a template holds 1-3 media, a media 1-2 images
(the frames of one "video" are further images of the same identity). Every image is a
rendered 112x112 face (with its pose, expression, scene and lighting nuisances),
placed by a random similarity (rotation, scale, shift) into a larger "loose crop"
canvas, its surroundings continued from the render's border, and saved as JPEG.
Its five landmarks (:meth:`SyntheticFaces.landmarks`, moved by the same similarity,
with a little detector noise) and a faceness score go into
``meta/<target>_name_5pts_score.txt``. The protocol pairs every two templates:
genuine when they show one identity, impostor otherwise.

Everything is a pure function of the arguments.
"""
from __future__ import annotations

import argparse
import io
import math
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from ds_pfc.data.faces import SyntheticFaces  # noqa: E402
from ds_pfc.eval.ijb import warp_affine  # noqa: E402

__all__ = ["make_synthetic_ijb"]

_PAD = 48   # render border continued outwards (replicate) before placing the face


def make_synthetic_ijb(root: str, *, target: str = "IJBC", num_identities: int = 40,
                       templates_per_identity: int = 3, first_identity: int = 100_000, seed: int = 0,
                       face_seed: int = 0, canvas: tuple[int, int] = (136, 176), landmark_noise: float = 0.5,
                       jpeg_quality: int = 92) -> dict:
    """Write the set under ``root`` and return a summary: ``num_images``,
    ``num_templates``, ``num_pairs``, ``num_genuine``, and ``template_identity``
    (template id -> identity). ``face_seed`` is the :class:`SyntheticFaces` seed (the
    face space a model was trained on); ``seed`` draws the protocol and the crops.
    Canvas sides are drawn from ``canvas`` (inclusive)."""
    if num_identities < 2 or templates_per_identity < 2:
        raise ValueError("need at least 2 identities and 2 templates per identity (genuine and impostor pairs)")
    g = torch.Generator().manual_seed(seed)
    faces = SyntheticFaces(1, 1, first_identity=first_identity, seed=face_seed)

    # Protocol: identity -> templates -> media -> images (image numbers of the identity).
    rows = []   # (identity, image number, template id, media id)
    template_identity = {}
    template_id, media_id = 1, 1001
    for i in range(num_identities):
        identity = first_identity + i
        number = 0
        for _ in range(templates_per_identity):
            template_identity[template_id] = identity
            for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
                for _ in range(int(torch.randint(1, 3, (1,), generator=g))):
                    rows.append((identity, number, template_id, media_id))
                    number += 1
                media_id += 1
            template_id += 1
    ids = torch.tensor([r[0] for r in rows])
    nums = torch.tensor([r[1] for r in rows])
    images = faces.render(ids, nums)                 # uint8 [N, 3, 112, 112]
    landmarks = faces.landmarks(ids, nums)           # float64 [N, 5, 2]
    num = len(rows)

    meta_dir, crop_dir = os.path.join(root, "meta"), os.path.join(root, "loose_crop")
    os.makedirs(meta_dir, exist_ok=True)
    os.makedirs(crop_dir, exist_ok=True)
    from PIL import Image

    lines_lmk, lines_tid = [], []
    for k in range(num):
        u = torch.rand(6, generator=g, dtype=torch.float64).tolist()
        height = canvas[0] + int(u[0] * (canvas[1] - canvas[0] + 1))
        width = canvas[0] + int(u[1] * (canvas[1] - canvas[0] + 1))
        angle = math.radians(-15.0 + 30.0 * u[2])
        scale = 0.85 + 0.45 * u[3]
        # The render's centre lands near the canvas centre.
        cx = (width - 1) / 2.0 + (u[4] - 0.5) * 16.0
        cy = (height - 1) / 2.0 + (u[5] - 0.5) * 16.0
        c, s = scale * math.cos(angle), scale * math.sin(angle)
        centre = 55.5 + _PAD
        M = torch.tensor([[c, -s, cx - c * centre + s * centre],
                          [s, c, cy - s * centre - c * centre]], dtype=torch.float64)
        padded = F.pad(images[k:k + 1].float(), (_PAD,) * 4, mode="replicate")[0].to(torch.uint8)
        crop = warp_affine(padded.permute(1, 2, 0), M, (height, width))
        pts = landmarks[k] + _PAD
        pts = pts @ M[:, :2].T + M[:, 2]
        pts = pts + landmark_noise * torch.randn(5, 2, generator=g, dtype=torch.float64)
        faceness = 0.5 + 0.5 * float(torch.rand(1, generator=g, dtype=torch.float64))
        name = f"{k + 1}.jpg"
        buf = io.BytesIO()
        Image.fromarray(crop.numpy()).save(buf, format="JPEG", quality=jpeg_quality)
        with open(os.path.join(crop_dir, name), "wb") as f:
            f.write(buf.getvalue())
        coords = " ".join(f"{v:.3f}" for v in pts.reshape(-1).tolist())
        lines_lmk.append(f"{name} {coords} {faceness:.6f}\n")
        _, _, tid, mid = rows[k]
        lines_tid.append(f"{name} {tid} {mid}\n")

    prefix = target.lower()
    with open(os.path.join(meta_dir, f"{prefix}_name_5pts_score.txt"), "w") as f:
        f.writelines(lines_lmk)
    with open(os.path.join(meta_dir, f"{prefix}_face_tid_mid.txt"), "w") as f:
        f.writelines(lines_tid)
    tids = sorted(template_identity)
    num_genuine = 0
    with open(os.path.join(meta_dir, f"{prefix}_template_pair_label.txt"), "w") as f:
        for a in range(len(tids)):
            for b in range(a + 1, len(tids)):
                same = int(template_identity[tids[a]] == template_identity[tids[b]])
                num_genuine += same
                f.write(f"{tids[a]} {tids[b]} {same}\n")
    num_pairs = len(tids) * (len(tids) - 1) // 2
    return {"root": root, "target": target.upper(), "num_images": num, "num_templates": len(tids),
            "num_pairs": num_pairs, "num_genuine": num_genuine, "template_identity": template_identity}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("root", help="output directory (meta/ and loose_crop/ are created in it)")
    p.add_argument("--target", default="IJBC", help="file prefix: IJBC or IJBB")
    p.add_argument("--identities", type=int, default=40)
    p.add_argument("--templates_per_identity", type=int, default=3)
    p.add_argument("--first_identity", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--face_seed", type=int, default=0, help="the SyntheticFaces seed (that of the training config)")
    args = p.parse_args(argv)
    summary = make_synthetic_ijb(args.root, target=args.target, num_identities=args.identities,
                                 templates_per_identity=args.templates_per_identity,
                                 first_identity=args.first_identity, seed=args.seed, face_seed=args.face_seed)
    print(f"{summary['root']}: {summary['num_images']} images, {summary['num_templates']} templates, "
          f"{summary['num_pairs']} pairs ({summary['num_genuine']} genuine)")
    return summary


if __name__ == "__main__":
    main()
