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
    """``main`` of a launch script, run in this process."""
    import importlib.util
    if LAUNCH not in sys.path:
        sys.path.insert(0, LAUNCH)
    spec = importlib.util.spec_from_file_location(f"_launch_{name}", os.path.join(LAUNCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


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

    from ds_pfc import arcface_import as ai
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
    from ds_pfc.eval.models import load_model
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
    from ds_pfc.eval.models import load_model
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
    from ds_pfc.eval.models import load_model
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


def test_ijb_scores_every_kind_like_the_reference(files):
    """``--ijb`` with the ``.pt``, its ds_pfc export and its ONNX file: each model's
    TAR@FAR and AUC as the reference network's features give them."""
    from make_synthetic_ijb import make_synthetic_ijb

    from ds_pfc.eval import ijb
    root = str(files["tmp"] / "ijb")
    make_synthetic_ijb(root, num_identities=3, templates_per_identity=2)
    meta = ijb.read_meta(root, "IJBC")
    feats = ijb.embed_images(files["ref"], meta, batch_size=8, num_workers=0)
    want = ijb.evaluate(feats, meta.templates, meta.medias, meta.pairs, meta.labels, faceness=meta.faceness)
    models = [files["pt"], files["export"]]
    try:
        import onnxruntime  # noqa: F401
        models.append(_onnx_export(files, "ijb.onnx"))
    except ImportError:
        pass                                  # the .pt and the export still run
    args = ["--ijb", root, "--target", "IJBC", "--network", "r18", "--width", "0.25", "--workers", "0",
            "--batch-size", "8", "--out", str(files["tmp"] / "ijb_out")]
    for m in models:
        args += ["--model", m]
    out = _cli("eval")(args)                  # --network and --width go to the .pt alone
    assert [e["path"] for e in out["models"]] == [os.path.abspath(m) for m in models]
    for entry in out["models"]:
        for far, tar in want.tar_at_far.items():
            assert entry["tar_at_far"][f"{far:g}"] == pytest.approx(tar, abs=1e-12), (entry["label"], far)
        assert entry["auc"] == pytest.approx(want.auc, abs=1e-6), entry["label"]
    assert 0.0 < want.auc < 1.0
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
