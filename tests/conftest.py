import os
import sys

import pytest
import torch

# Without CUDA the Triton kernels run on CPU tensors in Triton's interpreter. Triton
# fixes that choice when it is first imported (DeepSpeed imports it too), so this must
# come before any import of triton, deepspeed or ds_pfc.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (the README's test command runs 2 workers on 2 cores) each worker
# computes on one thread, as every spawned rank does (OMP_NUM_THREADS=1).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# tests/ helpers (``_dist``) importable from every test module and spawned rank.
sys.path.insert(0, os.path.dirname(__file__))
# DeepSpeed JIT-builds its async I/O op on first use (minutes on 2 cores); keep the
# build in the checkout so every test process, and every later run, reuses it.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                           ".torch_extensions"))


# RecordIO index caches of the tests go to one temporary directory, not ~/.cache/ds_pfc.
_TEST_CACHE = None
if "DS_PFC_CACHE_DIR" not in os.environ:
    import tempfile
    _TEST_CACHE = os.environ["DS_PFC_CACHE_DIR"] = tempfile.mkdtemp(prefix="ds_pfc-test-cache-")


# The slowest test files, slowest first (each 20 s to 4 minutes on the 2-core machine). pytest-xdist's ``--dist loadfile``
# hands a worker its next file in collection order when it runs out of work; started
# last, one of these would run alone at the end while the other worker idles.
SLOWEST_FIRST = ("test_margin_app.py", "test_train_app.py", "test_accuracy_guard.py",
                 "test_triton_softmax.py", "test_launchers.py", "test_ijb.py", "test_gpu_path.py", "test_tiers.py",
                 "test_checkpoint_safety.py", "test_gpu_model.py", "test_experiments.py", "test_features_setting.py",
                 "test_mapped_access.py", "test_exactness.py")


def pytest_configure(config):
    # pytest-xdist would otherwise reorder the files by their number of tests.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    first = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))     # stable: files keep their order


def pytest_sessionstart(session):
    session.config._ds_pfc_started = __import__("time").time()


def pytest_sessionfinish(session, exitstatus):
    """DeepSpeed's CPU shared-memory all-reduce leaves a buffer per process in
    /dev/shm (69 MB each, named after the master port) unless
    ``ds_pfc.deepspeed_plugin.init_distributed`` unlinked it; remove any that a test
    which calls ``deepspeed.init_distributed`` itself left behind."""
    import glob
    import shutil
    if _TEST_CACHE is not None and not os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(_TEST_CACHE, ignore_errors=True)
    started = getattr(session.config, "_ds_pfc_started", None)
    if started is None or os.environ.get("PYTEST_XDIST_WORKER"):
        return          # under pytest-xdist the controller cleans up once every worker is done
    for path in glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"):
        try:
            if os.path.getmtime(path) >= started - 1:
                os.remove(path)
        except OSError:
            pass


@pytest.fixture(autouse=True)
def _restore_environment():
    """Each test gets the environment it started with back: in-process runs of the
    app export the launcher's variables (``RANK``, ``LOCAL_WORLD_SIZE``, ...), which
    would otherwise reach the launchers that later tests start."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module", autouse=True)
def _forget_process_groups():
    """After each module: no process group, and nothing DeepSpeed cached from one.
    DeepSpeed keeps its world group, its data/model-parallel groups and its comm
    backend in module globals; a module that runs the app in-process after another
    one destroyed its group would otherwise meet the dead groups ("Group ... is not
    registered")."""
    yield
    import torch.distributed as dist
    from _dist import forget_deepspeed_groups
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    forget_deepspeed_groups()
