"""The training app end to end on CPU: ``deepspeed`` launcher with 2 ranks, 1-rank vs
2-rank loss parity (golden per-step losses stored in ``golden/train_losses.json``),
exact resume, resume on another world size, the export / reshard / ONNX / eval commands
(the ``ds_pfc.cli`` mains that the launch scripts call), and bad configs.

Parity holds because the sampler shards the epoch in micro-batch blocks: one rank
accumulating 2 micro batches sees exactly the batches 2 ranks see in one step
(BatchNorm statistics included), epochs end on whole steps, and ``sample_rate=1``
makes the head exact.
"""
from __future__ import annotations

import copy
import json
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from _dist import TRAIN, command_code, kill_all, run_script_ranks, start_script_ranks
from _inprocess import train_here

pytest.importorskip("deepspeed")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "train_losses.json")
STEPS = 6

TINY = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "steps_per_print": 10 ** 9,
    "optimizer": {"type": "SGD", "params": {"lr": 0.02, "momentum": 0.9, "weight_decay": 5e-4}},
    "zero_optimization": {"stage": 0},
    "csv_monitor": {"enabled": True, "job_name": "train"},
    "ds_pfc": {
        "head": {"num_classes": 24, "embedding_size": 32, "sample_rate": 1.0,
                 "margin": {"type": "cosface", "scale": 16.0, "margin": 0.2}},
        # A ViT (LayerNorm) at this size is numerically well conditioned; a narrow CNN with
        # BatchNorm over 8 images amplifies float rounding so much that two correct runs
        # (e.g. on 1 and 2 threads) part after a few steps.
        "backbone": {"name": "vit_t", "width": 0.25},
        "data": {"synthetic": {"images_per_identity": 3, "held_out_identities": 10}, "workers": 1,
                 "prefetch_batches": 2},
        "train": {"epochs": 10, "max_steps": STEPS, "log_every": 1,
                  "schedule": {"type": "poly", "warmup_epochs": 0.5, "power": 2.0}},
        "evaluation": {"synthetic_pairs": 40, "batch_size": 16},
        "checkpoint": {"every_steps": 2, "keep": 0},
    },
}


def _config(tmp_path, name, **ds):
    config = copy.deepcopy(TINY)
    config.update(ds)
    path = os.path.join(tmp_path, f"{name}.json")
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def _env():
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".torch_extensions"))
    return env


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args, ranks=1, timeout=600):
    """``launch/train.py *args`` on ``ranks`` ranks; its console output. One rank runs the
    command's entry in this process, in a one-process world on one thread, as a launched
    rank with OMP_NUM_THREADS=1 computes (a fresh interpreter would spend seconds importing
    torch, DeepSpeed and torch._dynamo again); more ranks go through the deepspeed launcher.
    The commands' own process behaviour (exit codes, stderr, signals) is tested below with
    real processes."""
    if ranks == 1:
        return train_here(args)
    script = os.path.join(ROOT, "launch", "train.py")
    cmd = [shutil.which("deepspeed") or "deepspeed", "--num_gpus", str(ranks), "--master_port", str(_free_port()),
           script, *args]
    try:
        proc = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:      # say where the ranks were when it stopped
        text = lambda b: (b.decode(errors="replace") if isinstance(b, bytes) else b or "")[-4000:]
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s:\n{text(err.stdout)}\n{text(err.stderr)}")
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def _rank_envs(ranks, **extra):
    """Each rank's environment in a gloo job of ``ranks`` ranks on a free port, as a
    launcher sets it up, plus ``extra``."""
    port = _free_port()
    return [{**_env(), "RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
             "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **extra}
            for rank in range(ranks)]


def _forked(args, ranks):
    """``launch/train.py *args`` on a gloo job of ``ranks`` ranks set up as the launcher sets
    them up (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ...), each rank a process forked from
    the tests' fork server instead of a fresh interpreter; rank 0's console output."""
    codes, results = run_script_ranks(TRAIN, args, _rank_envs(ranks), ROOT)
    assert codes == [0] * ranks, (codes, [err[-3000:] for _, err in results])
    return results[0][0]


def _summary(out_dir):
    with open(os.path.join(out_dir, "summary.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """6 steps on 2 ranks through the deepspeed launcher, checkpoints every 2 steps."""
    tmp = str(tmp_path_factory.mktemp("two_rank"))
    out = os.path.join(tmp, "run")
    stdout = _run(["--deepspeed_config", _config(tmp, "two"), "--output_dir", out], ranks=2)
    return out, stdout


@pytest.fixture(scope="module")
def one_rank_run(tmp_path_factory):
    """The same global batches on 1 rank accumulating 2 micro batches."""
    tmp = str(tmp_path_factory.mktemp("one_rank"))
    out = os.path.join(tmp, "run")
    _run(["--deepspeed_config", _config(tmp, "one", gradient_accumulation_steps=2), "--output_dir", out])
    return out


def test_two_rank_launcher_run_trains_checkpoints_and_exports(two_rank_run):
    out, stdout = two_rank_run
    summary = _summary(out)
    assert summary["steps"] == STEPS and not summary["resumed"]
    assert "samples/s" in stdout and "eta" in stdout and "eval step 6" in stdout
    tag_dir = summary["checkpoint"]
    files = os.listdir(tag_dir)
    assert {"head-rank00000-of-00002.safetensors", "head-rank00001-of-00002.safetensors",
            "rank_state-00000-of-00002.pt", "rank_state-00001-of-00002.pt", "ds_pfc_complete.json",
            "mp_rank_00_model_states.pt"} <= set(files)
    with open(os.path.join(out, "checkpoints", "latest")) as f:
        assert f.read() == os.path.basename(tag_dir)
    assert sorted(os.listdir(os.path.join(out, "checkpoints")))[:3] == ["latest", "step00000002", "step00000004"]
    # the csv monitor wrote the loss series (the summary's losses), the accuracy and the lr
    monitor = {f: os.path.join(d, f) for d, _, fs in os.walk(os.path.join(out, "monitor")) for f in fs}
    assert {"Train_Samples_train_loss.csv", "Train_Samples_train_accuracy.csv", "Train_Samples_lr.csv",
            "Eval_Samples_synthetic_held_out_accuracy.csv"} <= set(monitor), sorted(monitor)
    with open(monitor["Train_Samples_train_loss.csv"]) as f:
        rows = [line.strip().split(",") for line in f][1:]
    assert [int(r[0]) for r in rows] == [16 * (i + 1) for i in range(STEPS)]      # at the global sample count
    assert [float(r[1]) for r in rows] == pytest.approx(summary["losses"], rel=1e-6)
    acc = summary["evaluations"][str(STEPS)]["synthetic_held_out"]["accuracy"]
    assert 0.0 <= acc <= 1.0
    # training.log: rank 0's lines once (not one copy per rank), under one header; no
    # loss scale in an fp32 run's progress lines
    with open(os.path.join(out, "training.log")) as f:
        log = f.read().splitlines()
    assert len([line for line in log if line.startswith("=== ")]) == 1 and "world size 2" in log[0]
    step_lines = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(step_lines) == STEPS and [line for line in log if line.startswith("step ")] == step_lines
    assert not any("loss_scale" in line for line in step_lines)
    assert log[-1] == f"summary {os.path.join(out, 'summary.json')}"


def test_one_rank_matches_two_ranks_and_the_golden_losses(two_rank_run, one_rank_run):
    two = _summary(two_rank_run[0])["losses"]
    one = _summary(one_rank_run)["losses"]
    assert len(one) == len(two) == STEPS
    torch.testing.assert_close(torch.tensor(one), torch.tensor(two), rtol=1e-4, atol=1e-5)
    assert one[-1] < one[0]      # it learns
    with open(GOLDEN) as f:
        golden = json.load(f)["losses"]
    # Stored from a run of this config; kernels may differ slightly between CPUs.
    torch.testing.assert_close(torch.tensor(one), torch.tensor(golden), rtol=2e-3, atol=1e-3)


@pytest.mark.parametrize("keys", [("train_batch_size", "train_micro_batch_size_per_gpu"),
                                  ("train_batch_size", "gradient_accumulation_steps"),
                                  ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")],
                         ids=["batch+micro", "batch+accumulation", "all-three"])
def test_batch_geometry_comes_from_deepspeed(one_rank_run, tmp_path, keys):
    """A global batch of 16 on 1 rank, given by any two (or all three) of DeepSpeed's
    batch keys: DeepSpeed resolves micro batches of 8 accumulated twice, so the run is
    the 2-accumulation run, step for step, with the same checkpoints."""
    given = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}
    config = copy.deepcopy(TINY)
    for key in given:
        config.pop(key, None)
    config.update({key: given[key] for key in keys})
    path = os.path.join(tmp_path, "tbs.json")
    with open(path, "w") as f:
        json.dump(config, f)
    out = os.path.join(tmp_path, "run")
    stdout = _run(["--deepspeed_config", path, "--output_dir", out])
    assert "of 8 x 2 x 1 = 16 images" in stdout
    assert _summary(out)["losses"] == _summary(one_rank_run)["losses"]
    assert sorted(t for t in os.listdir(os.path.join(out, "checkpoints")) if t.startswith("step")) == \
        sorted(t for t in os.listdir(os.path.join(one_rank_run, "checkpoints")) if t.startswith("step"))


def test_train_batch_size_alone_is_one_micro_batch_per_rank(tmp_path):
    """Only train_batch_size: DeepSpeed makes it one micro batch per rank, no
    accumulation; the app's epoch, steps and losses are those of the same geometry
    given explicitly."""
    runs = {}
    for name, keys in (("alone", {"train_batch_size": 16}),
                       ("explicit", {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1})):
        config = copy.deepcopy(TINY)
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            config.pop(key, None)
        config.update(keys)
        path = os.path.join(tmp_path, f"{name}.json")
        with open(path, "w") as f:
            json.dump(config, f)
        out = os.path.join(tmp_path, name)
        stdout = _run(["--deepspeed_config", path, "--output_dir", out])
        assert "of 16 x 1 x 1 = 16 images" in stdout
        runs[name] = _summary(out)
    assert runs["alone"]["steps"] == runs["explicit"]["steps"] > 0
    assert runs["alone"]["losses"] == runs["explicit"]["losses"]


def test_resume_continues_the_loss_curve_exactly(one_rank_run, tmp_path):
    out = os.path.join(tmp_path, "run")
    config = _config(tmp_path, "one", gradient_accumulation_steps=2)
    _run(["--deepspeed_config", config, "--output_dir", out, "--max_steps", "3"])
    first = _summary(out)["losses"]
    _run(["--deepspeed_config", config, "--output_dir", out])
    resumed = _summary(out)
    # the summary covers the whole run, the first 3 steps included
    assert resumed["resumed"] and len(resumed["losses"]) == STEPS and resumed["losses"][:3] == first
    assert first == _summary(one_rank_run)["losses"][:3]
    assert resumed["losses"] == _summary(one_rank_run)["losses"]     # bitwise


def test_resume_on_another_world_size(two_rank_run, tmp_path):
    """The 2-rank checkpoint of step 2, resumed on 1 rank (accumulating 2): the curve
    continues as the 2-rank run's did."""
    src = os.path.join(two_rank_run[0], "checkpoints")
    dst = os.path.join(tmp_path, "run", "checkpoints")
    shutil.copytree(os.path.join(src, "step00000002"), os.path.join(dst, "step00000002"))
    with open(os.path.join(dst, "latest"), "w") as f:
        f.write("step00000002")
    config = _config(tmp_path, "one", gradient_accumulation_steps=2)
    _run(["--deepspeed_config", config, "--output_dir", os.path.join(tmp_path, "run")])
    resumed = _summary(os.path.join(tmp_path, "run"))
    assert resumed["resumed"]
    # the first 2 losses come with the checkpoint (the whole run's history)
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(_summary(two_rank_run[0])["losses"]),
                               rtol=1e-4, atol=1e-5)


def test_zero1_checkpoint_resumes_on_another_world_size(two_rank_run, tmp_path):
    """ZeRO 1 partitions its optimizer state over the ranks; a 2-rank checkpoint is
    converted to DeepSpeed's universal checkpoint by the app itself and resumed on 1
    rank: the curve continues as the 2-rank run's did (the ZeRO 0 run's, same math)."""
    out = os.path.join(tmp_path, "run")
    z1 = {"zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
    _forked(["--deepspeed_config", _config(tmp_path, "two_z1", **z1), "--output_dir", out, "--max_steps", "2"], ranks=2)
    stdout = _run(["--deepspeed_config", _config(tmp_path, "one_z1", gradient_accumulation_steps=2, **z1),
                   "--output_dir", out])
    assert "converted it to a universal checkpoint for 1 rank(s)" in stdout
    resumed = _summary(out)
    assert resumed["resumed"] and resumed["steps"] == STEPS
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(_summary(two_rank_run[0])["losses"]),
                               rtol=1e-4, atol=1e-5)


def _script(name, *args):
    """``launch/<name>.py *args`` (the ``ds_pfc.cli.<name>`` command) in a process forked
    from the fork server; its exit code, stdout and stderr."""
    from types import SimpleNamespace
    [returncode], [(stdout, stderr)] = run_script_ranks(command_code(f"ds_pfc.cli.{name}"), args, [_env()], ROOT, 300)
    return SimpleNamespace(returncode=returncode, stdout=stdout, stderr=stderr)


def test_export_reshard_round_trip_onnx_and_eval(two_rank_run, tmp_path):
    from safetensors.torch import load_file

    from ds_pfc.checkpoint.shards import merge_shards
    out = two_rank_run[0]
    ckpt_dir = os.path.join(out, "checkpoints")
    tag = "step00000006"
    original, _ = merge_shards(os.path.join(ckpt_dir, tag))

    # 2 -> 3 -> 2 -> 5 -> 2 ranks: exact
    src = ckpt_dir
    for world in (3, 2, 5, 2):
        dst = os.path.join(tmp_path, f"w{world}_{len(os.listdir(tmp_path))}")
        proc = _script("export", "reshard", "--checkpoint", src, "--world_size", str(world), "--out", dst)
        assert proc.returncode == 0, proc.stderr
        shards = [f for f in os.listdir(os.path.join(dst, tag)) if f.startswith("head-rank")]
        assert len(shards) == world
        merged, meta = merge_shards(os.path.join(dst, tag))
        assert meta["world_size"] == world
        for k in original:
            assert torch.equal(merged[k], original[k]), (world, k)
        src = dst
    final = load_file(os.path.join(src, tag, "head-rank00001-of-00002.safetensors"))
    first = load_file(os.path.join(ckpt_dir, tag, "head-rank00001-of-00002.safetensors"))
    assert final.keys() == first.keys() and all(torch.equal(final[k], first[k]) for k in first)

    # safetensors export: backbone + full classifier
    export = os.path.join(tmp_path, "model.safetensors")
    proc = _script("export", "safetensors", "--checkpoint", ckpt_dir, "--out", export)
    assert proc.returncode == 0, proc.stderr
    tensors = load_file(export)
    assert torch.equal(tensors["heads.head.weight"], original["weight"].float())
    assert tensors["heads.head.weight"].shape == (24, 32)
    module = torch.load(os.path.join(ckpt_dir, tag, "mp_rank_00_model_states.pt"), weights_only=False)["module"]
    assert {f"backbone.{k}" for k in module} == {k for k in tensors if k.startswith("backbone.")}
    for k, v in module.items():
        assert torch.equal(tensors[f"backbone.{k}"], v.float()), k
    # the training app's own export is the same file content
    own = load_file(_summary(out)["export"])
    assert own.keys() == tensors.keys() and all(torch.equal(own[k], tensors[k]) for k in own)

    # eval.py on the export reproduces the app's final evaluation
    result = os.path.join(tmp_path, "eval.json")
    proc = _script("eval", "--model", export, "--json", result)
    assert proc.returncode == 0, proc.stderr
    with open(result) as f:
        acc = json.load(f)["synthetic_held_out"]["accuracy"]
    # Reference: the exported weights in a freshly built backbone, plain flip-TTA embeddings.
    from ds_pfc.app.config import split_config
    from ds_pfc.data.faces import SyntheticFaces
    from ds_pfc.eval.verification import verification_metrics
    _, cfg = split_config(copy.deepcopy(TINY))
    backbone = cfg.backbone.build(cfg.head.embedding_size)
    backbone.load_state_dict({k[len("backbone."):]: v for k, v in tensors.items() if k.startswith("backbone.")})
    backbone.eval()
    s = cfg.data.synthetic
    images, issame = SyntheticFaces(s.held_out_identities, s.images_per_identity, image_size=s.image_size,
                                    first_identity=s.identities, seed=s.seed).pairs(40, seed=s.seed)
    with torch.no_grad():
        x = images.float() / 127.5 - 1.0
        emb = torch.nn.functional.normalize(backbone(x) + backbone(x.flip(3)))
    ref = verification_metrics(emb[0::2], emb[1::2], issame).accuracy
    assert acc == pytest.approx(ref, abs=1e-9)
    # and the app's own last evaluation saw that model: the ranks' BatchNorm statistics
    # are rank 0's before evaluating and saving, as in the export
    in_run = _summary(out)["evaluations"][str(STEPS)]["synthetic_held_out"]["accuracy"]
    assert in_run == pytest.approx(acc, abs=1e-9)

    # ONNX
    onnx = pytest.importorskip("onnx")
    path = os.path.join(tmp_path, "backbone.onnx")
    proc = _script("export", "onnx", "--model", export, "--out", path)
    assert proc.returncode == 0, proc.stderr
    model = onnx.load(path)
    onnx.checker.check_model(model)
    assert [i.name for i in model.graph.input] == ["images"] and [o.name for o in model.graph.output] == ["embeddings"]
    assert model.graph.output[0].type.tensor_type.shape.dim[1].dim_value == 32


@pytest.mark.parametrize("edit, needle", [
    (lambda c: c["ds_pfc"]["head"].update(sampel_rate=0.1), "sampel_rate"),
    (lambda c: c["ds_pfc"].update(trian={}), "trian"),
    (lambda c: c["ds_pfc"]["backbone"].update(name="resnet9000"), "ds_pfc.backbone.name"),
    (lambda c: c["ds_pfc"]["data"].update(source="recordio"), "ds_pfc.data.path"),
    (lambda c: c["ds_pfc"]["data"].update(source="recordio", path="/nonexistent/train.rec"), "does not exist"),
    (lambda c: c.pop("optimizer"), "optimizer"),
    (lambda c: c.update(scheduler={"type": "WarmupLR"}), "not both"),
])
def test_bad_configs_fail_with_a_clear_message(tmp_path, edit, needle):
    config = copy.deepcopy(TINY)
    edit(config)
    path = os.path.join(tmp_path, "bad.json")
    with open(path, "w") as f:
        json.dump(config, f)
    # (a process of its own, forked; test_missing_config_file runs launch/train.py as it is)
    [code], [(_, stderr)] = run_script_ranks(TRAIN, ["--deepspeed_config", path, "--output_dir", str(tmp_path)],
                                             [_env()], ROOT, 300)
    assert code != 0
    assert needle in stderr, stderr[-2000:]
    assert "Traceback" not in stderr


def test_missing_config_file(tmp_path):
    # --deepspeed: DeepSpeed's usual invocation (deepspeed.add_config_arguments) is accepted
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train.py"), "--deepspeed",
                           "--deepspeed_config", str(tmp_path / "nope.json")], env=_env(), cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "config file not found" in proc.stderr and "Traceback" not in proc.stderr


def test_time_based_checkpoints_and_resume_flags(tmp_path):
    """ds_pfc.checkpoint.every_minutes saves by wall time (here: at once, after every step);
    with resuming off in the config, a rerun over those checkpoints is refused before the
    model is built, naming --resume; --resume then continues the run."""
    out = os.path.join(tmp_path, "run")
    config = copy.deepcopy(TINY)
    config["ds_pfc"]["checkpoint"] = {"every_steps": 0, "every_minutes": 1e-9, "keep": 0, "resume": False,
                                      "export": False}
    config["ds_pfc"]["evaluation"]["every_steps"] = 2     # but none before the first step (at_start: false)
    path = os.path.join(tmp_path, "job.json")
    with open(path, "w") as f:
        json.dump(config, f)
    stdout = _run(["--deepspeed_config", path, "--output_dir", out, "--max_steps", "3"])
    assert "min of wall time since the last one" in stdout
    saved = {name for name in os.listdir(os.path.join(out, "checkpoints")) if name.startswith("step")}
    assert saved == {"step00000001", "step00000002", "step00000003"}

    refused = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train.py"), "--deepspeed_config", path,
                              "--output_dir", out, "--max_steps", "4"], env=_env(), cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
    assert refused.returncode != 0
    assert "holds checkpoints (newest: step00000003)" in refused.stderr and "--resume" in refused.stderr
    assert "data:" not in refused.stdout            # refused before the data and the model were built
    assert "Traceback" not in refused.stderr

    config["ds_pfc"]["checkpoint"]["every_minutes"] = 60.0          # none by time in a short run
    with open(path, "w") as f:
        json.dump(config, f)
    stdout = _run(["--deepspeed_config", path, "--output_dir", out, "--max_steps", "5", "--resume"])
    assert "resumed from" in stdout and "step00000003" in stdout
    summary = _summary(out)
    assert summary["resumed"] and summary["steps"] == 5
    assert sorted(summary["evaluations"], key=int) == ["2", "3", "4", "5"]
    assert not os.path.exists(os.path.join(out, "checkpoints", "step00000004"))


def _start_ranks(args, ranks):
    """The ranks of a gloo job started directly, as torchrun would (RANK, WORLD_SIZE, ...),
    so that a test can signal one of them (processes forked from the fork server)."""
    return start_script_ranks(TRAIN, args, _rank_envs(ranks), ROOT)


def test_a_real_signal_preempts_every_rank_and_the_rerun_continues_the_trajectory(two_rank_run, tmp_path):
    """SIGUSR1 to one rank of a 2-rank gloo job mid-epoch: both ranks finish the step, one
    complete checkpoint of that step is written, both exit with code 75; the rerun resumes it
    and its losses are those of the uninterrupted 2-rank run."""
    import signal
    import time as _time
    out = os.path.join(tmp_path, "run")
    config = copy.deepcopy(TINY)
    config["ds_pfc"]["checkpoint"] = {"every_steps": 0, "keep": 0, "export": False}
    path = os.path.join(tmp_path, "job.json")
    with open(path, "w") as f:
        json.dump(config, f)
    procs = _start_ranks(["--deepspeed_config", path, "--output_dir", out], 2)
    log = os.path.join(out, "training.log")
    deadline = _time.monotonic() + 300
    try:
        while _time.monotonic() < deadline:      # wait for step 2's line, then signal rank 1 alone
            if os.path.exists(log) and "step 2/" in open(log).read():
                break
            if any(p.poll() is not None for p in procs):
                kill_all(procs)
                pytest.fail(f"a rank ended before step 2: {[p.communicate()[1][-3000:] for p in procs]}")
            _time.sleep(0.2)
        procs[1].send_signal(signal.SIGUSR1)
        results = [p.communicate(timeout=300) for p in procs]
    finally:
        kill_all(procs)
    codes = [p.returncode for p in procs]
    assert codes == [75, 75], (codes, [r[1][-3000:] for r in results])
    stopped = int(re.search(r"preempted by SIGUSR1 at step (\d+)", results[0][0]).group(1))
    assert 2 <= stopped < STEPS
    assert "preempted: preempted by SIGUSR1" in results[0][1]
    assert "preempted:" not in results[1][1]                       # rank 0 alone says it
    saved = {n for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith("step")}
    assert saved == {f"step{stopped:08d}"}
    assert "preempted by SIGUSR1" in open(log).read()

    procs = _start_ranks(["--deepspeed_config", path, "--output_dir", out], 2)
    try:
        results = [p.communicate(timeout=600) for p in procs]
    finally:
        kill_all(procs)
    assert [p.returncode for p in procs] == [0, 0], [r[1][-3000:] for r in results]
    resumed = _summary(out)
    assert resumed["resumed"] and resumed["steps"] == STEPS
    assert resumed["losses"] == _summary(two_rank_run[0])["losses"]      # the same trajectory, bitwise


# Rank ``NAN_RANK`` of the job gets NaN images in the micro batch number ``NAN_AT`` (0-based,
# counted over the whole process, so that a batch replayed after a rollback stays clean): the
# backbone then yields NaN embeddings there, which the head refuses on every rank. With
# ``NAN_DROP`` set, that batch is consumed but left out on every rank instead (the reference of
# a skip).
_NAN_RUNNER = """
import os, sys
import torch
import ds_pfc.app.training as T
original = T.Trainer._batches
seen = [0]
def batches(self):
    for images, labels in original(self):
        index, seen[0] = seen[0], seen[0] + 1
        at = int(os.environ["NAN_AT"])
        if index == at or (os.environ.get("NAN_FOREVER") and at >= 0 and index > at):
            if os.environ.get("NAN_DROP"):
                self.sampler.advance(self.micro)      # consumed, never trained on
                continue
            if self.rank == int(os.environ["NAN_RANK"]):
                images = torch.full_like(images, float("nan"))
        yield images, labels
T.Trainer._batches = batches
from ds_pfc.cli.train import main
sys.exit(main(sys.argv[1:]))
"""


def _nan_job(config: dict, tmp_path, name: str, *args, ranks=2, **env):
    """A gloo job of ``ranks`` ranks through the train command's main under ``_NAN_RUNNER``
    (each rank a process of its own, forked from the tests' fork server); returns ``(exit
    codes, [(stdout, stderr)] per rank)``."""
    path = os.path.join(tmp_path, f"{name}.json")
    with open(path, "w") as f:
        json.dump(config, f)
    envs = _rank_envs(ranks, **{"NAN_AT": "-1", "NAN_RANK": "0", **env})
    return run_script_ranks(_NAN_RUNNER, ["--deepspeed_config", path, *args], envs, ROOT)


def test_failures_are_one_line_on_rank_0_with_the_traceback_in_a_file(tmp_path):
    """A NaN injected at step 3 on rank 1 of 2: with the default validate 'deferred' every rank
    finds it one step late, at step 4 before anything of step 4 runs (step 3 was applied, no
    checkpoint holds it); rank 0 alone prints one error line naming the step it was found at,
    the head's forward it belongs to, rank 1's NaN, the newest checkpoint and the fixes;
    the line is in training.log and each rank's traceback is in errors/rank<R>.txt. A typo in
    DeepSpeed's optimizer params is one line naming the key and the closest one, in training.log too."""
    out = os.path.join(tmp_path, "run")
    codes, ((out0, err0), (out1, err1)) = _nan_job(TINY, tmp_path, "nan", "--output_dir", out, NAN_AT="2",
                                                   NAN_RANK="1")
    assert codes == [1, 1], (err0[-3000:], err1[-3000:])
    lines = [line for line in err0.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err0[-3000:]
    line = lines[0]
    assert "step 4:" in line and "rank 1: embeddings contain NaN or Inf values" in line
    assert "checked one step late, validate='deferred': the batch of training forward 2 " in line
    assert "step00000002" in line and "lower learning rate" in line
    assert f"traceback: {os.path.join(out, 'errors', 'rank0.txt')}" in line
    assert "Traceback" not in err0 and "error:" not in err1 and "Traceback" not in err1
    assert line in open(os.path.join(out, "training.log")).read()
    for rank in (0, 1):
        text = open(os.path.join(out, "errors", f"rank{rank}.txt")).read()
        assert "Traceback" in text and "NaN or Inf" in text
    # nothing of step 3 was saved: the newest checkpoint is step 2's
    saved = {n for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith("step")}
    assert saved == {"step00000002"}

    bad = copy.deepcopy(TINY)
    bad["optimizer"]["params"]["lrr"] = 0.1
    path = os.path.join(tmp_path, "typo.json")
    with open(path, "w") as f:
        json.dump(bad, f)
    out = os.path.join(tmp_path, "typo")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train.py"), "--deepspeed_config", path,
                           "--output_dir", out], env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "optimizer.params: unknown key ['lrr']" in lines[0], proc.stderr[-3000:]
    assert "did you mean 'lr'?" in lines[0] and lines[0] in open(os.path.join(out, "training.log")).read()
    assert "Traceback" not in proc.stderr
    assert "lrr" in open(os.path.join(out, "errors", "rank0.txt")).read()


def _trained_state(tag_dir: str) -> dict:
    """Every tensor of a checkpoint that training changes: the backbone, DeepSpeed's optimizer
    and scheduler state, and each head shard's rows and momentum (not the data position)."""
    from safetensors.torch import load_file
    found = {}

    def walk(prefix, value):
        if isinstance(value, torch.Tensor):
            found[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            found[prefix] = torch.tensor(value, dtype=torch.float64)
    for name in sorted(os.listdir(tag_dir)):
        path = os.path.join(tag_dir, name)
        if name.endswith(".safetensors"):
            walk(name, load_file(path))
        elif name.endswith("model_states.pt"):
            saved = torch.load(path, map_location="cpu", weights_only=False)
            walk(name, {k: saved[k] for k in ("module", "optimizer", "lr_scheduler", "global_steps") if k in saved})
    return found


def _nonfinite_config(policy: str, **train) -> dict:
    config = copy.deepcopy(TINY)
    config["ds_pfc"]["train"].update(on_nonfinite=policy, **train)
    return config


def test_on_nonfinite_skip_drops_the_step_on_every_rank(tmp_path):
    """on_nonfinite skip, NaN images at step 3 on rank 1 of 2: both ranks drop that step and go
    on. Nothing of it reaches the backbone, the optimizer, the head's rows or momentum: the run
    equals, bitwise, one whose data simply lacks that batch (every loss, the final state)."""
    config = _nonfinite_config("skip")
    skip, ref = os.path.join(tmp_path, "skip"), os.path.join(tmp_path, "ref")
    codes, results = _nan_job(config, tmp_path, "skip", "--output_dir", skip, NAN_AT="2", NAN_RANK="1")
    assert codes == [0, 0], [r[1][-3000:] for r in results]
    codes, results = _nan_job(config, tmp_path, "skip", "--output_dir", ref, NAN_AT="2", NAN_DROP="1")
    assert codes == [0, 0], [r[1][-3000:] for r in results]
    skipped, reference = _summary(skip), _summary(ref)
    assert skipped["steps"] == reference["steps"] == STEPS
    assert skipped["losses"] == reference["losses"]
    assert [r["step"] for r in skipped["nonfinite"]["skipped"]] == [3]
    assert "rank 1: embeddings contain NaN or Inf values" in skipped["nonfinite"]["skipped"][0]["reason"]
    assert reference["nonfinite"] == {"skipped": [], "rollbacks": []}
    log = open(os.path.join(skip, "training.log")).read()
    assert "step 3: skipped on every rank" in log and "1 step(s) skipped in this run" in log
    got, want = _trained_state(skipped["checkpoint"]), _trained_state(reference["checkpoint"])
    assert got.keys() == want.keys() and any("momentum" in k for k in got)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_a_skipped_step_leaves_batchnorm_statistics_as_they_were():
    """The NaN forward a skip drops has already moved BatchNorm's running statistics (and
    its batch counter); the guard puts back those of the step's start, bitwise."""
    from ds_pfc.app.training import _NonFiniteGuard
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.BatchNorm1d(2))
    module[1](torch.randn(5, 4, 6, 6))          # statistics that are not the initial ones
    guard = _NonFiniteGuard(module)
    guard.before_step()
    want = {k: v.clone() for k, v in module.state_dict().items() if "running" in k or "num_batches" in k}
    module[:2](torch.full((2, 3, 8, 8), float("nan")))
    assert torch.isnan(module[1].running_mean).all() and int(module[1].num_batches_tracked) == 2
    guard.restore_buffers()
    got = module.state_dict()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_on_nonfinite_skip_stops_after_too_many_steps_in_a_row(tmp_path):
    """NaN on every batch of rank 0 from step 2 on (a diverged model, as skip sees it): the run
    stops after max_consecutive_skips skipped steps in a row with one error line."""
    runner_env = {"NAN_AT": "1", "NAN_RANK": "0"}
    config = _nonfinite_config("skip", max_consecutive_skips=2)
    # every batch from index 1 on: NAN_AT is matched once, so make the rank's images NaN for good
    config["ds_pfc"]["train"]["max_steps"] = STEPS
    out = os.path.join(tmp_path, "run")
    codes, results = _nan_job(config, tmp_path, "skips", "--output_dir", out, NAN_FOREVER="1", **runner_env)
    assert codes == [1, 1], [r[1][-3000:] for r in results]
    line = [x for x in results[0][1].splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "3 steps in a row were non-finite" in line[0], results[0][1][-3000:]
    assert "step 2:" in line[0] and "rollback" in line[0]
    assert open(os.path.join(out, "training.log")).read().count("skipped on every rank") == 2


def test_on_nonfinite_rollback_reloads_the_newest_checkpoint_with_a_lower_lr(two_rank_run, tmp_path):
    """on_nonfinite rollback, NaN images at step 5 on rank 1 of 2: every rank reloads step 4's
    checkpoint, halves the learning rate and trains on. Steps 1-4 are the plain run's; steps 5-6
    those of an independent resume of the plain run's step-4 checkpoint with half the lr."""
    config = _nonfinite_config("rollback")
    out = os.path.join(tmp_path, "run")
    codes, results = _nan_job(config, tmp_path, "rollback", "--output_dir", out, NAN_AT="4", NAN_RANK="1")
    assert codes == [0, 0], [r[1][-3000:] for r in results]
    rolled = _summary(out)
    plain = _summary(two_rank_run[0])
    assert rolled["steps"] == STEPS and rolled["losses"][:4] == plain["losses"][:4]
    [record] = rolled["nonfinite"]["rollbacks"]
    assert (record["step"], record["to"], record["lr_scale"]) == (5, "step00000004", 0.5)
    log = open(os.path.join(out, "training.log")).read()
    assert "step 5:" in log and "rolled back every rank to" in log and "learning rate x0.5" in log
    rows = _csv_rows(os.path.join(out, "monitor", "train", "Train_Samples_train_loss.csv"))
    assert rows[0] == ["step", "train_loss"] and [int(r[0]) for r in rows[1:]] == [16 * k for k in range(1, 7)]
    assert [float(r[1]) for r in rows[1:]] == rolled["losses"]

    ref = os.path.join(tmp_path, "ref")
    os.makedirs(os.path.join(ref, "checkpoints"))
    shutil.copytree(os.path.join(two_rank_run[0], "checkpoints", "step00000004"),
                    os.path.join(ref, "checkpoints", "step00000004"))
    halved = copy.deepcopy(config)
    halved["optimizer"]["params"]["lr"] = TINY["optimizer"]["params"]["lr"] / 2
    codes, results = _nan_job(halved, tmp_path, "halved", "--output_dir", ref, "--allow_config_change")
    assert codes == [0, 0], [r[1][-3000:] for r in results]
    assert rolled["losses"][4:] == _summary(ref)["losses"][4:] and len(rolled["losses"]) == STEPS
    # the factor stays with the run: its step-6 checkpoint says so
    meta = torch.load(os.path.join(rolled["checkpoint"], "mp_rank_00_model_states.pt"), map_location="cpu",
                      weights_only=False)
    assert meta["ds_pfc_lr_scale"] == 0.5


def test_on_nonfinite_rollback_without_a_checkpoint_stops(tmp_path):
    """A NaN at step 1 with rollback: there is nothing to roll back to, and the run says so."""
    out = os.path.join(tmp_path, "run")
    codes, results = _nan_job(_nonfinite_config("rollback"), tmp_path, "early", "--output_dir", out, NAN_AT="0",
                              NAN_RANK="0")
    assert codes == [1, 1]
    line = [x for x in results[0][1].splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "no complete checkpoint to roll back to" in line[0], results[0][1][-3000:]


def test_on_nonfinite_skip_and_rollback_are_refused_where_they_cannot_be_exact(tmp_path):
    """skip/rollback need one micro batch per step; rollback needs ds_pfc's schedule."""
    accumulating = _nonfinite_config("skip")
    accumulating["gradient_accumulation_steps"] = 2
    with_scheduler = _nonfinite_config("rollback")
    del with_scheduler["ds_pfc"]["train"]["schedule"]
    with_scheduler["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}
    for name, config, needle in (("gas", accumulating, "needs gradient_accumulation_steps 1"),
                                 ("sched", with_scheduler, "replace DeepSpeed's 'scheduler' block")):
        codes, results = _nan_job(config, tmp_path, name, "--output_dir", os.path.join(tmp_path, name), ranks=1)
        assert codes == [1]
        line = [x for x in results[0][1].splitlines() if x.startswith("error:")]
        assert len(line) == 1 and needle in line[0] and "on_nonfinite" in line[0], results[0][1][-3000:]


_HEARTBEAT_RUNNER = """
import sys, time
from ds_pfc.app.run_outputs import Heartbeat
from ds_pfc.checkpoint import export
from ds_pfc.deepspeed_plugin.engine import PfcEngine
Heartbeat.first_s, Heartbeat.every_s = 0.05, 1000.0
def slowly(fn):                       # a checkpoint or an export of a real model's size
    def call(*args, **kwargs):
        time.sleep(0.3)
        return fn(*args, **kwargs)
    return call
PfcEngine.save_checkpoint = slowly(PfcEngine.save_checkpoint)
export.export_checkpoint = slowly(export.export_checkpoint)
from ds_pfc.cli.train import main
sys.exit(main(sys.argv[1:]))
"""


def test_long_phases_of_the_train_command_are_announced_while_they_run(tmp_path):
    """Every phase that can take long on rank 0 (head and engine build with DeepSpeed's first op
    builds, checkpoints, the export) says so while it runs, on the console and in training.log
    (the heartbeat's first line is due after 0.05 s here instead of 10 s, and a checkpoint and
    the export take 0.3 s more, as those of a real model would). A fresh interpreter, not a
    forked one: its engine build imports what a first run imports."""
    out = os.path.join(tmp_path, "run")
    config = copy.deepcopy(TINY)
    config["ds_pfc"]["evaluation"]["synthetic_pairs"] = 0
    path = os.path.join(tmp_path, "job.json")
    with open(path, "w") as f:
        json.dump(config, f)
    proc = subprocess.run([sys.executable, "-c", _HEARTBEAT_RUNNER, "--deepspeed_config", path, "--output_dir", out,
                           "--max_steps", "1"], env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = open(os.path.join(out, "training.log")).read()
    for phase in ("building the DeepSpeed engine (a first run JIT-compiles DeepSpeed's ops",
                  "checkpoint step00000001", "export " + os.path.join(out, "export", "model.safetensors")):
        assert re.search(re.escape(phase) + r".*: still running after \d+ s", log), (phase, log[-3000:])
    assert "still running after" in proc.stdout


_BUG_RUNNER = """
import sys
import ds_pfc.app.training as T
def run(self):
    raise RuntimeError("boom: a bug")
T.Trainer.run = run
from ds_pfc.cli.train import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_bug_keeps_its_traceback_and_writes_it_to_the_file(tmp_path):
    out = os.path.join(tmp_path, "run")
    [code], [(_, stderr)] = run_script_ranks(
        _BUG_RUNNER, ["--deepspeed_config", _config(tmp_path, "bug"), "--output_dir", out], [_env()], ROOT, 300)
    assert code == 1
    assert "Traceback" in stderr and "boom: a bug" in stderr
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: RuntimeError: boom: a bug (a bug in ds_pfc")
    assert "boom: a bug" in open(os.path.join(out, "errors", "rank0.txt")).read()
    assert lines[0] in open(os.path.join(out, "training.log")).read()


def _csv_rows(path):
    import csv
    with open(path, newline="") as f:
        return list(csv.reader(f))


def test_the_csv_monitor_files_continue_across_resumes(tmp_path):
    """DeepSpeed's csv monitor writes a header the first time a process writes a file; a
    resumed run continues the files instead: one header line, and the step column (the
    samples seen: 8 a step here) continuous. Resuming an older tag drops the rows written
    after it, which the resumed run writes again."""
    out = os.path.join(tmp_path, "run")
    path = _config(tmp_path, "job")
    monitor = os.path.join(out, "monitor", "train")
    _run(["--deepspeed_config", path, "--output_dir", out, "--max_steps", "3"])
    _run(["--deepspeed_config", path, "--output_dir", out, "--max_steps", "5", "--resume"])
    names = sorted(os.listdir(monitor))
    assert "Train_Samples_train_loss.csv" in names and "Train_Samples_lr.csv" in names, names
    for name in names:
        rows = _csv_rows(os.path.join(monitor, name))
        assert rows[0][0] == "step" and all(row[0] != "step" for row in rows[1:]), (name, rows)
    for name in ("Train_Samples_train_loss.csv", "Train_Samples_train_accuracy.csv", "Train_Samples_lr.csv"):
        steps = [int(row[0]) for row in _csv_rows(os.path.join(monitor, name))[1:]]
        assert steps == [8 * k for k in range(1, 6)], (name, steps)
    losses = [float(row[1]) for row in _csv_rows(os.path.join(monitor, "Train_Samples_train_loss.csv"))[1:]]
    assert losses == _summary(out)["losses"]

    # Back to step 2 (checkpoints every 2 steps): the rows of steps 3-5 go, 3-4 come again.
    stdout = _run(["--deepspeed_config", path, "--output_dir", out, "--max_steps", "4",
                   "--resume_from", "step00000002"])
    assert "monitor: removed" in stdout
    rows = _csv_rows(os.path.join(monitor, "Train_Samples_train_loss.csv"))
    assert rows[0] == ["step", "train_loss"] and [int(r[0]) for r in rows[1:]] == [8, 16, 24, 32], rows
    assert [float(r[1]) for r in rows[1:]] == _summary(out)["losses"]


def test_max_steps_0_through_the_command_exits_0_with_the_initial_checkpoint(tmp_path):
    out = os.path.join(tmp_path, "run")
    _forked(["--deepspeed_config", _config(tmp_path, "job"), "--output_dir", out, "--max_steps", "0"], 1)
    summary = _summary(out)
    assert summary["steps"] == 0 and summary["losses"] == [] and summary["checkpoint"].endswith("step00000000")
    assert os.path.isfile(os.path.join(out, "export", "model.safetensors"))
    assert os.path.isfile(os.path.join(out, "checkpoints", "step00000000", "ds_pfc_complete.json"))


def test_sigterm_to_the_deepspeed_command_alone_preempts_the_ranks(tmp_path):
    """``deepspeed`` on one node installs no SIGTERM handler: a SIGTERM to that command alone
    ends it, leaving DeepSpeed's per-node launcher and the ranks running. Each rank notices
    that its launcher's starter is gone and preempts itself: one complete checkpoint of the
    step, every rank exits 75 (which the launcher reports in its own words), and a rerun
    resumes from it."""
    import signal
    import time as _time
    psutil = pytest.importorskip("psutil")
    out = os.path.join(tmp_path, "run")
    config = copy.deepcopy(TINY)
    config["ds_pfc"]["checkpoint"] = {"every_steps": 0, "keep": 0, "export": False}
    config["ds_pfc"]["train"]["max_steps"] = 12
    path = os.path.join(tmp_path, "job.json")
    with open(path, "w") as f:
        json.dump(config, f)
    console = os.path.join(tmp_path, "console.txt")
    beside = os.path.join(os.path.dirname(sys.executable), "deepspeed")      # this interpreter's
    cmd = [beside if os.path.isfile(beside) else shutil.which("deepspeed") or "deepspeed", "--num_gpus", "2",
           "--master_port", str(_free_port()), os.path.join(ROOT, "launch", "train.py"), "--deepspeed_config", path,
           "--output_dir", out]
    log = os.path.join(out, "training.log")
    with open(console, "w") as sink:
        # A session of its own: whatever is left of it at the end is killed as one group.
        runner = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        deadline = _time.monotonic() + 400
        while _time.monotonic() < deadline:      # wait for step 2's line
            if os.path.exists(log) and "step 2/" in open(log).read():
                break
            if runner.poll() is not None:
                pytest.fail(f"deepspeed ended before step 2:\n{open(console).read()[-4000:]}")
            _time.sleep(0.2)
        else:
            pytest.fail(f"no step 2 in {deadline} s:\n{open(console).read()[-4000:]}")
        left = psutil.Process(runner.pid).children(recursive=True)     # the launcher and the ranks
        assert len(left) >= 3, left
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=60) == -signal.SIGTERM          # no handler: it just ends
        _, alive = psutil.wait_procs(left, timeout=300)
        assert not alive, f"still running: {alive}\n{open(console).read()[-4000:]}"
    finally:
        try:
            os.killpg(runner.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    text = open(console).read()
    found = re.search(r"preempted by the end of its deepspeed launcher at step (\d+)", text)
    assert found, text[-4000:]
    stopped = int(found.group(1))
    assert 2 <= stopped < 12
    assert "exits with return code = 75" in text                   # DeepSpeed's launcher, in its words
    saved = {n for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith("step")}
    assert saved == {f"step{stopped:08d}"}
    assert os.path.isfile(os.path.join(out, "checkpoints", f"step{stopped:08d}", "ds_pfc_complete.json"))

    _forked(["--deepspeed_config", path, "--output_dir", out], 2)
    resumed = _summary(out)
    assert resumed["resumed"] and resumed["steps"] == 12 and resumed["first_loss_step"] == 1
    assert f"resumed from {os.path.join(out, 'checkpoints', f'step{stopped:08d}')}" in open(log).read()
