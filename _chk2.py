import torch
from ds_pfc import PartialFC, ArcFace
from ds_pfc.bench.counting import OpCounter
for validate in (False, True):
  for r in (0.1, 0.5, 1.0):
    head = PartialFC(1000, 8, sample_rate=r, validate=validate, data_parallel_grad=False)
    x = torch.randn(37, 8); y = torch.randint(0, 1000, (37,))
    head(x, y).backward(); head.step(0.1)
    with OpCounter() as c:
        loss = head(x, y); loss.backward(); head.step(0.1)
    print(validate, r, c.syncs, c.sync_ops, c.ops, head.sample_step)
