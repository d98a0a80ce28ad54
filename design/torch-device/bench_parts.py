"""Where the ~7 us of a warm queued op goes, and how much of an MLP step is inside our dispatch."""
import time, torch, gbtorch
from bench import NullWorker, per_op  # noqa: E402  (bench.py's worker; running bench's module code once)

dev = gbtorch.setup(NullWorker())
a = torch.empty(64, 64, device=dev); b = torch.empty(64, 64, device=dev)
add = torch.ops.aten.add.Tensor
print(f"a + b (warm, whole)            {per_op(lambda: a + b):6.2f} us")
print(f"_dispatch(add) direct          {per_op(lambda: gbtorch._dispatch(add, (a, b), {})):6.2f} us")
print(f"_key                           {per_op(lambda: gbtorch._key(add, (a, b), {})):6.2f} us")
print(f"BTensor(...) (wrapper subclass){per_op(lambda: gbtorch.BTensor((64, 64), (64, 1), 0, torch.float32, 1)):6.2f} us")
print(f"_encode                        {per_op(lambda: gbtorch._encode((a, b), {})):6.2f} us")

# fraction of an SGD step spent inside our dispatch
orig = gbtorch._dispatch
acc = [0.0, 0]
def timed(func, args, kwargs):
    t0 = time.perf_counter()
    try:
        return orig(func, args, kwargs)
    finally:
        acc[0] += time.perf_counter() - t0; acc[1] += 1
gbtorch._dispatch = timed
m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to(dev)
opt = torch.optim.SGD(m.parameters(), lr=1e-2)
x = torch.randn(128, 32).to(dev); y = torch.randint(0, 10, (128,)).to(dev)
def step():
    opt.zero_grad(); torch.nn.functional.cross_entropy(m(x), y).backward(); opt.step()
for _ in range(5): step()
acc[:] = [0.0, 0]
n = 200; t0 = time.perf_counter()
for _ in range(n): step()
tot = (time.perf_counter() - t0) / n
print(f"SGD step {tot*1e6:.0f} us: {acc[1]/n:.0f} ops in _dispatch taking {acc[0]/n*1e6:.0f} us "
      f"({acc[0]/acc[1]*1e6:.1f} us/op); the rest ({(tot-acc[0]/n)*1e6:.0f} us) is PyTorch's own Python/autograd/"
      f"__torch_dispatch__ entry and __del__")
