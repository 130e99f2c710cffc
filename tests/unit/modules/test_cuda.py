"""The GPU path (bfloat16 model, float32 head, varlen attention) against float64 references on the CPU.

These run only where a CUDA device is (they were run on an H100, see
docs/performance.md); CI machines have none, and there the same code paths run on the CPU in the other tests.
"""

from __future__ import annotations

import pytest
import torch
from rl_reference import F64, make_step, ref_head, ref_loss, rel_err

from factories import tiny_policy
from rlcli.modules import (
    HeadSpec,
    LossInputs,
    LossSpec,
    Segments,
    StepTotals,
    auto_chunk_tokens,
    fused_micro_batch_loss,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")


@pytest.mark.parametrize("loss", ["grpo", "gspo"])
def test_bfloat16_fused_head_with_fp32_head_matches_float64(loss):
    step = make_step(0, num_docs=40, max_len=30, num_groups=5, empty_docs=2)
    n, hidden_size, vocab = step["mask"].numel(), 64, 5000
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, hidden_size, generator=g).bfloat16()
    weight = (torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5).bfloat16()
    labels = torch.where(step["mask"] > 0, torch.randint(0, vocab, (n,), generator=g), -100)
    ref_lp, _ = ref_head(hidden.to(F64), weight.to(F64), labels)
    old = torch.where(step["mask"] > 0, ref_lp + 0.2 * torch.randn(n, generator=g, dtype=F64), step["old"])
    group_ids, group_index = torch.unique(step["group"], return_inverse=True)

    h = hidden.to(CUDA).requires_grad_(True)
    w = weight.to(CUDA).requires_grad_(True)
    labels_, old_, adv, mask, doc, group = (t.to(CUDA) for t in (labels, old, step["adv"], step["mask"], step["doc"],
                                                                group_index))
    totals = StepTotals.of_tokens(mask, Segments.of(doc), group, group_ids.numel())
    inputs = LossInputs(proximal_logprobs=old_, advantages=adv, mask=mask, document_index=doc, group_index=group)
    value, _ = fused_micro_batch_loss(h, w, labels_, inputs, totals, LossSpec(loss),
                                      HeadSpec(fp32=True, chunk_tokens=100))
    value.backward()

    h64 = hidden.detach().to(F64).requires_grad_(True)
    w64 = weight.detach().to(F64).requires_grad_(True)
    lp64, _ = ref_head(h64, w64, labels)
    ref_value = ref_loss(lp64, old, step["adv"], step["mask"], step["doc"], step["group"], loss=loss,
                         aggregation="token_mean", eps_low=0.2, eps_high=0.2)
    ref_value.backward()
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16
    assert rel_err(value.cpu().to(F64), ref_value) <= 1e-5
    assert rel_err(h.grad.cpu().to(F64), h64.grad) <= 1e-2
    assert rel_err(w.grad.cpu().to(F64), w64.grad) <= 1e-2


def test_auto_chunks_on_the_gpu_take_the_gpu_budget():
    weight = torch.zeros(152064, 8, device=CUDA)
    assert auto_chunk_tokens(weight.shape[0], weight.device.type) == 1760


def test_varlen_attention_on_the_gpu_equals_the_block_diagonal_mask():
    lengths = [37, 1, 200, 64, 9]
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 100, (1, sum(lengths)), generator=g).to(CUDA)
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(CUDA)
    hidden = {}
    for attn in ("varlen", "sdpa"):
        model = tiny_policy(100, hidden_size=128, max_position_embeddings=512, attn_implementation=attn,
                            dtype="bfloat16").to(CUDA)
        hidden[attn] = model.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state.float()
    scale = hidden["sdpa"].abs().max()
    assert (hidden["varlen"] - hidden["sdpa"]).abs().max() <= 2e-2 * scale
