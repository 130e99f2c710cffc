"""Float64 references for on-policy distillation, written from math.md#on-policy-distillation only.

Nothing here imports rlcli: a token's log-probability is the log-softmax of the model's full logits of
its document alone, in float64, at the temperature; the advantage is A_reward + coef (tlp - prox).
"""

from __future__ import annotations

import copy

import torch

F64 = torch.float64


def float64_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A float64 copy of a Hugging Face causal LM, its weights the same values."""
    return copy.deepcopy(model).to(F64).eval()


def ref_completion_logprobs(model64: torch.nn.Module, prompt: list[int], completion: list[int],
                            temperature: float) -> torch.Tensor:
    """``[len(completion)]`` float64: log softmax(z_t / tau) at each completion token, the document alone,
    from the full logits (with autograd through ``model64``'s parameters)."""
    ids = torch.tensor([prompt + completion])
    logits = model64(input_ids=ids).logits[0].to(F64)  # [n, V]
    first = len(prompt) - 1  # the position that predicts the first completion token
    logprobs = torch.log_softmax(logits[first:first + len(completion)] / temperature, dim=-1)
    return logprobs.gather(1, torch.tensor(completion)[:, None])[:, 0]


def ref_distill_advantages(reward_advantages: list[float], teacher: torch.Tensor, student: torch.Tensor,
                           mask: list[int], coef: float) -> list[float]:
    """A_t = A_reward_t + coef (tlp_t - sg(prox_t)) on labelled tokens; unlabelled ones keep A_reward_t."""
    term = (teacher - student).detach()
    return [a + coef * float(d) if m else a for a, d, m in zip(reward_advantages, term, mask)]


def ref_reverse_kl(teacher: list[torch.Tensor], student: list[torch.Tensor], masks: list[list[int]]) -> float:
    """sum_t m_t (prox_t - tlp_t) / T over every document."""
    total = sum(float(s[i] - t[i]) for t, s, m in zip(teacher, student, masks) for i in range(len(m)) if m[i])
    return total / max(sum(sum(m) for m in masks), 1)
