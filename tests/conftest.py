import os
import sys

import torch

# Without CUDA the Triton kernels run on CPU tensors in Triton's interpreter. Triton
# fixes that choice when it is first imported (DeepSpeed imports it too), so this must
# come before any import of triton, deepspeed or ds_pfc.kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# tests/ helpers (``_dist``) importable from every test module and spawned rank.
sys.path.insert(0, os.path.dirname(__file__))
# DeepSpeed JIT-builds its async I/O op on first use (minutes on 2 cores); keep the
# build in the checkout so every test process, and every later run, reuses it.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                           ".torch_extensions"))
