"""End to end: a 2-layer MLP trains through the fake worker, loss equal to eager CPU; autograd, optimizers."""
import copy, io, sys, torch, gbtorch
torch.manual_seed(0)
dev = gbtorch.setup()

def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

X = torch.randn(128, 32); Y = torch.randint(0, 10, (128,))

def train(device, opt_name, **okw):
    m = make().to(device)
    opt = getattr(torch.optim, opt_name)(m.parameters(), lr=1e-2, **okw)
    x, y = X.to(device), Y.to(device)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return m, losses

ok = True
for opt_name, okw in [("SGD", {"momentum": 0.9}), ("Adam", {}), ("AdamW", {}), ("Adam", {"foreach": True}),
                      ("AdamW", {"foreach": True}), ("SGD", {"foreach": True, "momentum": 0.9}),
                      ("Adam", {"fused": True}), ("AdamW", {"fused": True})]:
    try:
        _, ref = train("cpu", opt_name, **okw)
        m, got = train(dev, opt_name, **okw)
        same = all(abs(a - b) <= 1e-5 * max(1, abs(a)) for a, b in zip(ref, got))
        ok &= same
        print(f"{opt_name:6} {str(okw):32} match={same} cpu={ref[-1]:.6f} gb={got[-1]:.6f}")
    except Exception as e:
        ok = False
        print(f"{opt_name:6} {str(okw):32} FAILED {type(e).__name__}: {str(e)[:200]}")

# autograd extras
m = make().to(dev)
x = X.to(dev).requires_grad_()
with torch.no_grad():
    out = m(x)
print("no_grad requires_grad:", out.requires_grad)
g, = torch.autograd.grad(m(x).sum(), x)
xc = X.clone().requires_grad_(); gc, = torch.autograd.grad(make()(xc).sum(), xc)
print("autograd.grad matches:", torch.allclose(g.cpu(), gc, atol=1e-6), g.device)
# state_dict round trip and torch.save of the model moved to the CPU
sd = {k: v.cpu() for k, v in m.state_dict().items()}
buf = io.BytesIO(); torch.save(m.to("cpu").state_dict(), buf); buf.seek(0)
m2 = make(); m2.load_state_dict(torch.load(buf)); m3 = make().to(dev); m3.load_state_dict(m2.state_dict())
print("state_dict round trip:", all(torch.equal(a.cpu(), b) for a, b in zip(m3.state_dict().values(), sd.values())))
print("param types:", type(next(m3.parameters())).__name__, isinstance(next(m3.parameters()), torch.nn.Parameter),
      next(m3.parameters()).device)
print("ALL OK" if ok else "SOME FAILED")
