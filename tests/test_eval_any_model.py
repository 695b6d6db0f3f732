"""``launch/eval.py`` on models of other origins, and ``launch/export.py onnx`` options.

The reference is arcface_torch's IResNet layout written independently in
``test_arcface_import``: its embeddings ``normalise(f(x) + f(flip x))``
of the decoded ``.bin`` images, scored with :func:`ds_pfc.eval.verification_metrics`.
The same weights reach ``launch/eval.py`` three ways: arcface_torch's ``model.pt``
with ``--network``, the ds_pfc export imported from it, and ONNX files exported from
that (run by onnxruntime).
"""
from __future__ import annotations

import io
import math
import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from test_arcface_import import ArcIResNet, _randomize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCH = os.path.join(ROOT, "launch")
D = 24                   # embedding size of the tiny network
PAIRS = 16


def _cli(name):
    """What ``launch/<name>.py`` runs, in this process: ``ds_pfc.cli.<name>.run`` (returns the result)."""
    import importlib
    return importlib.import_module(f"ds_pfc.cli.{name}").run


def _run(script, *args):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, os.path.join(LAUNCH, script), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def _one_error_line(proc, needle):
    assert proc.returncode != 0, proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """arcface_torch's r18 at width 1/4 (``model.pt``), its ds_pfc export, a ``.bin``
    of PNG pairs, and the reference embeddings of the ``.bin`` images."""
    from PIL import Image

    from ds_pfc.app import arcface_import as ai
    tmp = tmp_path_factory.mktemp("any_model")
    ref = _randomize(ArcIResNet((2, 2, 2, 2), base=16, num_features=D), seed=11)
    pt = str(tmp / "model.pt")
    torch.save(ref.state_dict(), pt)
    export = ai.import_backbone(pt, "r18", str(tmp / "export" / "model.safetensors"), width=0.25)

    gen = torch.Generator().manual_seed(5)
    images, issame = [], []
    for i in range(PAIRS):
        a = torch.randint(0, 256, (112, 112, 3), generator=gen, dtype=torch.uint8)
        same = i % 3 != 2
        if same:                 # the same "face" under noise
            b = (a.int() + torch.randint(-60, 61, a.shape, generator=gen, dtype=torch.int32)).clamp(0, 255)
            b = b.to(torch.uint8)
        else:
            b = torch.randint(0, 256, (112, 112, 3), generator=gen, dtype=torch.uint8)
        images += [a, b]
        issame.append(same)
    encoded = []
    for img in images:
        buf = io.BytesIO()
        Image.fromarray(img.numpy()).save(buf, format="PNG")
        encoded.append(buf.getvalue())
    bin_path = str(tmp / "tiny.bin")
    with open(bin_path, "wb") as f:
        pickle.dump((encoded, issame), f, protocol=4)

    x = torch.stack(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    with torch.no_grad():          # float32: float64 convolutions are slow on a CPU
        raw = ref(x)
        emb = F.normalize(raw + ref(x.flip(3)), dim=1)
    return {"tmp": tmp, "pt": pt, "export": export, "bin": bin_path, "x": x, "raw": raw, "emb": emb,
            "issame": issame, "ref": ref}


def _expected(files):
    from ds_pfc.eval import verification_metrics
    e = files["emb"].float()
    return verification_metrics(e[0::2], e[1::2], files["issame"], far_targets=(1e-4, 1e-6))


def _check_result(out, want):
    r = out["tiny"]
    assert r["accuracy"] == pytest.approx(want.accuracy, abs=1e-12)
    assert r["accuracy_std"] == pytest.approx(want.accuracy_std, abs=1e-12)
    for far, tar in want.tar_at_far.items():
        got = r["tar_at_far"][str(far)]
        assert (math.isnan(got) and math.isnan(tar)) or got == pytest.approx(tar, abs=1e-12)


def test_pt_with_network_and_native_export_score_like_the_reference(files):
    from ds_pfc.eval import embed
    from ds_pfc.app.eval_models import load_model
    model, config, kind = load_model(files["pt"], network="r18", width=0.25)
    assert kind == "arcface_torch" and config is None
    got = embed(model, files["x"].float(), 7, flip=True)
    torch.testing.assert_close(got, files["emb"].float(), rtol=0, atol=1e-5)

    want = _expected(files)
    assert 0.0 < want.accuracy <= 1.0
    main = _cli("eval")
    _check_result(main(["--model", files["pt"], "--network", "r18", "--width", "0.25", "--bins", files["bin"],
                        "--batch_size", "5"]), want)
    _check_result(main(["--model", files["export"], "--bins", files["bin"]]), want)


def _onnx_export(files, name, *extra):
    pytest.importorskip("onnx", reason="ONNX export needs the onnx package")
    out = str(files["tmp"] / name)
    assert _cli("export")(["onnx", "--model", files["export"], "--out", out, *extra]) == out
    return out


def _session_outputs(path, x):
    ort = pytest.importorskip("onnxruntime", reason="checking ONNX files needs onnxruntime (pip install ds_pfc[eval])")
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.float().numpy()})[0])


def test_onnx_default_export_follows_insightface_conventions_and_evaluates(files):
    import onnx
    path = _onnx_export(files, "dynamic.onnx")
    graph = onnx.load(path)
    assert graph.opset_import[0].version == 17
    (inp,), (out,) = graph.graph.input, graph.graph.output
    dims = [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim]
    assert dims == ["batch", 3, 112, 112] and inp.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim] == ["batch", D]
    # insightface's recognition loader takes the model to hold its own (x - 127.5) / 127.5
    # only when its first nodes are named Sub.. and Mul..; ds_pfc's holds none
    names = [n.name for n in graph.graph.node[:8]]
    assert not any(n.startswith(("Sub", "_minus")) for n in names) or \
        not any(n.startswith(("Mul", "_mul")) for n in names), names
    x = files["x"][:5]
    got = _session_outputs(path, x)                       # a batch of 5 through the dynamic axis
    torch.testing.assert_close(got, files["raw"][:5], rtol=1e-4, atol=1e-4 * files["raw"].abs().max().item())

    from ds_pfc.eval import embed
    from ds_pfc.app.eval_models import load_model
    model, _, kind = load_model(path)
    assert kind == "onnx"
    torch.testing.assert_close(embed(model, files["x"].float(), 5), files["emb"].float(), rtol=0, atol=1e-5)
    _check_result(_cli("eval")(["--model", path, "--bins", files["bin"]]), _expected(files))


def test_onnx_static_batch_and_opset(files):
    import onnx
    path = _onnx_export(files, "static.onnx", "--batch", "3", "--opset", "13")
    graph = onnx.load(path)
    assert graph.opset_import[0].version == 13
    assert [d.dim_value for d in graph.graph.input[0].type.tensor_type.shape.dim] == [3, 3, 112, 112]
    x = files["x"][:3]
    torch.testing.assert_close(_session_outputs(path, x), files["raw"][:3], rtol=1e-4,
                               atol=1e-4 * files["raw"].abs().max().item())
    from ds_pfc.eval import embed
    from ds_pfc.app.eval_models import load_model
    model, _, _ = load_model(path)
    assert model.static_batch == 3                         # 24 images in batches of 7: chunks of 3, padded
    torch.testing.assert_close(embed(model, files["x"].float(), 7), files["emb"].float(), rtol=0, atol=1e-5)


def test_onnx_fp16(files):
    import onnx
    path = _onnx_export(files, "half.onnx", "--fp16")
    graph = onnx.load(path)
    assert graph.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT   # float32 ends
    assert graph.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    kinds = {t.data_type for t in graph.graph.initializer if len(t.dims) > 1}
    assert kinds == {onnx.TensorProto.FLOAT16}, kinds
    got = _session_outputs(path, files["x"][:4])
    want = files["raw"][:4]
    # float16 arithmetic: within 1% of the embedding's scale, and the same direction
    assert (got - want).abs().max() < 1e-2 * want.abs().max(), (got - want).abs().max()
    assert F.cosine_similarity(got, want, dim=1).min() > 0.9995


def _write_1n(root, template_identity):
    """Protocol files: each identity's first template in the gallery (G1 or G2), the
    others probes."""
    by_id = {}
    for t, ident in sorted(template_identity.items()):
        by_id.setdefault(ident, []).append(t)
    ids = sorted(by_id)
    header = "TEMPLATE_ID,SUBJECT_ID,FILENAME\n"
    for name, part in (("G1", ids[:len(ids) // 2]), ("G2", ids[len(ids) // 2:])):
        with open(os.path.join(root, "meta", f"ijbc_1N_gallery_{name}.csv"), "w") as f:
            f.write(header + "".join(f"{by_id[i][0]},{i},x.jpg\n" for i in part))
    with open(os.path.join(root, "meta", "ijbc_1N_probe_mixed.csv"), "w") as f:
        f.write(header + "".join(f"{t},{i},x.jpg\n" for i in ids for t in by_id[i][1:]))


def test_ijb_scores_every_kind_like_the_reference(files):
    """``--ijb`` with the ``.pt`` and its ONNX file (a ds_pfc export's IJB run is
    ``test_ijb``'s): each model's TAR@FAR and AUC, and 1:N identification, as the
    reference network's features give them."""
    from make_synthetic_ijb import make_synthetic_ijb

    from ds_pfc.eval import ijb, ijb_1n
    root = str(files["tmp"] / "ijb")
    summary = make_synthetic_ijb(root, num_identities=4, templates_per_identity=2)
    _write_1n(root, summary["template_identity"])
    meta = ijb.read_meta(root, "IJBC")
    feats = ijb.embed_images(files["ref"], meta, batch_size=8, num_workers=0)
    want = ijb.evaluate(feats, meta.templates, meta.medias, meta.pairs, meta.labels, faceness=meta.faceness)
    want_1n = ijb_1n.identify(feats, meta.templates, meta.medias, ijb_1n.read_identification(root, "IJBC"),
                              faceness=meta.faceness)
    assert want_1n.num_probes == 4 and want_1n.num_gallery == 4
    models = [files["pt"]]
    try:
        import onnxruntime  # noqa: F401
        models.append(_onnx_export(files, "ijb.onnx"))
    except ImportError:
        pass                                  # the .pt still runs
    args = ["--ijb", root, "--target", "IJBC", "--network", "r18", "--width", "0.25", "--workers", "0",
            "--batch-size", "8", "--out", str(files["tmp"] / "ijb_out"), "--identification"]
    for m in models:
        args += ["--model", m]
    out = _cli("eval")(args)                  # --network and --width go to the .pt alone
    assert [e["path"] for e in out["models"]] == [os.path.abspath(m) for m in models]
    for entry in out["models"]:
        for far, tar in want.tar_at_far.items():
            assert entry["tar_at_far"][f"{far:g}"] == pytest.approx(tar, abs=1e-12), (entry["label"], far)
        assert entry["auc"] == pytest.approx(want.auc, abs=1e-6), entry["label"]
        got = entry["identification"]
        assert got["rank"] == {str(k): pytest.approx(v, abs=1e-12) for k, v in want_1n.rank_rate.items()}
        assert got["tpir_at_fpir"] == {f"{k:g}": pytest.approx(v, abs=1e-12)
                                       for k, v in want_1n.tpir_at_fpir.items()}
    assert 0.0 < want.auc < 1.0
def _reference_identification(feats, templates, medias, faceness, gallery, probes, fpirs, ranks):
    """insightface's 1:N recipe with plain Python lists (``gallery``/``probes``: rows
    ``(template, subject)``)."""
    pooled = {}
    for t in sorted(set(templates)):
        per_media = {}
        for f, tt, m, s in zip(feats, templates, medias, faceness):
            if tt == t:
                per_media.setdefault(m, []).append([v * s for v in f])
        total = [0.0] * len(feats[0])
        for rows in per_media.values():
            for j in range(len(total)):
                total[j] += sum(r[j] for r in rows) / len(rows)
        n = math.sqrt(sum(v * v for v in total))
        pooled[t] = [v / n for v in total]

    def firsts(rows):
        seen = {}
        for t, s in rows:
            seen.setdefault(t, s)
        return sorted(seen.items())
    g, p = firsts(gallery), firsts(probes)
    mated, nonmated, rank = [], [], []
    for t, s in p:
        scores = [sum(a * b for a, b in zip(pooled[t], pooled[gt])) for gt, _ in g]
        k = [gs for _, gs in g].index(s)
        mated.append(scores[k])
        nonmated += [x for j, x in enumerate(scores) if j != k]
        rank.append(1 + sum(x > scores[k] for x in scores))
    nonmated.sort(reverse=True)
    rates = {r: sum(x <= r for x in rank) / len(p) for r in ranks}
    tpir = {}
    for f in fpirs:
        th = nonmated[math.ceil(len(p) * f) - 1]
        tpir[f] = sum(m > th for m in mated) / len(p)
    return rates, tpir


def test_identification_matches_a_plain_reference():
    from ds_pfc.eval.ijb_1n import IJBIdentification, identify
    gen = torch.Generator().manual_seed(3)
    n, d, subjects = 60, 6, 8
    subject_of_image = torch.randint(0, subjects, (n,), generator=gen)
    centers = torch.randn(subjects, d, generator=gen, dtype=torch.float64)
    feats = centers[subject_of_image] + 1.2 * torch.randn(n, d, generator=gen, dtype=torch.float64)
    # templates: subject s owns templates 10 s + {0, 1, 2}; template 10 s is the gallery's
    templates = subject_of_image * 10 + torch.randint(0, 3, (n,), generator=gen)
    for s in range(subjects):                 # every template has an image
        for k in range(3):
            templates[s * 7 + k] = 10 * subject_of_image[s * 7 + k] + k
    medias = torch.randint(0, 4, (n,), generator=gen) + 100 * templates
    faceness = torch.rand(n, generator=gen, dtype=torch.float64) + 0.5
    present = sorted(set(templates.tolist()))
    gallery = [(t, t // 10) for t in present if t % 10 == 0]
    probes = [(t, t // 10) for t in present if t % 10 != 0 and (t // 10 * 10) in dict(gallery)]
    gallery = gallery + [(gallery[0][0], gallery[0][1])]         # a repeated row counts once
    protocol = IJBIdentification(torch.tensor([t for t, _ in gallery]), torch.tensor([s for _, s in gallery]),
                                 torch.tensor([t for t, _ in probes]), torch.tensor([s for _, s in probes]))
    fpirs, ranks = (0.1, 0.3), (1, 2, 3)
    got = identify(feats, templates, medias, protocol, faceness=faceness, fpirs=fpirs, ranks=ranks)
    rates, tpir = _reference_identification(feats.tolist(), templates.tolist(), medias.tolist(), faceness.tolist(),
                                            gallery, probes, fpirs, ranks)
    assert got.num_probes == len(set(probes)) > 5 and got.num_gallery == len(set(gallery))
    assert got.rank_rate == {k: pytest.approx(v, abs=1e-12) for k, v in rates.items()}
    assert got.tpir_at_fpir == {k: pytest.approx(v, abs=1e-12) for k, v in tpir.items()}
    assert 0 < got.rank_rate[1] < got.rank_rate[3] <= 1
    bad = IJBIdentification(protocol.gallery_templates, protocol.gallery_subjects,
                            torch.tensor([probes[0][0]]), torch.tensor([999]))
    with pytest.raises(ValueError, match="subject 999"):
        identify(feats, templates, medias, bad, faceness=faceness)


def _exits_with(main, argv, needle):
    with pytest.raises(SystemExit) as info:
        main(argv)
    message = str(info.value.code)
    assert message.startswith("error: ") and "\n" not in message and needle in message, message


def test_bad_inputs_are_one_error_line(files, tmp_path):
    # one run as a process: the message is all of stderr, no traceback
    _one_error_line(_run("eval.py", "--model", files["pt"], "--bins", files["bin"]), "pass --network")
    main = _cli("eval")
    _exits_with(main, ["--model", files["pt"], "--network", "r50", "--bins", files["bin"]], "model.pt")
    _exits_with(main, ["--model", files["pt"], "--network", "r18", "--bins", files["bin"]], "model.pt")  # width 1
    _exits_with(main, ["--model", files["pt"], "--network", "r999", "--bins", files["bin"]], "r999")
    _exits_with(main, ["--model", files["export"], "--network", "r18", "--bins", files["bin"]], "--network")
    corrupt = tmp_path / "broken.onnx"
    corrupt.write_bytes(b"\x08\x07not a protobuf at all" * 10)
    try:
        import onnxruntime  # noqa: F401
        needle = "broken.onnx"
    except ImportError:
        needle = "needs onnxruntime"
    _exits_with(main, ["--model", str(corrupt), "--bins", files["bin"]], needle)
    _exits_with(main, ["--model", str(tmp_path / "missing.onnx"), "--bins", files["bin"]], "missing.onnx")
    _exits_with(_cli("export"), ["onnx", "--model", files["export"], "--out", str(tmp_path / "x.onnx"),
                                 "--opset", "5"], "opset")
    _exits_with(_cli("export"), ["onnx", "--model", files["export"], "--out", str(tmp_path / "x.onnx"),
                                 "--batch", "0"], "batch")
