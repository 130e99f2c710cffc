"""``model.compile=true``: the compiled transformer body gives eager's hidden states within float32 rounding on a
packed row of several documents, and compiles once per grad mode, not once per row length.

Tolerance: eager and compiled float32 differ only in the order of their sums (inductor fuses and reorders
them); a sum of n float32 terms rounded in another order differs by at most about n·eps of the sum of
their magnitudes (eps = 2**-23). The longest sums here run over the intermediate size (128 terms), so
128·eps relative to the largest hidden value (≈ 1.5e-5) bounds the rounding; what a wrong attention gives
(a document attending to another) is ~1e-1.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor import config as inductor_config

from factories import tiny_policy
from rlcli.conf.schema import TinyModelConfig
from rlcli.errors import UserError
from rlcli.model.policy import build_policy, compile_body

EPS = torch.finfo(torch.float32).eps
LONGEST_SUM = 128  # terms: the intermediate size of tiny_policy(hidden_size=64)


def _rtol() -> float:
    return LONGEST_SUM * EPS


@pytest.fixture(scope="module")
def models():
    """(eager, compiled) tiny float32 policies with the same weights; dynamo's caches are emptied first so that
    this module's compile counts are its own."""
    torch._dynamo.reset()
    eager = tiny_policy(64, hidden_size=64)
    compiled = copy.deepcopy(eager)
    compile_body(compiled)
    return eager, compiled


def _packed_row(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids [1, L]`` and ``position_ids [1, L]`` restarting at 0 for each document."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (sum(lengths),), generator=g)
    positions = torch.cat([torch.arange(n) for n in lengths])
    return ids[None], positions[None]


def _hidden(model, ids, positions) -> torch.Tensor:
    return model.base_model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state[0]  # [L, H]


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.slow  # compiling on CPU: ~20 s without inductor's cache
@torch.no_grad()
def test_compiled_hidden_states_equal_eager_and_each_document_alone(models):
    """A packed row of 4 documents: compiled hidden states equal eager's on the row and eager's on each document
    run alone (the independent reference: no attention across documents). Fails if the compiled body lets a
    document see another (the mask is lost when traced) or computes anything but eager's layers."""
    eager, compiled = models
    lengths = [5, 9, 3, 7]
    ids, positions = _packed_row(lengths, seed=1)
    got = _hidden(compiled, ids, positions)  # [L, H]
    atol = _rtol() * _hidden(eager, ids, positions).abs().max().item()
    torch.testing.assert_close(got, _hidden(eager, ids, positions), rtol=0, atol=atol)
    alone = torch.cat([_hidden(eager, part[None], torch.arange(len(part))[None])
                       for part in ids[0].split(lengths)])  # [L, H]
    torch.testing.assert_close(got, alone, rtol=0, atol=atol)


@pytest.mark.slow
def test_one_compile_per_grad_mode_not_per_row_length(models):
    """Rows of other lengths and document counts reuse the graph (dynamic shapes); only a change of grad mode
    compiles again, once. Fails with static shapes (a compile for the second length) or when the body is not
    compiled at all (no graph for the grad mode)."""
    eager, compiled = models
    with torch.no_grad():
        _hidden(compiled, *_packed_row([4, 6], seed=2))  # compiled here unless the other test did
        before = _graphs()
        for lengths, seed in (([11, 2, 8], 3), ([3, 3, 3, 3, 3], 4), ([20], 5)):
            _hidden(compiled, *_packed_row(lengths, seed))
        assert _graphs() == before
    for lengths, seed in (([6, 10], 6), ([2, 9, 4], 7)):
        _hidden(compiled, *_packed_row(lengths, seed)).sum().backward()
    assert _graphs() == before + 1


def test_no_cxx_compiler_is_a_user_error_naming_model_compile():
    """Inductor without a working C++ compiler (here: one that does not exist) is refused when the policy is
    built, naming model.compile and both ways out. Fails if compile_body does not check the compiler."""
    model = tiny_policy(64, hidden_size=64)
    with inductor_config.patch({"cpp.cxx": ("/nonexistent/c++",)}):
        with pytest.raises(UserError, match=r"model\.compile: .*install a C\+\+ compiler.*model\.compile=false"):
            compile_body(model)


def test_varlen_attention_is_refused_before_the_model_is_built():
    """``model.attn_implementation=varlen`` loops over a row's documents, which inductor fails to compile (torch
    2.13: an error at the first step): refused up front, naming both keys. Fails if the combination is let through
    (build_policy would return a model)."""
    cfg = TinyModelConfig(kind="tiny", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                          max_position_embeddings=64, dtype="float32", gradient_checkpointing=False,
                          attn_implementation="varlen", init_std=None, suggested_lr=1e-3, compile=True, lora=None)
    with pytest.raises(UserError, match=r"model\.compile: not with model\.attn_implementation=varlen"):
        build_policy(cfg)
