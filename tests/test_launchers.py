"""Rank, world size and local rank under every launcher (ds_pfc.launchers).

Unit tests feed :func:`discover` the environment each launcher gives its tasks (the
variable names as DeepSpeed's ``launcher/multinode_runner.py`` and ``launch.py``,
torchrun's elastic agent, Open MPI, MVAPICH, Hydra and Slurm set them). The 2-rank
jobs start two real processes with exactly such an environment, each running the
app's start-up (launch env -> ``init_distributed`` -> bind ``cuda:<local rank>`` on
a mocked 2-GPU node) and an all-reduce over gloo: the two processes must form one
world of two distinct ranks, each bound to its own GPU. ``srun`` and ``mpirun`` set
no ``RANK``, so a start-up that reads only ``RANK`` gives two one-rank worlds on GPU 0.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ds_pfc import launchers
from ds_pfc.launchers import LaunchError, discover, expand_hostlist, expand_task_counts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- the environment each launcher gives task `rank` of `world` -----------------------------
def torchrun_env(rank, world, nproc, port=29400):
    return {"RANK": str(rank), "LOCAL_RANK": str(rank % nproc), "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": str(rank // nproc), "GROUP_WORLD_SIZE": str(world // nproc),
            "ROLE_RANK": str(rank), "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "job7",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"}


def deepspeed_env(rank, world, nproc, port=29500):
    """deepspeed.launcher.launch on each node (the pdsh and local launchers)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank % nproc), "WORLD_SIZE": str(world), "LOCAL_SIZE": str(nproc),
            "CROSS_RANK": str(rank // nproc), "CROSS_SIZE": str(world // nproc), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


def openmpi_env(rank, world, nproc, namespace="prterun-n0-4242@1"):
    """mpirun (deepspeed --launcher openmpi adds -x UCX_TLS=tcp and nothing else)."""
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(world),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % nproc), "OMPI_COMM_WORLD_LOCAL_SIZE": str(nproc),
            "OMPI_COMM_WORLD_NODE_RANK": str(rank // nproc), "OMPI_UNIVERSE_SIZE": str(world),
            "PMIX_RANK": str(rank), "PMIX_NAMESPACE": namespace, "UCX_TLS": "tcp"}


def mvapich_env(rank, world, nproc):
    return {"MV2_COMM_WORLD_RANK": str(rank), "MV2_COMM_WORLD_SIZE": str(world),
            "MV2_COMM_WORLD_LOCAL_RANK": str(rank % nproc), "MV2_COMM_WORLD_LOCAL_SIZE": str(nproc),
            "MV2_SMP_USE_CMA": "0", "MV2_SUPPORT_DL": "1", "MV2_ENABLE_AFFINITY": "0"}


def hydra_env(rank, world, nproc):
    """mpiexec.hydra of Intel MPI / MPICH."""
    return {"PMI_RANK": str(rank), "PMI_SIZE": str(world), "MPI_LOCALRANKID": str(rank % nproc),
            "MPI_LOCALNRANKS": str(nproc), "PMI_FD": "7"}


def deepspeed_impi_env(rank, world, nproc, port=29500):
    """deepspeed --launcher impi: -genv WORLD_SIZE/LOCAL_SIZE/MASTER_*, -env RANK/LOCAL_RANK per rank."""
    return {**hydra_env(rank, world, nproc), "RANK": str(rank), "LOCAL_RANK": str(rank % nproc),
            "WORLD_SIZE": str(world), "LOCAL_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "I_MPI_PIN": "0"}


def srun_env(rank, world, nproc, nodes, job="4242", step="0"):
    """A task of `srun -n world` with nproc tasks per node over the host list `nodes`."""
    hosts = expand_hostlist(nodes)
    return {"SLURM_JOB_ID": job, "SLURM_JOBID": job, "SLURM_STEP_ID": step, "SLURM_STEPID": step,
            "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % nproc), "SLURM_NODEID": str(rank // nproc),
            "SLURM_NTASKS": str(world), "SLURM_NPROCS": str(world), "SLURM_STEP_NUM_TASKS": str(world),
            "SLURM_STEP_NUM_NODES": str(len(hosts)), "SLURM_STEP_TASKS_PER_NODE": f"{nproc}(x{len(hosts)})",
            "SLURM_TASKS_PER_NODE": f"{nproc}(x{len(hosts)})", "SLURM_STEP_NODELIST": nodes,
            "SLURM_JOB_NODELIST": nodes, "SLURM_NODELIST": nodes, "SLURMD_NODENAME": hosts[rank // nproc],
            "SLURM_GTIDS": ",".join(str(r) for r in range(rank - rank % nproc, rank - rank % nproc + nproc))}


# --- Slurm's compressed lists ---------------------------------------------------------------
def test_slurm_host_lists_expand_in_order():
    assert expand_hostlist("gpu[003-005,007],cpu1") == ["gpu003", "gpu004", "gpu005", "gpu007", "cpu1"]
    assert expand_hostlist("n7") == ["n7"]
    assert expand_hostlist("a[9-11]") == ["a9", "a10", "a11"]
    assert expand_hostlist("r[1-2]-n[08-09],x") == ["r1-n08", "r1-n09", "r2-n08", "r2-n09", "x"]
    assert expand_task_counts("2(x3),1") == [2, 2, 2, 1]
    assert expand_task_counts("8") == [8]
    for bad in ("gpu[1-", "gpu[a-b]", "gpu[5-3]"):
        with pytest.raises(ValueError, match="host list"):
            expand_hostlist(bad)


# --- discovery per launcher ---------------------------------------------------------------------
@pytest.mark.parametrize("make, name", [(torchrun_env, "torchrun"), (deepspeed_env, "deepspeed"),
                                        (deepspeed_impi_env, "impi/mpich")])
def test_launchers_that_set_rank_are_read_as_they_are(make, name):
    launch = discover(make(13, 16, 8))
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == \
        (name, 13, 16, 5, 8)
    assert launch.master_addr == "127.0.0.1"


@pytest.mark.parametrize("make, own, stale", [(torchrun_env, "LOCAL_WORLD_SIZE", "LOCAL_SIZE"),
                                               (deepspeed_env, "LOCAL_SIZE", "LOCAL_WORLD_SIZE")])
def test_a_spawner_reads_its_own_local_size_over_an_inherited_one(make, own, stale):
    # a parent that ran the app exported both names; the spawner sets only its own
    env = {**make(13, 16, 8), stale: "1"}
    assert own in env
    assert discover(env).local_world_size == 8


@pytest.mark.parametrize("make, name", [(openmpi_env, "openmpi"), (mvapich_env, "mvapich"),
                                        (hydra_env, "impi/mpich")])
def test_mpi_launchers_give_rank_without_RANK(make, name):
    env = dict(make(13, 16, 8), MASTER_ADDR="node0")
    launch = discover(env)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank, launch.local_world_size,
            launch.master_addr) == (name, 13, 16, 5, 8, "node0")
    # all ranks on one node: rank 0 is this host
    assert discover(make(3, 4, 4)).master_addr == "127.0.0.1"


def test_mpi_ports_agree_within_a_job():
    ports = {discover(openmpi_env(r, 4, 4)).master_port for r in range(4)}
    assert len(ports) == 1 and 20000 <= ports.pop() < 30000
    assert discover(openmpi_env(0, 4, 4)).master_port != discover(openmpi_env(0, 4, 4, "prterun-n0-99@1")).master_port
    assert discover(mvapich_env(1, 4, 4)).master_port == launchers.DEFAULT_PORT
    assert discover(dict(mvapich_env(1, 4, 4), MASTER_PORT="31000")).master_port == 31000


def test_mpi_over_nodes_without_master_addr_is_refused_or_left_to_mpi4py():
    env = openmpi_env(5, 16, 8)
    assert discover(env).master_addr is None
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        with pytest.raises(LaunchError, match="MASTER_ADDR"):
            launchers.export(dict(env))
    else:
        out = dict(env)
        launchers.export(out)
        assert "MASTER_ADDR" not in out and out["RANK"] == "5"     # DeepSpeed's MPI discovery broadcasts it


def test_azure_ml_names_rank_0s_host():
    assert discover(dict(openmpi_env(5, 16, 8), AZ_BATCH_MASTER_NODE="10.0.0.4:6105")).master_addr == "10.0.0.4"


def test_srun_tasks_are_ranks():
    nodes = "gpu[003-004]"
    seen = set()
    for rank in range(16):
        launch = discover(srun_env(rank, 16, 8, nodes))
        assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == \
            ("slurm", rank, 16, rank % 8, 8)
        assert launch.master_addr == "gpu003"
        seen.add(launch.master_port)
    (port,) = seen                                  # one port for the whole step, from the job id
    assert 20000 <= port < 30000
    assert discover(srun_env(0, 16, 8, nodes, job="4243")).master_port != port
    assert discover(srun_env(0, 16, 8, nodes, step="1")).master_port != port
    assert discover(dict(srun_env(0, 16, 8, nodes), MASTER_PORT="29123")).master_port == 29123


def test_srun_with_uneven_tasks_per_node():
    env = dict(srun_env(4, 5, 2, "n[1-3]"), SLURM_STEP_TASKS_PER_NODE="2(x2),1", SLURMD_NODENAME="n3",
               SLURM_LOCALID="0")
    launch = discover(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == (4, 5, 0, 1)
    assert launch.master_addr == "n1"


def test_srun_with_pmix_and_deepspeed_slurm_launcher():
    # srun --mpi=pmix adds PMIX_RANK; deepspeed --launcher slurm runs `srun -n N --export=ALL,...`
    env = dict(srun_env(9, 16, 8, "gpu[1-2]"), PMIX_RANK="9", PMIX_NAMESPACE="slurm.pmix.4242.0", PYTHONPATH="/x")
    launch = discover(env)
    assert (launch.launcher, launch.rank, launch.local_rank, launch.master_addr) == ("slurm", 9, 1, "gpu1")
    with pytest.raises(LaunchError, match="PMIX_RANK=3"):
        discover(dict(env, PMIX_RANK="3"))


def test_agents_under_a_scheduler_are_not_ranks():
    # srun -N2 --ntasks-per-node=1 torchrun --nproc_per_node 8: the Slurm task is torchrun's agent
    env = {**srun_env(1, 2, 1, "gpu[1-2]"), **torchrun_env(11, 16, 8)}
    assert (discover(env).launcher, discover(env).rank, discover(env).local_rank) == ("torchrun", 11, 3)
    # deepspeed --num_gpus 8 inside a batch script or an srun step
    env = {**srun_env(0, 1, 1, "gpu1"), **deepspeed_env(3, 8, 8)}
    assert (discover(env).launcher, discover(env).rank) == ("deepspeed", 3)


def test_no_launcher_is_a_one_process_world():
    out = {}
    launch = launchers.export(out)
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank) == ("none", 0, 1, 0)
    assert out["RANK"] == "0" and out["WORLD_SIZE"] == "1" and out["MASTER_ADDR"] == "127.0.0.1"
    assert int(out["MASTER_PORT"]) > 0
    again = launchers.export(out)                   # idempotent: the same world and port
    assert (again.rank, again.world_size, again.master_port) == (0, 1, int(out["MASTER_PORT"]))
    # a batch script of a one-task job is fine too
    assert discover({"SLURM_JOB_ID": "5", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}).world_size == 1


# --- refusals --------------------------------------------------------------------------------
@pytest.mark.parametrize("env, names", [
    (dict(srun_env(3, 16, 8, "g[1-2]"), WORLD_SIZE="8"), ["WORLD_SIZE=8", "SLURM_STEP_NUM_TASKS=16"]),
    (dict(srun_env(3, 16, 8, "g[1-2]"), RANK="0", WORLD_SIZE="16"), ["RANK=0", "SLURM_PROCID=3"]),
    (dict(srun_env(3, 16, 8, "g[1-2]"), LOCAL_RANK="0"), ["LOCAL_RANK=0", "SLURM_LOCALID=3"]),
    (dict(openmpi_env(3, 16, 8), WORLD_SIZE="8"), ["WORLD_SIZE=8", "OMPI_COMM_WORLD_SIZE=16"]),
    (dict(mvapich_env(3, 16, 8), LOCAL_SIZE="4"), ["LOCAL_SIZE=4", "MV2_COMM_WORLD_LOCAL_SIZE=8"]),
    (dict(deepspeed_impi_env(3, 16, 8), WORLD_SIZE="32"), ["WORLD_SIZE=32", "PMI_SIZE=16"]),
    (dict(torchrun_env(3, 16, 8), RANK="16"), ["rank 16", "16 ranks", "RANK=16"]),
    (dict(torchrun_env(3, 16, 8), LOCAL_RANK="8"), ["local rank 8", "8 ranks on this node"]),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "4", "LOCAL_WORLD_SIZE": "1"}, ["LOCAL_SIZE=4",
                                                                                  "LOCAL_WORLD_SIZE=1"]),
    (dict(deepspeed_env(3, 16, 8), LOCAL_RANK="5"), ["local rank 5", "rank 3"]),
    ({"RANK": "2"}, ["RANK=2", "WORLD_SIZE"]),
    ({"RANK": "x", "WORLD_SIZE": "2"}, ["RANK='x'", "not an integer"]),
    ({"WORLD_SIZE": "8"}, ["WORLD_SIZE=8", "no launcher"]),
    ({"LOCAL_RANK": "3"}, ["LOCAL_RANK=3", "no launcher"]),
    ({"SLURM_JOB_ID": "5", "SLURM_NTASKS": "16", "SLURM_PROCID": "0"}, ["SLURM_NTASKS=16", "srun"]),
    ({"PMIX_RANK": "2"}, ["PMIX_RANK=2", "WORLD_SIZE"]),
    (dict(openmpi_env(3, 16, 8), PMI_RANK="4"), ["OMPI_COMM_WORLD_RANK=3", "PMI_RANK=4"]),
])
def test_inconsistent_launches_are_refused_by_name(env, names):
    with pytest.raises(LaunchError) as err:
        discover(env)
    for name in names:
        assert name in str(err.value)


# --- 2-rank jobs ---------------------------------------------------------------------------------
RANK_SCRIPT = r"""
import json, os, sys
root = sys.argv[1]
sys.path[:0] = [os.path.join(root, "launch"), root]
import torch
bound = []                                  # a 2-GPU node: record which GPU each rank binds
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 2
torch.cuda.set_device = lambda index: bound.append(int(index))
import _common
launch = _common.launch_env()               # the app's start-up, in its order
import torch.distributed as dist
from ds_pfc import launchers
from ds_pfc.deepspeed_plugin import init_distributed
from ds_pfc.devices import bind_local_device
init_distributed("gloo")
launchers.check_process_group(launch)
device = bind_local_device()
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
print("RESULT " + json.dumps({"rank": dist.get_rank(), "world": dist.get_world_size(), "bound": bound,
                              "device": str(device), "sum": total.item(), "launcher": launch.launcher}), flush=True)
_common.leave_process_groups()
"""


def _port_if_free(port):
    import socket
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return None
    return port


def _free_derived(key_of, taken):
    """The first key (from 200) whose job-derived port is free now and not in ``taken``."""
    for n in range(200):
        key = key_of(n)
        port = launchers._job_port(key)
        if port not in taken and _port_if_free(port):
            taken.add(port)
            return key
    pytest.skip("no free port among 200 job-derived ones")


def _new_port(taken):
    from _dist import free_port
    while (port := free_port()) in taken:
        pass
    taken.add(port)
    return port


WRONG_WORLD = "srun-with-WORLD_SIZE=4"
# The launchers that set no RANK (and torchrun) run in every test pass; the rest, whose
# discovery is the torch variables read as they are, run with the slow tests.
JOBS = ("srun-one-node", "srun-two-nodes", "openmpi", "torchrun")
MORE_JOBS = ("deepspeed", "deepspeed-impi", "mvapich", "hydra")


def _run_jobs(tmp, jobs, cmd=None, timeout=240):
    """Start both ranks of every job in ``jobs`` (name -> per-rank environments) side
    by side, each running ``cmd`` (default: the start-up script above); returns
    name -> [(exit code, stdout, stderr)] per rank."""
    if cmd is None:
        script = tmp / "rank.py"
        script.write_text(RANK_SCRIPT)
        cmd = [sys.executable, str(script), ROOT]
    base = {k: os.environ[k] for k in ("PATH", "HOME", "TMPDIR", "LD_LIBRARY_PATH", "TORCH_EXTENSIONS_DIR")
            if k in os.environ}
    base.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    procs = {job: [subprocess.Popen(cmd, env={**base, **env}, cwd=str(tmp), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for env in envs]
             for job, envs in jobs.items()}
    outputs = {}
    try:
        for job, ranks in procs.items():
            outputs[job] = []
            for proc in ranks:
                out, err = proc.communicate(timeout=timeout)
                outputs[job].append((proc.returncode, out, err))
    finally:
        for ranks in procs.values():
            for proc in ranks:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    return outputs


@pytest.fixture(scope="module")
def job_outputs(tmp_path_factory):
    taken = set()                                   # jobs run side by side: one port each
    jobs = {job: _job_env(job, taken) for job in JOBS}
    slurm_job = _free_derived(lambda n: f"{6000 + n}.0", taken).split(".")[0]
    jobs[WRONG_WORLD] = [dict(srun_env(r, 2, 2, "localhost", job=slurm_job), WORLD_SIZE="4") for r in range(2)]
    return _run_jobs(tmp_path_factory.mktemp("jobs"), jobs)


@pytest.fixture(scope="module")
def more_job_outputs(tmp_path_factory):
    taken = set()
    return _run_jobs(tmp_path_factory.mktemp("more_jobs"), {job: _job_env(job, taken) for job in MORE_JOBS})


def _results(outs):
    results = []
    for rc, out, err in outs:
        assert rc == 0, f"rank failed (exit {rc}):\n{out[-2000:]}\n{err[-3000:]}"
        (line,) = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        results.append(json.loads(line[len("RESULT "):]))
    return results


def _job_env(job, taken):
    """Both ranks' environments for `job` (on ports free now, not in ``taken``)."""
    if job in ("torchrun", "deepspeed", "deepspeed-impi"):
        make = {"torchrun": torchrun_env, "deepspeed": deepspeed_env, "deepspeed-impi": deepspeed_impi_env}[job]
        port = _new_port(taken)
        return [make(r, 2, 2, port) for r in range(2)]
    if job == "openmpi":                            # the port comes from the PMIx namespace
        namespace = _free_derived(lambda n: f"prterun-x-{n}@1", taken)
        return [openmpi_env(r, 2, 2, namespace) for r in range(2)]
    if job in ("mvapich", "hydra"):                 # mpirun -genv MASTER_PORT (else 29500, maybe taken)
        port, make = str(_new_port(taken)), {"mvapich": mvapich_env, "hydra": hydra_env}[job]
        return [dict(make(r, 2, 2), MASTER_PORT=port) for r in range(2)]
    slurm_job = _free_derived(lambda n: f"{5000 + n}.0", taken).split(".")[0]
    if job == "srun-one-node":
        return [srun_env(r, 2, 2, "localhost", job=slurm_job) for r in range(2)]
    # two "nodes", one task each: rank 0's host is the list's first; each binds its node's GPU 0
    return [srun_env(r, 2, 1, "127.0.0.[1-2]", job=slurm_job) for r in range(2)]


def _check_two_rank_job(outputs, job):
    results = _results(outputs)
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 3.0 for r in results)         # 1 + 2 over one group
    per_node = 1 if job == "srun-two-nodes" else 2
    for r in results:
        local = r["rank"] % per_node
        assert r["bound"] == [local] and r["device"] == f"cuda:{local}"       # bound once, after init


@pytest.mark.parametrize("job", JOBS)
def test_two_rank_job_forms_one_world_and_binds_each_local_gpu(job_outputs, job):
    _check_two_rank_job(job_outputs[job], job)


@pytest.mark.slow
@pytest.mark.parametrize("job", MORE_JOBS)
def test_more_two_rank_jobs(more_job_outputs, job):
    _check_two_rank_job(more_job_outputs[job], job)


def test_srun_with_a_wrong_world_size_is_refused_at_start(job_outputs):
    for rc, out, err in job_outputs[WRONG_WORLD]:
        assert rc != 0
        assert "error: WORLD_SIZE=4 but slurm started this process with SLURM_STEP_NUM_TASKS=2" in err
        assert "Traceback" not in err


@pytest.mark.slow
def test_the_training_app_under_srun_is_one_two_rank_run(tmp_path):
    """`srun -n 2 python launch/train.py`: one run of 2 ranks (a shard per rank, the
    losses of the stored 2-rank-equivalent golden run), not two one-rank runs
    writing the same output directory."""
    import copy

    import torch
    from test_train_app import GOLDEN, STEPS, TINY
    config = copy.deepcopy(TINY)
    config["ds_pfc"]["checkpoint"]["every_steps"] = STEPS
    path = tmp_path / "job.json"
    path.write_text(json.dumps(config))
    out = tmp_path / "run"
    job = _free_derived(lambda n: f"{7000 + n}.0", set()).split(".")[0]
    cmd = [sys.executable, os.path.join(ROOT, "launch", "train.py"), "--deepspeed_config", str(path),
           "--output_dir", str(out)]
    outs = _run_jobs(tmp_path, {"srun": [srun_env(r, 2, 2, "localhost", job=job) for r in range(2)]}, cmd=cmd,
                     timeout=600)["srun"]
    for rc, stdout, stderr in outs:
        assert rc == 0, f"{stdout[-2000:]}\n{stderr[-3000:]}"
    assert "ds_pfc: 2 rank(s)" in outs[0][1]
    with open(out / "summary.json") as f:
        summary = json.load(f)
    assert summary["steps"] == STEPS
    files = set(os.listdir(summary["checkpoint"]))
    assert {"head-rank00000-of-00002.safetensors", "head-rank00001-of-00002.safetensors"} <= files
    with open(GOLDEN) as f:
        golden = json.load(f)["losses"]
    torch.testing.assert_close(torch.tensor(summary["losses"]), torch.tensor(golden), rtol=2e-3, atol=1e-3)
