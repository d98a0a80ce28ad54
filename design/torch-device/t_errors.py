"""Errors inside backward must not kill the process: deferred to the next waiting call."""
import os, torch
os.environ["GB_DENY"] = "aten::threshold_backward"
import gbtorch
dev = gbtorch.setup()
m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1)).to(dev)
x = torch.randn(5, 4).to(dev)
loss = m(x).sum()
loss.backward()
print("backward returned (error deferred)")
try:
    print(loss.item())
except NotImplementedError as e:
    print("next waiting call raised:", type(e).__name__, e)
print("session goes on:", (x * 2).sum().item() == (x.cpu() * 2).sum().item())
try:
    torch.ops.aten.threshold_backward(x, x, 0.0)
except NotImplementedError as e:
    print("outside backward it raises at the call:", e)
