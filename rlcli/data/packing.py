"""Pack whole documents, in order, into micro-batches of at most ``max_tokens`` tokens
(math.md#words-and-step-totals)."""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rlcli.data.errors import DataError
from rlcli.data.schema import Rollout

__all__ = ["IGNORE_INDEX", "DocumentQueue", "MicroBatch", "fill_micro_batch", "make_micro_batch"]

IGNORE_INDEX = -100
"""Label of a position that is not trained on (the ``ignore_index`` convention of PyTorch)."""


@dataclass
class MicroBatch:
    """Documents concatenated into one row of ``L`` tokens, without padding.

    A causal LM's logits at position ``i`` predict token ``i + 1``, so every per-position
    target describes the *next* token: ``labels[i]`` is token ``i + 1`` when that token is a
    completion token of the same document with ``completion_mask == 1``, else ``IGNORE_INDEX``;
    ``sampler_logprobs[i]`` and ``advantages[i]`` belong to that label token (0 where there is none).
    ``position_ids`` restart at 0 for every document. Log-probs are named by where they come from: the
    sampler's (a record's ``old_logprobs``), the trainer's own at the start of the batch
    (``proximal_logprobs``) and the reference policy's (a record's ``ref_logprobs``); the last two are
    there when every document carries them, else ``None``.
    """

    input_ids: torch.Tensor  # [L] long
    position_ids: torch.Tensor  # [L] long
    labels: torch.Tensor  # [L] long
    sampler_logprobs: torch.Tensor  # [L] float32
    advantages: torch.Tensor  # [L] float32
    mask: torch.Tensor  # [L] float32, 1.0 where labels >= 0
    document_index: torch.Tensor  # [L] long, 0-based document within this micro-batch
    documents: list[Rollout]
    reference_logprobs: torch.Tensor | None = None  # [L] float32
    proximal_logprobs: torch.Tensor | None = None  # [L] float32

    @property
    def num_documents(self) -> int:
        return len(self.documents)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_labelled(self) -> int:
        return int(self.mask.sum().item())

    def labelled_rows(self) -> tuple[list[int], list[int]]:
        """The positions with a label, in order, and how many each document that has any holds: known
        from the documents, without reading a tensor."""
        rows, counts, start = [], [], 0
        for doc in self.documents:
            first = start + len(doc.prompt_ids) - 1  # the position that predicts the first completion token
            kept = [first + i for i, keep in enumerate(doc.completion_mask) if keep]
            rows += kept
            counts += [len(kept)] if kept else []
            start += doc.num_tokens
        return rows, counts

    def document_offsets(self) -> list[int]:
        """Where each document starts in the row, then the row's length: ``S + 1`` positions."""
        return [0, *itertools.accumulate(doc.num_tokens for doc in self.documents)]

    def completion_values(self, values: Sequence[float]) -> list[tuple[float, ...]]:
        """``[L]`` values on the host at the label positions -> one tuple per document, a value per completion
        token (the inverse of how ``sampler_logprobs`` is laid out; 0 for tokens that are not trained on)."""
        out, start = [], 0
        for doc in self.documents:
            first = start + len(doc.prompt_ids) - 1  # the position that predicts the first completion token
            row = values[first : first + len(doc.completion_ids)]
            out.append(tuple(value if keep else 0.0 for value, keep in zip(row, doc.completion_mask)))
            start += doc.num_tokens
        return out

    def group_index(self, group_to_index: Mapping[Hashable, int]) -> torch.Tensor:
        """``[L]`` long: ``group_to_index[group_id]`` of each position's document.

        A document without a group id is looked up under ``None``; a missing key raises ``KeyError``.
        """
        groups = [group_to_index[doc.group_id] for doc in self.documents]
        per_document = torch.tensor(groups, dtype=torch.long)  # [D]
        return per_document[self.document_index]  # [L]


def _label_values(rollouts: Sequence[Rollout], values_of) -> torch.Tensor:
    """``[L]`` float32: ``values_of(doc)[i]`` at the position that predicts completion token i when it is
    trained on, else 0 (the layout of ``labels``)."""
    out: list[float] = []
    for doc in rollouts:
        out += [0.0] * (len(doc.prompt_ids) - 1)  # prompt positions before the last predict prompt tokens
        out += [value if keep else 0.0 for value, keep in zip(values_of(doc), doc.completion_mask)]
        out.append(0.0)  # the document's last token predicts nothing inside the document
    return torch.tensor(out, dtype=torch.float32)


def _optional_label_values(rollouts: Sequence[Rollout], field: str) -> torch.Tensor | None:
    if any(getattr(doc, field) is None for doc in rollouts):
        return None
    return _label_values(rollouts, lambda doc: getattr(doc, field))


def make_micro_batch(rollouts: Sequence[Rollout]) -> MicroBatch:
    """Concatenate ``rollouts`` (each with advantages set) into one ``MicroBatch``."""
    if not rollouts:
        raise ValueError("a micro-batch needs at least one document")
    input_ids: list[int] = []
    position_ids: list[int] = []
    labels: list[int] = []
    document_index: list[int] = []
    for d, doc in enumerate(rollouts):
        if doc.advantages is None:
            raise ValueError(f"{doc.source}: rollout has no advantages; apply an advantage estimator first")
        input_ids += doc.prompt_ids + doc.completion_ids
        position_ids += range(doc.num_tokens)
        document_index += [d] * doc.num_tokens
        # Prompt positions before the last predict prompt tokens: no label.
        labels += [IGNORE_INDEX] * (len(doc.prompt_ids) - 1)
        # From the last prompt token on, position i predicts completion token i + 1.
        labels += [token if keep else IGNORE_INDEX for token, keep in zip(doc.completion_ids, doc.completion_mask)]
        # The document's last token predicts nothing inside the document.
        labels.append(IGNORE_INDEX)
    labels_tensor = torch.tensor(labels, dtype=torch.long)  # [L]
    return MicroBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        position_ids=torch.tensor(position_ids, dtype=torch.long),
        labels=labels_tensor,
        sampler_logprobs=_label_values(rollouts, lambda doc: doc.old_logprobs),
        advantages=_label_values(rollouts, lambda doc: doc.advantages),
        mask=(labels_tensor >= 0).to(torch.float32),
        document_index=torch.tensor(document_index, dtype=torch.long),
        documents=list(rollouts),
        reference_logprobs=_optional_label_values(rollouts, "ref_logprobs"),
        proximal_logprobs=_optional_label_values(rollouts, "proximal_logprobs"),
    )


class DocumentQueue(Protocol):
    """Documents in training order, one at a time: a `DocumentStream`, or a stream reader (`rlcli.stream`)."""

    def next_document(self, first: bool) -> Rollout | None:
        """The next document, or None when there is none (now); ``first``: it starts a micro-batch."""

    def give_back(self, documents: Sequence[Rollout]) -> None:
        """Put ``documents`` back at the front, in order: they are served next."""


def fill_micro_batch(queue: DocumentQueue, max_tokens: int) -> MicroBatch | None:
    """The packing rule: the next whole documents of ``queue``, in order, while they fit in ``max_tokens``
    tokens; the first one that does not fit is given back and starts the next micro-batch.

    None when the queue has no document; a `DataError` when its next document alone is longer than
    ``max_tokens`` (a document is never split).
    """
    taken: list[Rollout] = []
    used = 0
    while (doc := queue.next_document(first=not taken)) is not None:
        if used + doc.num_tokens > max_tokens:
            queue.give_back([doc])
            if not taken:
                raise DataError(f"{doc.source}: document has {doc.num_tokens} tokens, "
                                f"more than max_tokens={max_tokens}")
            break
        taken.append(doc)
        used += doc.num_tokens
    return make_micro_batch(taken) if taken else None
