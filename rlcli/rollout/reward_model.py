"""The ``model`` reward: a Hugging Face sequence-classification model (a reward model) scores each prompt +
completion, a batch at a time, in the training process (``task.rewards=[{name: model, path: DIR}]``).

- Input: the prompt's text as the task wrote it (with the policy's chat template, when it has one), the
  completion's text (cut at eos, special tokens left out), then ``suffix``, tokenized by the reward
  model's tokenizer as it tokenizes any text (its special tokens added; a BOS that the prompt's text already
  starts with is not doubled); of a longer sequence, the last ``max_length`` tokens are kept.
- Forward: ``batch_size`` sequences at a time, longest first, padded on the right with the model's pad id
  (from its config, else its tokenizer's), with an attention mask, in eval mode under
  ``torch.inference_mode``, in ``dtype`` on ``device``.
- Value: the logit of ``label`` that the model's own head gives the sequence (a decoder's reads the last
  token that is not the pad token, an encoder's such as BERT's the first), as a float.

The model is loaded once, when the task is built; every problem with the directory or an option is then
a `UserError` naming ``task.rewards[i].<option>``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rlcli.model.policy import DTYPES
from rlcli.rollout.prompts import TOKENIZER_FILES
from rlcli.rollout.rewards import _BadOption, _require


def default_device() -> torch.device:
    """The trainer's device: ``cuda:LOCAL_RANK`` (0 without it) when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _device(name: Any) -> torch.device:
    if name is None:
        return default_device()
    try:
        return torch.device(name)
    except (RuntimeError, TypeError) as err:
        raise _BadOption("device", f"not a torch device: {err}") from None


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class RewardModel:
    """A reward model as a batched reward function: ``model(completions, prompt=[...]) -> list[float]``."""

    def __init__(self, path: Any, *, batch_size: Any, max_length: Any, dtype: Any, device: Any, label: Any,
                 suffix: Any, trust_remote_code: Any) -> None:
        _require(_positive(batch_size), "batch_size", f"must be an integer >= 1, got {batch_size!r}")
        _require(max_length is None or _positive(max_length), "max_length",
                 f"must be an integer >= 1 or null, got {max_length!r}")
        _require(dtype is None or dtype in DTYPES, "dtype",
                 f"must be one of {', '.join(DTYPES)} or null, got {dtype!r}")
        _require(isinstance(suffix, str), "suffix", f"must be text, got {suffix!r}")
        _require(isinstance(trust_remote_code, bool), "trust_remote_code",
                 f"must be true or false, got {trust_remote_code!r}")
        self.device = _device(device)
        self.dtype = DTYPES[dtype] if dtype else (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.batch_size, self.suffix = batch_size, suffix
        self.model, self.tokenizer = _load(path, self.dtype, self.device, trust_remote_code)
        self.label = _label(label, self.model.config.num_labels)
        self.max_length = max_length or getattr(self.model.config, "max_position_embeddings", None)
        self.pad_id = self._pad_id()

    def _pad_id(self) -> int:
        """The pad id the model's head skips; one from the tokenizer is given to the model's config."""
        config = self.model.config.get_text_config()
        if config.pad_token_id is None:
            config.pad_token_id = self.tokenizer.pad_token_id
        _require(config.pad_token_id is not None or self.batch_size == 1, "path",
                 "the model has no pad token (neither its config's pad_token_id nor its tokenizer's pad token), "
                 "so it scores one sequence at a time: set batch_size: 1")
        return config.pad_token_id if config.pad_token_id is not None else 0  # batch_size 1 pads nothing

    def token_ids(self, prompts: Sequence[str], completions: Sequence[str]) -> list[list[int]]:
        """The model's input ids of each prompt + completion (see the module's docstring)."""
        texts = [p + c + self.suffix for p, c in zip(prompts, completions)]
        encoded = self.tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]
        bos = self.tokenizer.bos_token_id
        encoded = [ids[1:] if bos is not None and ids[:2] == [bos, bos] else ids for ids in encoded]
        return [ids[-self.max_length:] if self.max_length else ids for ids in encoded]

    def __call__(self, completions: Sequence[str], *, prompt: Sequence[str], **_: Any) -> list[float]:
        sequences = self.token_ids(prompt, completions)
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))  # similar lengths share a batch
        values = [0.0] * len(sequences)
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                rows = order[start:start + self.batch_size]
                scores = self._forward([sequences[i] for i in rows])
                for i, value in zip(rows, scores):
                    values[i] = value
        return values

    def _forward(self, sequences: list[list[int]]) -> list[float]:
        width = max(len(ids) for ids in sequences)
        input_ids = torch.full((len(sequences), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, ids in enumerate(sequences):
            input_ids[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[row, :len(ids)] = 1
        logits = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device)).logits
        return logits[:, self.label].float().tolist()


def _load(path: Any, dtype: torch.dtype, device: torch.device, trust_remote_code: bool) -> tuple[Any, Any]:
    """The sequence-classification model of ``path`` (every weight from the checkpoint, none drawn at random)
    in eval mode on ``device``, and its tokenizer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    _require(isinstance(path, str | os.PathLike) and str(path) != "", "path",
             f"must be a directory of a Hugging Face model, got {path!r}")
    directory = Path(path).expanduser()
    _require((directory / "config.json").is_file(), "path",
             f"{directory} is not a Hugging Face model directory (no config.json)")
    _require(any((directory / name).is_file() for name in TOKENIZER_FILES), "path",
             f"{directory} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save the reward model's "
             "tokenizer with it")
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            directory, dtype=dtype, trust_remote_code=trust_remote_code, output_loading_info=True)
        tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code)
    except Exception as err:  # a broken file of the user's directory: config, weights (SafetensorError), tokenizer
        raise _BadOption("path", f"cannot load a sequence-classification model and its tokenizer from "
                                 f"{directory}: {type(err).__name__}: {err}") from None
    missing = info["missing_keys"]
    _require(not missing, "path", f"{directory} lacks the weights {', '.join(sorted(missing)[:3])}: not a "
                                  "sequence-classification checkpoint (its head would be drawn at random)")
    try:
        model.to(device)
    except (RuntimeError, AssertionError) as err:
        raise _BadOption("device", f"cannot put the model on {device}: {err}") from None
    model.eval().requires_grad_(False)
    model.config.use_cache = False  # one forward per batch: no key/value cache to keep
    return model, tokenizer


def _label(label: Any, num_labels: int) -> int:
    """The index of the logit that is the value: ``label``, needed when the model has several."""
    if label is None:
        _require(num_labels == 1, "label", f"the model has {num_labels} labels: choose the logit that is the "
                                           f"reward with label: 0..{num_labels - 1}")
        return 0
    _require(isinstance(label, int) and not isinstance(label, bool) and 0 <= label < num_labels, "label",
             f"must be an integer in 0..{num_labels - 1} (the model's labels), got {label!r}")
    return label
