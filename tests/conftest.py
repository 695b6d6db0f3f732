import os
import sys

# tests/ helpers (``_dist``) importable from every test module and spawned rank.
sys.path.insert(0, os.path.dirname(__file__))
# DeepSpeed JIT-builds its async I/O op on first use (minutes on 2 cores); keep the
# build in the checkout so every test process, and every later run, reuses it.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                           ".torch_extensions"))
