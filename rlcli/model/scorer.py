"""The policy as one module whose forward ends in the head: label log-probs, or the fused head + loss.

Keeping the head inside a `forward` lets sharding wrappers (FSDP) gather and free the embedding,
final norm and head weights around it like any other parameters.
"""

from __future__ import annotations

import torch

from rlcli.model import varlen_attention
from rlcli.modules.lm_head import HeadSpec, token_logprobs


class TokenScorer(torch.nn.Module):
    """``forward(input_ids [L], position_ids [L], labels [L]) -> (logprobs [L], entropy [L] | None)``
    for one packed row of whole documents (no attention across documents).

    With ``head_loss``, a callable ``(hidden [L, H], head weight [V, H]) -> result``, the forward
    returns ``head_loss``'s result instead (e.g. `fused_micro_batch_loss`), still inside the forward.
    """

    def __init__(self, policy: torch.nn.Module, head: HeadSpec, *, with_entropy: bool) -> None:
        super().__init__()
        self.policy = policy
        self.head = head
        self.with_entropy = with_entropy

    def forward(self, input_ids, position_ids, labels, head_loss=None):
        documents = {}  # varlen attention: the row's document offsets, found once for all layers
        if getattr(self.policy.config, "_attn_implementation", None) == varlen_attention.NAME:
            documents = varlen_attention.packed_row_kwargs(position_ids[None])
        hidden = self.policy.base_model(
            input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False, **documents
        ).last_hidden_state[0]  # [L, H]
        weight = self.policy.get_output_embeddings().weight  # [V, H]
        if head_loss is not None:
            return head_loss(hidden, weight)
        return token_logprobs(hidden, weight, labels, self.head, with_entropy=self.with_entropy)
