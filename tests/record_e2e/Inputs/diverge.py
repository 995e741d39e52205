"""A 2-rank job whose rank 1 issues more dc ops than rank 0: after each backward it runs the
first layer once more. ZeRO-1 keeps parameters gathered until the optimizer step changes
them, so those ops are served from the held copies, no collective is involved and nothing
hangs. `dcplan record` must name the first op where the ranks differ."""
import torch
import torch.distributed as dist
from torch import nn

import dcplan

dist.init_process_group("gloo")
torch.manual_seed(0)
model = dcplan.shard(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), stage=1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(8):
    model(torch.randn(3, 8)).square().mean().backward()
    if dist.get_rank() == 1:
        with torch.no_grad():
            model[0](torch.randn(3, 8))
    opt.step()
    opt.zero_grad()
dcplan.shutdown()
dist.destroy_process_group()
