"""The policy as one module whose forward ends in the head: label log-probs, or the fused head + loss.

Keeping the head inside a `forward` lets sharding wrappers (FSDP) gather and free the embedding,
final norm and head weights around it like any other parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlcli.model import varlen_attention
from rlcli.model.lora import head_weight
from rlcli.modules.lm_head import HeadSpec, token_logprobs


@dataclass(frozen=True)
class PackedDocuments:
    """The documents of a packed row as the host knows them (from the packer): what attention within each
    document needs, given so that the model does not find them from the position ids (which waits for the
    device)."""

    index: torch.Tensor  # [L] long, the document of each position (0..S-1), on the device
    offsets: torch.Tensor  # [S + 1] int32, where each document starts, then L, on the device
    longest: int  # the longest document's length

    def model_kwargs(self, attn_implementation: str | None, position_ids: torch.Tensor) -> dict:
        """The model's keyword arguments for this row: its position ids and its documents, by the attention
        kernel's convention: a block-diagonal causal mask for ``sdpa`` (also for a single document, where
        transformers would otherwise look at the position ids on the host to find that out), document
        offsets for ``varlen``. Other kernels get the position ids alone and find the documents themselves."""
        kwargs = {"position_ids": position_ids[None]}
        if attn_implementation == varlen_attention.NAME:
            return kwargs | dict(cu_seq_lens_q=self.offsets, cu_seq_lens_k=self.offsets, max_length_q=self.longest,
                                 max_length_k=self.longest)
        if attn_implementation == "sdpa":
            length = self.index.numel()
            same = self.index.unsqueeze(1) == self.index  # [L, L]
            kwargs["attention_mask"] = torch.tril(same).view(1, 1, length, length)  # True: attend
        return kwargs


class TokenScorer(torch.nn.Module):
    """``forward(input_ids [L], position_ids [L], labels [L]) -> (logprobs [L], entropy [L] | None)``
    for one packed row of whole documents (no attention across documents).

    With ``head_loss``, a callable ``(hidden [L, H], head weight [V, H]) -> result``, the forward
    returns ``head_loss``'s result instead (e.g. `fused_micro_batch_loss`), still inside the forward.
    With ``documents`` (`PackedDocuments`) the row's documents need not be found from its position ids.
    """

    def __init__(self, policy: torch.nn.Module, head: HeadSpec, *, with_entropy: bool) -> None:
        super().__init__()
        self.policy = policy
        self.head = head
        self.with_entropy = with_entropy

    def forward(self, input_ids, position_ids, labels, head_loss=None, documents: PackedDocuments | None = None):
        attn_implementation = getattr(self.policy.config, "_attn_implementation", None)
        if documents is not None:
            kwargs = documents.model_kwargs(attn_implementation, position_ids)
        else:
            kwargs = {"position_ids": position_ids[None]}
            if attn_implementation == varlen_attention.NAME:  # the row's document offsets, found once for all layers
                kwargs |= varlen_attention.packed_row_kwargs(position_ids[None])
        hidden = self.policy.base_model(input_ids=input_ids[None], use_cache=False, **kwargs).last_hidden_state[0]
        weight = head_weight(self.policy)  # [V, H]
        if head_loss is not None:
            return head_loss(hidden, weight)
        return token_logprobs(hidden, weight, labels, self.head, with_entropy=self.with_entropy)
