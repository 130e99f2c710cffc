"""Operations PyTorch dispatches per update, and the host-synchronising ones among them, counted exactly.

On a GPU every dispatched operation is (at least) one kernel launch, and every synchronising one
(``.item()``, ``nonzero``, ``unique``, boolean indexing, a blocking copy between devices, ...) makes
the host wait until the device queue has run everything before it. Both are counted here on any
device by `OpCounter`, a `TorchDispatchMode` (the aten operations) entered with a `TorchFunctionMode`
(host reads that dispatch nothing on CPU, such as ``Tensor.tolist``):

* **rlcli train**: the CLI's own entry point (`rlcli.cli.run`, in-process), ``model=tiny`` on
  ``data=rollouts`` at 4 and at 16 micro-batches per step, on ``data=generate`` (the default task) and
  on ``data=stream`` (records pushed into a Redis server started here); counted inside
  `PolicyModule.training_step`, but not while the step source collects its batch (reading,
  sampling or waiting for rollouts is not the update): ops and syncs per optimizer step;
* **throughput loops**: one pass of `benchmarks.throughput`'s packed loop and one of its padded
  loop over the same 64 rollouts, and their ops per forward.

Usage: ``python -m benchmarks.dispatch [--steps 2] [--where N] [--no-stream] [--device cpu] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import signal
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.machine import device_name
from benchmarks.output import report

RLCLI = str(Path(__file__).resolve().parents[1] / "rlcli") + "/"
HERE = str(Path(__file__).resolve())
TORCH = str(Path(torch.__file__).parent) + "/"


def _on_another_device(tensor: torch.Tensor, device) -> bool:
    return device is not None and torch.device(device) != tensor.device


def _off_the_cpu(args, kwargs) -> bool:  # torch.tensor(data, *, device)
    return kwargs.get("device") is not None and torch.device(kwargs["device"]).type != "cpu"


def _boolean_index(args, kwargs) -> bool:
    return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])


def _blocking_copy(args, kwargs) -> bool:  # aten._to_copy(self, *, device, non_blocking)
    return _on_another_device(args[0], kwargs.get("device")) and not kwargs.get("non_blocking", False)


def _blocking_copy_into(args, kwargs) -> bool:  # aten.copy_(self, src, non_blocking)
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    return args[0].device != args[1].device and not non_blocking


def _no_output_size(args, kwargs) -> bool:  # aten.repeat_interleave(repeats, *, output_size)
    return kwargs.get("output_size", args[2] if len(args) > 2 else None) is None


def _always(args, kwargs) -> bool:
    return True


# The host-synchronising operations, each with its rule on the op's arguments (the host waits where it
# holds). The aten ones by operator name, as the dispatch mode sees them: composite operators arrive
# decomposed (``.item()``, ``float(t)``, ``bool(t)`` as _local_scalar_dense, ``torch.where(cond)`` as nonzero).
SYNCS = {
    "aten._local_scalar_dense": _always,  # .item(), float(t), int(t), bool(t), `if t:`: a value on the host
    "aten.nonzero": _always,  # nonzero, torch.where(cond), argwhere: output size from the values
    "aten._unique": _always,  # torch.unique: output size from the values
    "aten._unique2": _always,  # torch.unique (its usual kernel)
    "aten.unique_dim": _always,  # torch.unique(dim=...)
    "aten.unique_consecutive": _always,  # torch.unique_consecutive
    "aten.masked_select": _always,  # t.masked_select(mask): output size from the mask
    "aten.is_nonzero": _always,  # bool(t) where it arrives undecomposed
    "aten.equal": _always,  # torch.equal: a Python bool from the values
    "aten.repeat_interleave": _no_output_size,  # repeat_interleave(repeats): output size from sum(repeats)
    "aten.index": _boolean_index,  # t[mask]: a nonzero of the mask
    "aten.index_put": _boolean_index,  # t[mask] = v (out of place)
    "aten.index_put_": _boolean_index,  # t[mask] = v
    "aten._to_copy": _blocking_copy,  # t.to(other_device), t.cpu(), t.cuda() with non_blocking=False
    "aten.copy_": _blocking_copy_into,  # dst.copy_(src on another device) with non_blocking=False
}
# Host reads seen as Python functions: (name, rule). On CPU they dispatch nothing; what they dispatch on a
# GPU (a copy to the host) is part of the same sync, not counted again.
FUNCTION_SYNCS = {
    torch.Tensor.tolist: ("Tensor.tolist", _always),  # the values as Python numbers
    torch.Tensor.numpy: ("Tensor.numpy", _always),  # the values as a NumPy array (host memory)
    torch.tensor: ("torch.tensor", _off_the_cpu),  # torch.tensor(data, device=GPU): a blocking copy from the host
}


class _Functions(TorchFunctionMode):
    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name, rule = FUNCTION_SYNCS.get(func, (None, None))
        if rule is None or not rule(args, kwargs):
            return func(*args, **kwargs)
        self.counter._sync(name)
        self.counter._inside += 1  # what it dispatches is part of this one synchronisation
        try:
            return func(*args, **kwargs)
        finally:
            self.counter._inside -= 1


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        counter = self.counter
        if not counter._paused:
            name = str(func.overloadpacket)  # aten.index, whatever the overload
            counter.ops[name] += 1
            rule = SYNCS.get(name)
            if rule is not None and not counter._inside and rule(args, kwargs):
                counter._sync(name)
        return func(*args, **kwargs)


class OpCounter:
    """``with OpCounter() as c: ...`` counts the aten operations dispatched in this thread (``c.ops`` by
    name, ``c.total``) and the host-synchronising ones among them (``c.syncs`` by name, ``c.sync_count``;
    `SYNCS`, `FUNCTION_SYNCS`). ``where=N`` also records each sync's place: its ``N`` innermost frames in
    rlcli (``c.sites``, by (name, place)). Nothing is counted inside ``with c.paused():``."""

    def __init__(self, where: int = 0) -> None:
        self.where = where
        self.ops: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.sites: Counter[tuple[str, str]] = Counter()
        self._paused = 0
        self._inside = 0
        self._modes = contextlib.ExitStack()

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def sync_count(self) -> int:
        return sum(self.syncs.values())

    def __enter__(self) -> OpCounter:
        self._modes.enter_context(_Functions(self))
        self._modes.enter_context(_Dispatch(self))
        return self

    def __exit__(self, *exc) -> None:
        self._modes.close()

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def _sync(self, name: str) -> None:
        if self._paused:
            return
        self.syncs[name] += 1
        if self.where:
            self.sites[(name, _place(self.where))] += 1

    def report_sites(self) -> str:
        """One line per (sync, place), the most frequent first."""
        return "\n".join(f"{n:>5} × {name} at {place}" for (name, place), n in self.sites.most_common())


def _place(frames: int) -> str:
    """The ``frames`` innermost rlcli frames of the caller (``a ← b``, innermost first); where there are
    none, the innermost frame outside torch and this file."""
    rlcli, outside = [], None
    frame = sys._getframe(1)
    while frame is not None and len(rlcli) < frames:
        file = frame.f_code.co_filename
        if file.startswith(RLCLI):
            rlcli.append(f"rlcli/{file[len(RLCLI):]}:{frame.f_lineno} {frame.f_code.co_name}")
        elif outside is None and file != HERE and not file.startswith(TORCH):
            outside = f"{file}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return " ← ".join(rlcli) or outside or "?"


class StepCounts:
    """The counters of `rlcli train`'s optimizer steps, while ``with StepCounts(where) as counts:`` is open:
    ``counts.steps``, one `OpCounter` per step of `PolicyModule.training_step` (paused while the step
    source collects its batch), and ``counts.micro_batches``, for each step one `OpCounter` per
    micro-batch of its loop: its `MicroBatchLoss.loss` and the backward that follows
    (`PolicyModule.manual_backward`)."""

    def __init__(self, where: int = 0) -> None:
        self.where = where
        self.steps: list[OpCounter] = []
        self.micro_batches: list[list[OpCounter]] = []
        self._patches = contextlib.ExitStack()

    def __enter__(self) -> StepCounts:
        from rlcli.training.loss import MicroBatchLoss
        from rlcli.training.module import PolicyModule

        training_step, loss, backward = PolicyModule.training_step, MicroBatchLoss.loss, PolicyModule.manual_backward
        counts = self

        def counted_step(module, *args, **kwargs):
            counter, source = OpCounter(counts.where), module.source
            collect = source.next_batch

            def paused_collect(*args, **kwargs):  # the step source's collection is not the update
                with counter.paused():
                    return collect(*args, **kwargs)

            counts.micro_batches.append([])
            source.next_batch = paused_collect
            try:
                with counter:
                    out = training_step(module, *args, **kwargs)
            finally:
                del source.next_batch  # the source's own method again
            if out is None:  # out of data: no update
                counts.micro_batches.pop()
            else:
                counts.steps.append(counter)
            return out

        def counted_loss(*args, **kwargs):
            counts.micro_batches[-1].append(OpCounter(counts.where))
            with counts.micro_batches[-1][-1]:
                return loss(*args, **kwargs)

        def counted_backward(*args, **kwargs):
            with counts.micro_batches[-1][-1]:  # the micro-batch whose loss this is
                return backward(*args, **kwargs)

        for cls, name, original in ((PolicyModule, "training_step", training_step), (MicroBatchLoss, "loss", loss),
                                    (PolicyModule, "manual_backward", backward)):
            self._patches.callback(setattr, cls, name, original)
        PolicyModule.training_step, PolicyModule.manual_backward = counted_step, counted_backward
        MicroBatchLoss.loss = counted_loss
        return self

    def __exit__(self, *exc) -> None:
        self._patches.close()


def rlcli_train(overrides: list[str]) -> None:
    """``rlcli train OVERRIDES`` through the CLI's entry point, in this process, in a temporary run directory.
    What the CLI sets for a process it ends (umask, blocked signals, environment) is put back after."""
    from rlcli.cli import run

    argv, environ = sys.argv, dict(os.environ)
    umask, signals = os.umask(0o077), signal.pthread_sigmask(signal.SIG_BLOCK, [])
    os.umask(umask)
    with tempfile.TemporaryDirectory() as run_dir:
        sys.argv = ["rlcli", "train", *overrides, f"hydra.run.dir={run_dir}"]
        try:
            run()
        except SystemExit as exit:
            if exit.code:
                raise RuntimeError(f"rlcli train {' '.join(overrides)} exited with {exit.code}") from None
        finally:
            sys.argv = argv
            os.environ.clear()
            os.environ.update(environ)
            os.umask(umask)
            signal.pthread_sigmask(signal.SIG_SETMASK, signals)


# `rlcli train` configurations measured: (name, overrides); every one also gets `trainer.max_steps`
TRAIN_RUNS = {
    "rollouts, 4 micro-batches": ["data=rollouts", "trainer.accumulate_microbatches=4", "data.epochs=100"],
    "rollouts, 16 micro-batches": ["data=rollouts", "trainer.accumulate_microbatches=16", "data.epochs=100"],
    "generate (reverse task)": ["data=generate"],
    "stream (Redis)": ["data=stream", "model.vocab_size=64", "data.max_lag=1000000", "data.idle_timeout=1"],
}


def count_train(overrides: list[str], *, steps: int, device: str, where: int) -> dict:
    """Ops and syncs of each optimizer step of ``rlcli train model=tiny OVERRIDES`` (``steps`` steps)."""
    accelerator = "gpu" if torch.device(device).type == "cuda" else "cpu"
    quiet = io.StringIO()  # the run's console: shown only if it fails
    with StepCounts(where) as counts, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        try:
            rlcli_train(["model=tiny", "logger=none", f"trainer.max_steps={steps}",
                         f"trainer.accelerator={accelerator}", *overrides])
        except RuntimeError:
            print(quiet.getvalue(), file=sys.__stderr__)
            raise
    return dict(steps=[_counts(step) | dict(micro_batches=len(loop), loop_syncs=sum(c.sync_count for c in loop))
                       for step, loop in zip(counts.steps, counts.micro_batches)])


def count_stream(overrides: list[str], *, steps: int, device: str, where: int) -> dict:
    """`count_train` with ``data=stream``: a Redis server in a temporary directory, the example rollouts
    pushed into it (`rlcli stream push`), and a run that ends once the stream is empty."""
    from rlcli.cli import main as rlcli_main
    from rlcli.stream import EmbeddedRedis

    rollouts = str(Path(RLCLI) / "examples" / "toy_rollouts.jsonl")
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(tmp) as server:
        with contextlib.redirect_stdout(io.StringIO()):
            if rlcli_main(["stream", "push", rollouts, "--url", server.url]) != 0:
                raise RuntimeError("rlcli stream push failed")
        return count_train([*overrides, f"data.url={server.url}"], steps=steps, device=device, where=where)


def count_loops(device: str, where: int) -> dict:
    """Ops and syncs of one pass of `benchmarks.throughput`'s packed loop and one of its padded loop, with its
    default settings (a first pass dispatches what later ones do: no warm-up)."""
    from benchmarks import throughput

    loops = throughput.loops(throughput._parse(["--device", device]))
    result = dict(loops.info)
    for name, forwards in (("packed", "packed_micro_batches"), ("padded", "padded_batches")):
        with OpCounter(where) as counter:
            getattr(loops, name)()
        result[name] = _counts(counter) | {"forwards": loops.info[forwards]}
    return result


def _counts(counter: OpCounter) -> dict:
    return dict(ops=counter.total, syncs=counter.sync_count, syncs_by_name=dict(counter.syncs.most_common()),
                sites=[dict(op=name, at=place, count=n) for (name, place), n in counter.sites.most_common()],
                ops_by_name=dict(counter.ops.most_common()))


def run(args) -> dict:
    result = dict(device=args.device, device_name=device_name(args.device), torch=torch.__version__, train={})
    for name, overrides in TRAIN_RUNS.items():
        if name.startswith("stream") and args.no_stream:
            continue
        count = count_stream if name.startswith("stream") else count_train
        print(f"counting rlcli train {' '.join(overrides)} ...", file=sys.stderr, flush=True)
        result["train"][name] = count(overrides, steps=args.steps, device=args.device, where=args.where) | dict(
            overrides=overrides)
    print("counting the throughput benchmark's loops ...", file=sys.stderr, flush=True)
    result["loops"] = count_loops(args.device, args.where)
    return result


def _by_name(syncs: dict) -> str:
    return ", ".join(f"{n} {name.removeprefix('aten.')}" for name, n in syncs.items()) or "none"


def format_table(r: dict) -> str:
    lines = [f"`rlcli train model=tiny` through `rlcli.cli.run`, counted in `PolicyModule.training_step` (not while "
             f"the step source collects its batch); the last step of each run (the first also creates the "
             f"optimizer's state); torch {r['torch']} on {r['device_name']}",
             "",
             "| data | micro-batches / step | ops / step | syncs / step | syncs by name | syncs in the micro-batch "
             "loop (loss + backward) | ops / micro-batch |",
             "|---|---:|---:|---:|---|---:|---:|"]
    for name, run in r["train"].items():
        s = run["steps"][-1]
        lines.append(f"| {name} | {s['micro_batches']} | {s['ops']} | {s['syncs']} | {_by_name(s['syncs_by_name'])} "
                     f"| {s['loop_syncs']} | {s['ops'] / max(1, s['micro_batches']):.0f} |")
    loops = r["loops"]
    lines += ["", f"`benchmarks.throughput`'s loops, one pass over the same {loops['documents']} rollouts "
              f"({loops['real_tokens']} real tokens, H={loops['model']['hidden']}, V={loops['model']['vocab']})", "",
              "| loop | forwards | ops | syncs | syncs by name | ops / forward |", "|---|---:|---:|---:|---|---:|"]
    for name in ("packed", "padded"):
        s = loops[name]
        lines.append(f"| {name} | {s['forwards']} | {s['ops']} | {s['syncs']} | {_by_name(s['syncs_by_name'])} "
                     f"| {s['ops'] / s['forwards']:.0f} |")
    return "\n".join(lines)


def format_sites(r: dict) -> str:
    """Where the syncs of each measurement come from (``--where``)."""
    parts = [(f"rlcli train, {name}", run["steps"][-1]["sites"]) for name, run in r["train"].items()]
    parts += [(f"{name} loop", r["loops"][name]["sites"]) for name in ("packed", "padded")]
    return "\n\n".join(f"syncs of {title}:\n" + "\n".join(f"{s['count']:>5} × {s['op']} at {s['at']}" for s in sites)
                       for title, sites in parts if sites)


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dispatch", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps of each rlcli train run (>= 1)")
    parser.add_argument("--where", type=int, default=0, metavar="N",
                        help="also print where each sync comes from: its N innermost rlcli frames (0: not)")
    parser.add_argument("--no-stream", action="store_true", help="skip data=stream (it starts a Redis server)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.where < 0:
        parser.error("need --steps >= 1 and --where >= 0")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    result = run(args)
    table = format_table(result) + (f"\n\n{format_sites(result)}" if args.where else "")
    return report(result, table, args.json)


if __name__ == "__main__":
    main(sys.argv[1:])
