"""`gpubroker bench torch`: the same eager PyTorch code natively and on the gpubroker torch device through a broker.

Each workload runs, in the same run and on the same machine, natively with eager PyTorch in a process of its own
(cuda:N on CUDA; on PoCL the host CPU, as the worker then runs PyTorch's CPU kernels; NativeProcess says why not
in this one) and on ``gpubroker.client.torch.device(gpu)`` for a session on a broker this command starts (the
same-host ring):

- **mlp**: bench arrays' MLP (its sizes: 1024 -> 2048 -> 2048 -> 10, float32, batch 4,096, 100 steps) written as
  an ``nn.Sequential`` trained with autograd, cross-entropy and ``torch.optim.SGD``; the final loss is read back.
- **gpt**: a GPT-style decoder (6 pre-norm blocks, d_model 512, 8 heads with causal
  ``scaled_dot_product_attention``, 4x GELU MLP, vocabulary 8,192, sequence 256, batch 32) trained with AdamW.
- **resnet**: a ResNet-18-shaped network (written here with torch.nn, no torchvision), eval mode under no_grad,
  inference on batches of 64 at 224x224.
- **launch**: 10,000 tiny elementwise operators (``x = x + 1``) on a 1,000-element tensor, then ``.item()``.
- **client_cpu**: the client's CPU time (``time.process_time``, the whole process) per queued operator with a
  warm signature cache: many ``x = x + 1`` queued, divided by their number (an absolute target, not a ratio;
  native eager's figure is given beside it).

Inputs and models are on the device before the clock starts, and each side runs each workload once untimed first
(first-signature costs: shape inference, kernel selection, allocator pools). The clock stops after the final
value is read (or the device synchronized: ``torch.cuda.synchronize()`` natively, ``gbtorch.synchronize(dev)``
through the broker). Three runs (``--runs``); the JSON gives each time's median and spread (min, max), the ratio
ours / native per run, the issue's targets with met or MISS, what each side computed (they should agree), the
host and the commit. It goes to stdout and to ``bench/results/`` (or ``--out``); a table goes to stderr. A
workload the torch device cannot run is skipped with the reason in the JSON. ``--quick`` (CI, PoCL) runs the same
steps with tiny sizes, in seconds.
"""

from __future__ import annotations

import argparse
import datetime as dt
import multiprocessing
import platform
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass
from importlib import metadata
from multiprocessing.connection import Connection
from typing import Any

try:
    import torch
    from torch import nn
    from torch.nn import functional
except ImportError as exc:  # (`gpubroker bench torch` imports this module only when asked for it)
    raise SystemExit("gpubroker bench torch needs PyTorch beside gpubroker: pip install 'gpubroker[torch]'") from exc

from gpubroker.broker.backends import detect_backend
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import connect
from gpubroker_bench.arrays import MlpPlan
from gpubroker_bench.arrays import Plan as ArraysPlan
from gpubroker_bench.remote_vs_local import _commit, summarize, write_result

__all__ = ["GptPlan", "LaunchPlan", "Plan", "ResnetPlan", "Side", "Gpt", "main", "measure", "mlp_model",
           "resnet18"]

# The targets (issue 23, on the GPU machine): ours / native for the workloads, microseconds for the client.
TARGETS = {"mlp": 1.10, "gpt": 1.3, "resnet": 1.2, "launch": 2.5}
CLIENT_CPU_TARGET_US = 15.0
WORKLOADS = ("mlp", "gpt", "resnet", "launch")


@dataclass(frozen=True)
class GptPlan:
    layers: int
    d_model: int
    heads: int
    seq: int
    batch: int
    vocab: int
    steps: int
    learning_rate: float = 3e-4


@dataclass(frozen=True)
class ResnetPlan:
    batch: int
    image: int  # height = width
    width: int  # the first stage's channels (64 in ResNet-18; the stages have 1, 2, 4, 8 times that)
    classes: int
    batches: int  # forward passes timed


@dataclass(frozen=True)
class LaunchPlan:
    ops: int
    elements: int


@dataclass(frozen=True)
class Plan:
    mlp: MlpPlan
    gpt: GptPlan
    resnet: ResnetPlan
    launch: LaunchPlan
    client_cpu_ops: int

    @staticmethod
    def make(quick: bool) -> Plan:
        mlp = ArraysPlan.make(quick).mlp  # bench arrays' sizes, so the two MLP figures compare
        if quick:
            return Plan(mlp, GptPlan(2, 32, 2, 16, 4, 64, 3), ResnetPlan(2, 32, 8, 10, 2), LaunchPlan(500, 1000),
                        2000)
        return Plan(mlp, GptPlan(6, 512, 8, 256, 32, 8192, 10), ResnetPlan(64, 224, 64, 1000, 10),
                    LaunchPlan(10_000, 1000), 20_000)


# -- the models -------------------------------------------------------------------------------------------------
def mlp_model(plan: MlpPlan) -> nn.Module:
    sizes = plan.sizes
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 1):
        layers.append(nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DecoderBlock(nn.Module):
    """A pre-norm decoder block: causal multi-head self-attention, then a 4x GELU MLP, each residual."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = (t.view(batch, seq, self.heads, d_model // self.heads).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).split(d_model, dim=2))
        y = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, seq, d_model))
        return x + self.mlp(self.ln2(x))  # type: ignore[no-any-return]


class Gpt(nn.Module):
    """A GPT-style decoder: token and learned position embeddings, the blocks, a final LayerNorm, the logits."""

    def __init__(self, plan: GptPlan) -> None:
        super().__init__()
        self.tokens = nn.Embedding(plan.vocab, plan.d_model)
        self.positions = nn.Embedding(plan.seq, plan.d_model)
        self.blocks = nn.Sequential(*(DecoderBlock(plan.d_model, plan.heads) for _ in range(plan.layers)))
        self.ln = nn.LayerNorm(plan.d_model)
        self.head = nn.Linear(plan.d_model, plan.vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions.weight[:idx.shape[1]]
        return self.head(self.ln(self.blocks(x)))  # type: ignore[no-any-return]


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with batch norm, a 1x1 projection where the shape changes."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(y)) + self.shortcut(x))  # type: ignore[no-any-return]


def resnet18(plan: ResnetPlan) -> nn.Module:
    """ResNet-18's shape: a 7x7/2 stem and 3x3/2 max pool, four stages of two basic blocks (1, 2, 4, 8 times the
    width; each stage after the first halves the size), global average pool, a linear classifier."""
    w = plan.width
    stages: list[nn.Module] = []
    for inputs, outputs, stride in ((w, w, 1), (w, 2 * w, 2), (2 * w, 4 * w, 2), (4 * w, 8 * w, 2)):
        stages += [BasicBlock(inputs, outputs, stride), BasicBlock(outputs, outputs, 1)]
    model = nn.Sequential(nn.Conv2d(3, w, 7, 2, 3, bias=False), nn.BatchNorm2d(w), nn.ReLU(inplace=True),
                          nn.MaxPool2d(3, 2, 1), *stages, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8 * w, plan.classes))
    # Running statistics other than BatchNorm's 0/1 defaults, so the eval-mode normalization does something.
    generator = torch.Generator().manual_seed(2)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.copy_(torch.randn(module.num_features, generator=generator) * 0.1)
            module.running_var.copy_(torch.rand(module.num_features, generator=generator) + 0.5)
    return model


# -- the two sides ----------------------------------------------------------------------------------------------
@dataclass
class Side:
    """A device to run on, how to wait for it, and the context its timings run in."""

    name: str
    device: torch.device
    synchronize: Callable[[], None]
    release: Callable[[], None] = lambda: None  # drop cached memory between workloads (native CUDA's allocator)
    context: Callable[[], AbstractContextManager[Any]] = nullcontext


def native_side(backend: str, device: int) -> Side:
    # gbtorch.device() turns multithreaded backward off for this thread (the torch device needs backward on the
    # calling thread); native PyTorch runs it as it would in a process of its own.
    def multithreaded() -> AbstractContextManager[Any]:
        return torch.autograd.set_multithreading_enabled(True)  # type: ignore[no-any-return]

    if backend == "cuda":
        torch.cuda.set_device(device)
        return Side(f"eager PyTorch {torch.__version__} on cuda:{device} ({torch.cuda.get_device_name(device)})",
                    torch.device("cuda", device), torch.cuda.synchronize, torch.cuda.empty_cache, multithreaded)
    return Side(f"eager PyTorch {torch.__version__} on the host CPU ({torch.get_num_threads()} threads; the "
                "worker runs PyTorch's CPU kernels on PoCL)", torch.device("cpu"), lambda: None,
                context=multithreaded)


def ours_side(gpu: Any) -> Side:
    import gpubroker.client.torch as gbtorch

    dev = gbtorch.device(gpu)
    return Side("gpubroker.client.torch through a broker (same-host ring)", dev, lambda: gbtorch.synchronize(dev))


# -- the workloads: (seconds, seconds until queued, what it computed) -----------------------------------------
@dataclass
class Timing:
    seconds: float
    queued: float  # until every operator was queued, before the final read; close to seconds: the host set the pace
    result: Any  # what the workload computed (compared between the sides)


def _train(side: Side, model: torch.nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor, steps: int,
           flatten: bool) -> Timing:
    side.synchronize()  # the model, the optimizer's state and the batch are on the device before the clock
    t0 = time.perf_counter()
    loss = None
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        logits = model(x)
        if flatten:
            logits = logits.reshape(-1, logits.shape[-1])
        loss = functional.cross_entropy(logits, y.reshape(-1) if flatten else y)
        loss.backward()
        opt.step()
    queued = time.perf_counter() - t0
    assert loss is not None
    value = loss.item()
    return Timing(time.perf_counter() - t0, queued, value)


def time_mlp(side: Side, plan: MlpPlan, host: dict[str, Any]) -> Timing:
    def fresh() -> tuple[torch.nn.Module, Any]:
        model = mlp_model(plan)
        model.load_state_dict(host["state"])
        model.to(side.device)
        return model, torch.optim.SGD(model.parameters(), lr=plan.learning_rate)

    x, y = host["inputs"].to(side.device), host["labels"].to(side.device)
    model, opt = fresh()
    _train(side, model, opt, x, y, 2, flatten=False)  # warm up
    model, opt = fresh()
    return _train(side, model, opt, x, y, plan.steps, flatten=False)


def time_gpt(side: Side, plan: GptPlan, host: dict[str, Any]) -> Timing:
    def fresh() -> tuple[torch.nn.Module, Any]:
        model = Gpt(plan)
        model.load_state_dict(host["state"])
        model.to(side.device)
        return model, torch.optim.AdamW(model.parameters(), lr=plan.learning_rate)

    x, y = host["inputs"].to(side.device), host["targets"].to(side.device)
    model, opt = fresh()
    _train(side, model, opt, x, y, 2, flatten=True)  # warm up: AdamW's state is made in its first step
    model, opt = fresh()
    return _train(side, model, opt, x, y, plan.steps, flatten=True)


def time_resnet(side: Side, plan: ResnetPlan, host: dict[str, Any]) -> Timing:
    model = resnet18(plan)
    model.load_state_dict(host["state"])
    model.to(side.device).eval()
    images = host["images"].to(side.device)
    with torch.no_grad():
        model(images)  # warm up
        side.synchronize()
        t0 = time.perf_counter()
        for _ in range(plan.batches):
            logits = model(images)
        queued = time.perf_counter() - t0
        side.synchronize()
        elapsed = time.perf_counter() - t0
    return Timing(elapsed, queued, logits.cpu())


def _increments(x: torch.Tensor, ops: int) -> torch.Tensor:
    for _ in range(ops):
        x = x + 1.0
    return x


def time_launch(side: Side, plan: LaunchPlan) -> Timing:
    start = torch.zeros(plan.elements, device=side.device)
    _increments(start, 10).sum().item()  # warm up
    side.synchronize()
    t0 = time.perf_counter()
    x = _increments(start, plan.ops)
    queued = time.perf_counter() - t0
    value = x[0].item()
    return Timing(time.perf_counter() - t0, queued, value)


def client_cpu_us(side: Side, plan: LaunchPlan, ops: int) -> float:
    """Client CPU microseconds per ``x = x + 1`` queued (the process's CPU time: every thread of this process)."""
    start = torch.zeros(plan.elements, device=side.device)
    _increments(start, 10)  # warm the signature cache
    side.synchronize()
    t0 = time.process_time()
    x = _increments(start, ops)
    spent = time.process_time() - t0
    side.synchronize()
    del x
    return spent / ops * 1e6


# -- one measure --------------------------------------------------------------------------------------------------
def host_data(plan: Plan) -> dict[str, dict[str, Any]]:
    """Each workload's initial parameters and inputs, made on the CPU from fixed seeds (both sides get the same)."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    mlp, gpt, resnet = plan.mlp, plan.gpt, plan.resnet
    inputs = torch.randn(mlp.batch, mlp.sizes[0], generator=generator)
    labels = (inputs @ torch.randn(mlp.sizes[0], mlp.sizes[-1], generator=generator)).argmax(dim=1)
    tokens = torch.randint(0, gpt.vocab, (gpt.batch, gpt.seq + 1), generator=generator)  # next-token targets
    return {
        "mlp": {"state": mlp_model(mlp).state_dict(), "inputs": inputs, "labels": labels},
        "gpt": {"state": Gpt(gpt).state_dict(), "inputs": tokens[:, :-1].contiguous(),
                "targets": tokens[:, 1:].contiguous()},
        "resnet": {"state": resnet18(resnet).state_dict(),
                   "images": torch.randn(resnet.batch, 3, resnet.image, resnet.image, generator=generator)},
    }


def _agreement(name: str, native: Any, ours: Any) -> dict[str, Any]:
    """What each side computed: the final loss or value, or for the network's logits their largest difference
    relative to their largest magnitude."""
    if name == "resnet":
        scale = float(native.abs().max())
        return {"logits_max_abs_diff_rel": float((ours - native).abs().max()) / (scale or 1.0)}
    return {"native": native, "ours": ours}


@contextmanager
def _skipping(name: str, skipped: dict[str, str], progress: Callable[[str], None]) -> Iterator[None]:
    """Run one workload on the torch device; what it cannot do (an operator it lacks, an error it raises) skips
    the workload for the rest of the measure, with the reason, instead of ending the benchmark."""
    try:
        yield
    except Exception as exc:  # (any: the reason goes into the JSON; the other workloads still run)
        skipped[name] = f"{type(exc).__name__}: {exc}"[:500]
        progress(f"{name} skipped: {skipped[name]}")


def _timers(plan: Plan, host: dict[str, dict[str, Any]]) -> dict[str, Callable[[Side], Timing]]:
    return {
        "mlp": lambda side: time_mlp(side, plan.mlp, host["mlp"]),
        "gpt": lambda side: time_gpt(side, plan.gpt, host["gpt"]),
        "resnet": lambda side: time_resnet(side, plan.resnet, host["resnet"]),
        "launch": lambda side: time_launch(side, plan.launch),
    }


def _serve_native(conn: Connection, backend: str, device: int, quick: bool) -> None:
    """The native side's process: times the workload each request names, with the same plan and host data."""
    plan = Plan.make(quick)
    timers = _timers(plan, host_data(plan))
    native = native_side(backend, device)
    conn.send(native.name)
    while (name := conn.recv()) is not None:
        try:
            with native.context():
                value: Timing | float = (client_cpu_us(native, plan.launch, plan.client_cpu_ops)
                                         if name == "client_cpu" else timers[name](native))
            native.release()
            conn.send(("ok", value))
        except Exception as exc:  # (the parent raises it: the benchmark cannot go on without its baseline)
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class NativeProcess:
    """Eager PyTorch in a process of its own. Once a process registers the gpubroker device (PyTorch's PrivateUse1
    backend), PyTorch takes it for the process's accelerator and CUDA's own backward fails inside PyTorch
    (``opt_ready_stream && opt_parent_stream``, pytorch/pytorch#161129): the native side cannot share a process
    with ours. Spawned, not forked (CUDA and the broker's threads)."""

    def __init__(self, backend: str, device: int, quick: bool) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve_native, args=(child, backend, device, quick), daemon=True)
        self._process.start()
        child.close()
        self.name: str = self._conn.recv()

    def time(self, name: str) -> Any:
        """The workload's Timing (``client_cpu``: microseconds per queued operator)."""
        self._conn.send(name)
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"native {name}: {value}")
        return value

    def __enter__(self) -> NativeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._process.join(30)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


def measure(backend: str, quick: bool, runs: int, device: int = 0,
            progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    plan = Plan.make(quick)
    host = host_data(plan)
    native_runs: dict[str, list[float]] = {name: [] for name in (*WORKLOADS, "client_cpu_us")}
    ours_runs: dict[str, list[float]] = {name: [] for name in (*WORKLOADS, "client_cpu_us")}
    queued_runs: dict[str, dict[str, list[float]]] = {name: {"native": [], "ours": []} for name in WORKLOADS}
    checks: dict[str, list[dict[str, Any]]] = {name: [] for name in WORKLOADS}
    skipped: dict[str, str] = {}
    timers = _timers(plan, host)
    with NativeProcess(backend, device, quick) as native, \
            BrokerProcess([TenantSpec("bench", memory_quota=1 << 40)], backend=backend) as broker, \
            connect(broker.target, token=broker.tokens["bench"], device=device, transport="ring",
                    async_commands=True) as gpu:
        if gpu.transport.kind != "ring":
            raise AssertionError(f"asked for the same-host ring transport, got {gpu.transport.kind}")
        info = gpu.device_info()
        ours = ours_side(gpu)
        for run in range(runs):
            for name, timer in timers.items():
                if name in skipped:
                    continue
                progress(f"run {run + 1} of {runs}: {name}, through the broker")
                got: Timing | None = None
                with _skipping(name, skipped, progress):
                    got = timer(ours)
                if got is None:
                    continue
                progress(f"run {run + 1} of {runs}: {name}, native")
                mine: Timing = native.time(name)
                native_runs[name].append(mine.seconds)
                ours_runs[name].append(got.seconds)
                queued_runs[name]["native"].append(mine.queued)
                queued_runs[name]["ours"].append(got.queued)
                checks[name].append(_agreement(name, mine.result, got.result))
            if "client_cpu" not in skipped:
                progress(f"run {run + 1} of {runs}: client CPU per queued operator")
                cpu: float | None = None
                with _skipping("client_cpu", skipped, progress):
                    cpu = client_cpu_us(ours, plan.launch, plan.client_cpu_ops)
                if cpu is not None:
                    ours_runs["client_cpu_us"].append(cpu)
                    native_runs["client_cpu_us"].append(native.time("client_cpu"))
    workloads = _workloads(plan, native_runs, ours_runs, queued_runs, checks, skipped)
    return {
        "bench": "torch", "backend": backend, "quick": quick, "runs": runs,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": {"hostname": socket.gethostname(), "platform": platform.platform(),
                 "python": platform.python_version(), "device": info.name, "driver": info.driver_version,
                 "versions": _versions(backend), "native_cpu_threads": torch.get_num_threads()},
        "source": _commit(),
        "native": native.name, "ours": ours.name,
        "workloads": workloads,
        "targets": _targets(workloads, runs),
    }


def _workloads(plan: Plan, native_runs: dict[str, list[float]], ours_runs: dict[str, list[float]],
               queued_runs: dict[str, dict[str, list[float]]], checks: dict[str, list[dict[str, Any]]],
               skipped: dict[str, str]) -> dict[str, Any]:
    described = {
        "mlp": {**asdict(plan.mlp), "layers": "nn.Sequential Linear-ReLU-Linear-ReLU-Linear, cross-entropy",
                "optimizer": "torch.optim.SGD (its default form for the device)",
                "timed": f"{plan.mlp.steps} steps (zero_grad, forward, backward, step) + loss.item()"},
        "gpt": {**asdict(plan.gpt), "block": "pre-norm: LayerNorm, causal scaled_dot_product_attention, "
                "LayerNorm, Linear-GELU-Linear (4x), residuals", "optimizer": "torch.optim.AdamW",
                "timed": f"{plan.gpt.steps} steps + loss.item()"},
        "resnet": {**asdict(plan.resnet), "network": "ResNet-18's shape (torch.nn), eval, torch.no_grad",
                   "timed": f"{plan.resnet.batches} forward passes of one resident batch + synchronize"},
        "launch": {**asdict(plan.launch), "dtype": "float32",
                   "timed": f"{plan.launch.ops} x (x = x + 1) + x[0].item()"},
        "client_cpu": {"ops": plan.client_cpu_ops, "operator": f"x = x + 1 on {plan.launch.elements} float32",
                       "measured": "time.process_time() of this process around the queued operators / their "
                                   "number, signature cache warm"},
    }
    out: dict[str, Any] = {}
    for name, description in described.items():
        entry: dict[str, Any] = {"plan": description}
        key = "client_cpu_us" if name == "client_cpu" else name
        if name in skipped:
            entry["skipped"] = skipped[name]
        if ours_runs[key]:  # (a workload skipped in a later run keeps the runs it had)
            if name == "client_cpu":
                entry["ours_us_per_op"] = summarize(ours_runs[key])
                entry["native_us_per_op"] = summarize(native_runs[key])
            else:
                entry["native_s"] = summarize(native_runs[key])
                entry["ours_s"] = summarize(ours_runs[key])
                entry["queued_s"] = {side: summarize(values) for side, values in queued_runs[key].items()}
                entry["ours_over_native"] = summarize([o / n for o, n in zip(ours_runs[key], native_runs[key],
                                                                             strict=True)])
                entry["checks"] = checks[key]
        out[name] = entry
    return out


def _targets(workloads: dict[str, Any], runs: int) -> dict[str, Any]:
    targets: dict[str, Any] = {}
    for name, limit in TARGETS.items():
        entry = workloads[name]
        target: dict[str, Any] = {"target": f"<= {limit}x native (median of {runs})"}
        if "ours_over_native" in entry:
            ratio = entry["ours_over_native"]["median"]
            target.update(ratio=ratio, met=ratio <= limit)
        else:
            target.update(ratio=None, met=False, skipped=entry.get("skipped", "not measured"))
        targets[name] = target
    entry = workloads["client_cpu"]
    cpu: dict[str, Any] = {"target": f"<= {CLIENT_CPU_TARGET_US:g} us of client CPU per queued operator "
                                     f"(median of {runs})"}
    if "ours_us_per_op" in entry:
        us = entry["ours_us_per_op"]["median"]
        cpu.update(us=us, met=us <= CLIENT_CPU_TARGET_US)
    else:
        cpu.update(us=None, met=False, skipped=entry.get("skipped", "not measured"))
    targets["client_cpu"] = cpu
    return targets


def _versions(backend: str) -> dict[str, str]:
    names = ["torch", "numpy"] + (["pyopencl"] if backend != "cuda" else [])
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    if backend == "cuda":
        out["cuda"] = str(torch.version.cuda)
        out["cudnn"] = str(torch.backends.cudnn.version())
    return out


# -- output -------------------------------------------------------------------------------------------------------
def table(result: dict[str, Any]) -> str:
    w = result["workloads"]
    lines = [f"{result['host']['device']} on {result['host']['hostname']}", f"native: {result['native']}",
             f"ours: {result['ours']}", f"medians of {result['runs']} runs [min-max]", "",
             f"{'workload':<48} {'native':>12} {'gpubroker':>26} {'ratio':>18}"]

    def spread(stat: dict[str, float], fmt: str) -> str:
        return f"{stat['median']:{fmt}} [{stat['min']:{fmt}}-{stat['max']:{fmt}}]"

    mlp, gpt, resnet, launch = (w[name]["plan"] for name in WORKLOADS)
    labels = {
        "mlp": f"MLP {'-'.join(map(str, mlp['sizes']))} b{mlp['batch']}, {mlp['steps']} SGD steps (s)",
        "gpt": f"GPT {gpt['layers']}x{gpt['d_model']} h{gpt['heads']} T{gpt['seq']} b{gpt['batch']}, "
               f"{gpt['steps']} AdamW steps (s)",
        "resnet": f"ResNet-18 w{resnet['width']} b{resnet['batch']} {resnet['image']}px, {resnet['batches']} "
                  "passes (s)",
        "launch": f"{launch['ops']} x (x + 1) on {launch['elements']}, .item() (s)",
    }
    for name, label in labels.items():
        entry = w[name]
        if "ours_s" not in entry:
            lines.append(f"{label:<48} skipped: {entry.get('skipped', 'not measured')}")
            continue
        lines.append(f"{label:<48} {entry['native_s']['median']:>12.4f} {spread(entry['ours_s'], '.4f'):>26} "
                     f"{spread(entry['ours_over_native'], '.2f'):>18}")
        lines.append(f"{'  of which queueing':<48} {entry['queued_s']['native']['median']:>12.4f} "
                     f"{spread(entry['queued_s']['ours'], '.4f'):>26}")
    cpu = w["client_cpu"]
    label = f"client CPU per queued x + 1, {cpu['plan']['ops']} ops (us)"
    if "ours_us_per_op" in cpu:
        lines.append(f"{label:<48} {cpu['native_us_per_op']['median']:>12.2f} "
                     f"{spread(cpu['ours_us_per_op'], '.2f'):>26}")
    else:
        lines.append(f"{label:<48} skipped: {cpu.get('skipped', 'not measured')}")
    lines.append("")
    for name, t in result["targets"].items():
        figure = t.get("ratio", t.get("us"))
        status = "SKIP" if "skipped" in t else ("met " if t["met"] else "MISS")
        lines.append(f"  {status} {name}: {t['target']}: " + (f"{figure:.2f}" if figure is not None else
                                                                  t.get("skipped", "")))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpubroker bench torch", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backend", default="auto", choices=["auto", "cuda", "opencl"])
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CI)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", help="write the JSON here (default: a new file in bench/results/)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    try:
        import torch  # noqa: F401
    except ImportError:
        parser.error("bench torch needs PyTorch beside gpubroker (pip install 'gpubroker[torch]')")
    backend = detect_backend() if args.backend == "auto" else args.backend
    result = measure(backend, args.quick, args.runs, args.device,
                     progress=lambda text: print(f"bench torch: {text}", file=sys.stderr, flush=True))
    write_result(result, "torch", backend, args.quick, args.out)
    print(table(result), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
