"""Client CPU per queued op (warm signature cache vs cold meta inference) and per MLP training step.

The worker is a NullWorker that drops commands: what is timed is the client's half only (dispatch, cache,
wrapper creation, command tuple); the wire encoding and transport come on top (see DESIGN.md)."""
import time, torch, gbtorch

class NullWorker(gbtorch.FakeWorker):
    frees = 0
    def submit(self, cmd):
        if cmd[0] == "free":
            NullWorker.frees += 1
        else:
            self.executed += 1
    def call(self, cmd):
        return torch.zeros(()) if cmd[0] == "read" else None

def per_op(fn, n=2000, reps=5):
    best = 1e9
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


if __name__ == "__main__":
    dev = gbtorch.setup(NullWorker())
    torch.manual_seed(0)

    a = torch.empty(64, 64, device=dev); b = torch.empty(64, 64, device=dev)
    ac, bc = torch.randn(64, 64), torch.randn(64, 64)
    ops = {"add": (lambda: a + b, lambda: ac + bc), "mm": (lambda: a @ b, lambda: ac @ bc),
           "relu": (lambda: torch.relu(a), lambda: torch.relu(ac)), "add_ (in-place)": (lambda: a.add_(b), lambda: ac.add_(bc)),
           "view (t)": (lambda: a.t(), lambda: ac.t())}
    print(f"{'op':16} {'warm us':>8} {'cold us':>8} {'eager CPU 64x64 us':>19}")
    for name, (f, fc) in ops.items():
        warm = per_op(f)
        def cold():
            gbtorch._CACHE.clear(); f()
        c = per_op(cold, n=300)
        e = per_op(fc)
        print(f"{name:16} {warm:8.1f} {c:8.1f} {e:19.1f}")

    # MLP training step (2 layers, SGD and Adam), client-only
    def step_cost(opt_name, **kw):
        m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).to(dev)
        opt = getattr(torch.optim, opt_name)(m.parameters(), lr=1e-2, **kw)
        x = torch.randn(128, 32).to(dev); y = torch.randint(0, 10, (128,)).to(dev)
        def step():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
        for _ in range(3):
            step()
        gbtorch.WORKER.executed = 0
        n = 200
        best = 1e9
        for _ in range(3):
            gbtorch.WORKER.executed = 0; NullWorker.frees = 0
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            best = min(best, (time.perf_counter() - t0) / n)
            ops = gbtorch.WORKER.executed / n; frees = NullWorker.frees / n
        mc = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        oc = getattr(torch.optim, opt_name)(mc.parameters(), lr=1e-2, **kw)
        xc = torch.randn(128, 32); yc = torch.randint(0, 10, (128,))
        def stepc():
            oc.zero_grad(); torch.nn.functional.cross_entropy(mc(xc), yc).backward(); oc.step()
        ec = per_op(stepc, n=100, reps=3)
        print(f"MLP step {opt_name:5} {str(kw):18}: {ops:5.1f} ops (+{frees:.0f} frees)/step, {best*1e6:7.1f} us client/step = "
              f"{best*1e6/ops:5.1f} us/op (eager CPU step, tiny MLP: {ec:6.1f} us)")

    for o, kw in [("SGD", {}), ("SGD", {"momentum": 0.9}), ("Adam", {}), ("Adam", {"foreach": True}), ("AdamW", {"fused": True})]:
        step_cost(o, **kw)
    print("cache entries:", len(gbtorch._CACHE), "syncs:", gbtorch.STATS["sync"])
