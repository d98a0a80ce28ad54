import torch, gbtorch, traceback
dev = gbtorch.setup()
x = torch.arange(6.).reshape(2, 3).to(dev)
y = x.clone()
for name, f in [("as_strided_ below Python key", lambda: torch.ops.aten.as_strided_.default(y, (3, 2), (1, 3), 0)),
                ("resize_ below Python key", lambda: torch.ops.aten.resize_.default(y, (6,))),
                ("set_ sizes via _unsafe_set", lambda: None)]:
    try:
        with torch._C._DisableTorchDispatch():
            f()
        print("ok", name, y.shape, y.stride())
    except Exception as e:
        print("FAIL", name, type(e).__name__, str(e)[:160])
# which op breaks torch.tensor(list, device=dev)?
gbtorch.COUNT_OPS = True
import torch.utils._python_dispatch as pd
try:
    torch.tensor([1, 2, 3], device=dev)
except Exception as e:
    print("torch.tensor:", str(e).splitlines()[0][:200]); print("ops seen:", gbtorch.STATS["by_op"])
