import torch, gbtorch, traceback
dev = gbtorch.setup()
m = torch.nn.Linear(4, 2).to(dev)
opt = torch.optim.Adam(m.parameters(), foreach=True)
m(torch.randn(3, 4).to(dev)).sum().backward()
try:
    opt.step()
except Exception:
    traceback.print_exc()
