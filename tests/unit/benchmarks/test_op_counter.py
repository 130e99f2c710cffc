"""`benchmarks.dispatch.OpCounter`: the host-synchronising operations it counts, against counts derived by hand.

Each case names an expression and the syncs it makes (one op that needs a value on the host, or none);
deleting a rule from `SYNCS`/`FUNCTION_SYNCS`, or counting an op whatever its arguments, fails a case.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.dispatch import OpCounter

T = torch.tensor([1.0, -2.0, 3.0])

SYNCING = {  # expression: the one sync it makes
    "tolist": (lambda: torch.arange(3.0).tolist(), "Tensor.tolist"),
    "numpy": (lambda: T.numpy(), "Tensor.numpy"),
    "float": (lambda: float(T[0]), "aten._local_scalar_dense"),
    "int": (lambda: int(T[0]), "aten._local_scalar_dense"),
    "bool": (lambda: bool(T[0] > 0), "aten._local_scalar_dense"),
    "item": (lambda: T.sum().item(), "aten._local_scalar_dense"),
    "boolean index": (lambda: T[T > 0], "aten.index"),
    "boolean index put": (lambda: T.clone().__setitem__(T > 0, 0.0), "aten.index_put_"),
    "unique": (lambda: torch.unique(T), "aten._unique2"),
    "unique dim": (lambda: torch.unique(T[None], dim=0), "aten.unique_dim"),
    "unique consecutive": (lambda: torch.unique_consecutive(T), "aten.unique_consecutive"),
    "nonzero": (lambda: T.nonzero(), "aten.nonzero"),
    "where(cond)": (lambda: torch.where(T > 0), "aten.nonzero"),
    "masked_select": (lambda: T.masked_select(T > 0), "aten.masked_select"),
    "equal": (lambda: torch.equal(T, T), "aten.equal"),
    "repeat_interleave": (lambda: torch.repeat_interleave(T, torch.tensor([1, 2, 1])), "aten.repeat_interleave"),
    "to another device": (lambda: T.to("meta"), "aten._to_copy"),
    "copy_ from another device": (lambda: torch.empty(3, device="meta").copy_(T), "aten.copy_"),
    "tensor(data, device=...)": (lambda: torch.tensor([1.0, 2.0], device="meta"), "torch.tensor"),
}
NOT_SYNCING = {
    "add": lambda: T + 1,
    "integer index": lambda: T[torch.tensor([0, 2])],
    "masked_fill": lambda: T.masked_fill(T > 0, 0.0),
    "where(cond, a, b)": lambda: torch.where(T > 0, T, 0.0),
    "repeat_interleave with output_size": lambda: torch.repeat_interleave(T, torch.tensor([1, 2, 1]), output_size=4),
    "non-blocking copy to another device": lambda: T.to("meta", non_blocking=True),
    "non-blocking copy_ from another device": lambda: torch.empty(3, device="meta").copy_(T, non_blocking=True),
    "copy on the same device": lambda: T.to("cpu", copy=True),
    "tensor(data) on the CPU": lambda: torch.tensor([1.0, 2.0], device="cpu"),
}


@pytest.mark.parametrize("name", SYNCING)
def test_a_synchronising_operation_counts_once_by_its_name(name):
    expression, op = SYNCING[name]
    with OpCounter() as counter:
        expression()
    assert dict(counter.syncs) == {op: 1}


@pytest.mark.parametrize("name", NOT_SYNCING)
def test_an_operation_that_needs_no_value_on_the_host_counts_no_sync(name):
    with OpCounter() as counter:
        NOT_SYNCING[name]()
    assert counter.sync_count == 0 and counter.total >= 1


def test_total_counts_every_dispatched_op_and_nothing_while_paused():
    x = torch.ones(3)
    with OpCounter() as counter:
        y = x * 2 + 1  # mul, add
        with counter.paused():
            float(y.sum())  # sum, _local_scalar_dense: not counted
        y.sum().item()  # sum, _local_scalar_dense
    assert dict(counter.ops) == {"aten.mul": 1, "aten.add": 1, "aten.sum": 1, "aten._local_scalar_dense": 1}
    assert counter.total == 4 and dict(counter.syncs) == {"aten._local_scalar_dense": 1}


def test_where_names_the_lines_that_synchronise():
    def culprit():
        return torch.unique(T)

    with OpCounter(where=1) as counter:
        culprit()
        culprit()
    ((op, place), n), = counter.sites.items()
    assert (op, n) == ("aten._unique2", 2)
    assert place.startswith(f"{__file__}:") and place.endswith(" culprit")  # no rlcli frame: the caller's own
    assert "2 × aten._unique2 at" in counter.report_sites()
