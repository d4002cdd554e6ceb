"""
Where a training step's time goes: torch.profiler over a few forward+backward steps of each mode, the modes
interleaved, with routing's share of the step split by operation, forward and backward.

    python cli.py bench --config w128 --threads 1 --profile --residual baseline,attnres,attnres-h4

Routing is everything the residual stream does: Stream.read, write and output (FastStream's too) run inside
a profiler range named "routing", so in the forward pass every operation under such a range is routing's. In
the backward pass an operation is routing's when the autograd node it runs for was made by a routing range's
operation in the forward pass: profiler events carry the node's sequence number, and the last forward event
that reports a number is the one that made the node (an operation that makes no node reports the next
number too, before its maker). The baseline's row is its plain stream (x + v), the floor every mode pays.
The profiler adds a few microseconds to each operation it records, so many small operations look costlier
here than they are: `bench` without --profile gives the ratios that count (docs/speed.md).

Compiled (`bench --compile --profile`), routing's operations are fused into Inductor's kernels with the rest,
so the step is split by kind instead: the matrix products, attention, the fused kernels (Inductor's generated
code, each graph's call) and what is left, forward and backward.
"""
import collections
import contextlib
import functools

from torch.profiler import ProfilerActivity, profile, record_function

import delta_gpt as M

SCOPE = "routing"
STREAM_METHODS = ((M.Stream, ("read", "write", "output")), (M.FastStream, ("__init__", "read")))


@contextlib.contextmanager
def routing_ranges():
    """Stream's and FastStream's methods run inside record_function(SCOPE) until the block ends."""
    saved = [(cls, name, cls.__dict__[name]) for cls, names in STREAM_METHODS for name in names]

    def ranged(method):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            with record_function(SCOPE):
                return method(*args, **kwargs)
        return wrapper

    for cls, name, method in saved:
        setattr(cls, name, ranged(method))
    try:
        yield
    finally:
        for cls, name, method in saved:
            setattr(cls, name, method)


def op_name(event):
    """An event's name in the table: aten operations by their own name, Python and engine time said so."""
    name = event.name
    if name.startswith("aten::"):
        return name[len("aten::"):]
    if name == SCOPE:
        return "Stream (Python)"
    if name.startswith("autograd::engine::evaluate_function"):
        return "autograd engine"
    return f"{name} (Python)"  # a custom autograd Function's own code: RouteRead, ScoreBackward, ...


def profile_modes(models, idx, steps=5, warmup=2):
    """{mode: dict(forward=ms, backward=ms, routing={"forward": {op: ms}, "backward": {op: ms}})}, per step,
    from `steps` profiled forward+backward steps of each model, interleaved, after `warmup` unprofiled ones."""

    def step(model, tag):
        with record_function(f"{tag}|forward"):
            _, loss = model(idx, idx)
        with record_function(f"{tag}|backward"):
            loss.backward()
        model.zero_grad(set_to_none=True)

    with routing_ranges():
        for model in models.values():
            for _ in range(warmup):
                _, loss = model(idx, idx)
                loss.backward()
                model.zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                for mode, model in models.items():
                    step(model, mode)
    events = sorted(prof.events(), key=lambda e: e.time_range.start)

    def enclosing(event):
        chain, parent = [], event.cpu_parent
        while parent is not None:
            chain.append(parent)
            parent = parent.cpu_parent
        return chain

    maker = {}  # (thread, sequence number) -> was the forward event that made the node in a routing range
    for e in events:
        chain = enclosing(e)
        if e.sequence_nr >= 0 and not e.name.startswith("autograd::engine") and any("|forward" in a.name for a in chain):
            maker[e.thread, e.sequence_nr] = any(a.name == SCOPE for a in chain) or e.name == SCOPE
    rows = {mode: dict(forward=0.0, backward=0.0, routing=dict(forward=collections.Counter(),
                                                                   backward=collections.Counter()))
            for mode in models}
    for e in events:
        chain = enclosing(e)
        if "|" in e.name:
            mode, phase = e.name.split("|")
            rows[mode][phase] += e.cpu_time_total / 1000 / steps
            continue
        top = next((a for a in chain if "|" in a.name), None)
        if top is None:
            continue
        mode, phase = top.name.split("|")
        if phase == "forward":
            routed = e.name == SCOPE or any(a.name == SCOPE for a in chain)
        else:
            node = next((a for a in [e, *chain] if a.name.startswith("autograd::engine::evaluate_function")), None)
            routed = node is not None and maker.get((node.fwd_thread, node.sequence_nr), False)
        if routed:
            rows[mode]["routing"][phase][op_name(e)] += e.self_cpu_time_total / 1000 / steps
    return rows


def profile_table(rows, top=6):
    """The rows as Markdown: one line per mode and pass with routing's milliseconds and its largest operations."""
    lines = ["| mode | pass | step ms | routing ms | share | routing's largest operations, ms per step |",
             "|---|---|---|---|---|---|"]
    for mode, r in rows.items():
        step = r["forward"] + r["backward"]
        for phase in ("forward", "backward"):
            ops = r["routing"][phase]
            total = sum(ops.values())
            largest = ", ".join(f"{name} {ms:.1f}" for name, ms in ops.most_common(top) if ms >= 0.05)
            lines.append(f"| {mode} | {phase} | {r[phase]:.1f} | {total:.1f} | {total / step:.1%} | {largest or '-'} |")
    return "\n".join(lines)


KINDS = ("matrix products", "attention", "fused kernels", "other")


def kind_of(name):
    """The kind of a compiled step's operation: a matrix product, attention, a call of Inductor's fused code."""
    if name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_mm", "aten::matmul"):
        return "matrix products"
    if "scaled_dot_product" in name or "flash_attention" in name:
        return "attention"
    if name.startswith("## Call CompiledFxGraph") or "cpp_fused" in name:
        return "fused kernels"
    return "other"


def profile_compiled(models, idx, steps=5, warmup=2):
    """{mode: {"forward"|"backward": Counter(kind -> ms per step)}} of compiled models (their first call compiles),
    from `steps` profiled forward+backward steps of each, interleaved, after `warmup` unprofiled ones."""
    for model in models.values():
        for _ in range(warmup):
            _, loss = model(idx, idx)
            loss.backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            for mode, model in models.items():
                with record_function(f"{mode}|forward"):
                    _, loss = model(idx, idx)
                with record_function(f"{mode}|backward"):
                    loss.backward()
    rows = {mode: dict(forward=collections.Counter(), backward=collections.Counter()) for mode in models}
    for e in prof.events():
        parent = e.cpu_parent
        while parent is not None and "|" not in parent.name:
            parent = parent.cpu_parent
        if "|" not in e.name and parent is not None:
            mode, phase = parent.name.split("|")
            rows[mode][phase][kind_of(e.name)] += e.self_cpu_time_total / 1000 / steps
    return rows


def compiled_profile_table(rows):
    """The compiled rows as Markdown: ms per step of each kind, forward and backward, and the step's difference
    to the first mode's (the baseline's) kind by kind."""
    base = next(iter(rows.values()))
    head = ["mode", "pass", *KINDS, "step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode, r in rows.items():
        for phase in ("forward", "backward"):
            lines.append(f"| {mode} | {phase} | " + " | ".join(f"{r[phase][k]:.1f}" for k in KINDS)
                         + f" | {sum(r[phase].values()):.1f} |")
        if r is not base:
            diff = {k: sum(r[p][k] - base[p][k] for p in ("forward", "backward")) for k in KINDS}
            lines.append(f"| {mode} | minus {next(iter(rows))} | " + " | ".join(f"{diff[k]:+.1f}" for k in KINDS)
                         + f" | {sum(diff.values()):+.1f} |")
    return "\n".join(lines)

