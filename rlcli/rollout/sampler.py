"""Samplers: the `Sampler` protocol that rollouts and evaluations draw from, and `HFSampler`, batched
autoregressive sampling from a Hugging Face causal LM with a KV cache (``rollout.engine=hf``; every
command builds its sampler with `rlcli.rollout.samplers.build_sampler`).

`HFSampler` records the log-probability of a sampled token as the log-softmax of ``logits / temperature``
over the *full* vocabulary, also when ``top_k``/``top_p`` truncate the distribution the token is
drawn from. That is the ``lp_t`` the trainer recomputes (math.md#log-probabilities), so the importance ratio is 1
at the first update on fresh rollouts; truncation only changes which tokens get sampled.

Stop strings end a completion too: after each token, the text a task's ``decode`` gives for the
last few tokens of each completion is searched (see `StopStrings`). The token that completes a stop
string is kept, so the string stays in the completion, which is marked ``stopped``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rlcli.modules.bounds import TEMPERATURE, check_value

__all__ = [
    "Completion",
    "HFSampler",
    "Sampler",
    "SamplingOptions",
    "StopStrings",
    "check_request",
    "check_sampling_options",
    "sample_completions",
]


@dataclass
class Completion:
    """Sampled token ids (with the stop token if one was produced) and their log-probs."""

    ids: list[int]
    logprobs: list[float]
    stopped: bool


class Sampler(Protocol):
    """Draws completions from a policy: what rollouts (`rlcli.rollout.onpolicy.OnPolicyRollouts`) and
    evaluations (`rlcli.rollout.evaluate.evaluate`) call.

    Sampling options (temperature, truncation, stop strings and extra stop ids) are the sampler's
    own, set when it is built. ``sample`` returns one `Completion` per prompt, in order. A
    completion ends after its first token of ``stop_ids`` or of the sampler's own stop ids, or
    after the token that completes one of its stop strings (kept, ``stopped=True``), or at
    ``max_new_tokens`` (>= 1) tokens. Random draws come from ``generator`` only, so a seeded
    generator and the same weights give the same completions again.

    Its ``logprobs`` are each token's log-probability at ``temperature``. Without truncation
    (``top_p = 1``, ``top_k = 0``) every sampler gives the trainer's ``lp_t`` (math.md#log-probabilities). Under
    truncation they differ: `HFSampler` gives the full distribution's (still ``lp_t``),
    `rlcli.rollout.vllm_sampler.VLLMSampler` those of the truncated, renormalised distribution the
    token was drawn from (vLLM's processed log-probs), which the trainer uses only through the
    mismatch correction (the config refuses vLLM with truncation and without it).
    """

    @property
    def sync_seconds(self) -> float | None:
        """The seconds the last ``sample`` spent loading the policy's weights into the engine; None for a
        sampler that loads none (it samples the model in place, or weights loaded when it was built)."""

    @property
    def temperature(self) -> float:
        """The temperature the log-probs are taken at."""

    @property
    def vocab_size(self) -> int:
        """The number of token ids the policy has."""

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        stop_ids: Sequence[int],
        pad_id: int,
        generator: torch.Generator,
    ) -> list[Completion]: ...


def check_sampling_options(temperature: float, top_p: float, top_k: int) -> None:
    """Raise ``ValueError`` naming the first invalid sampling option."""
    check_value("temperature", temperature, TEMPERATURE)
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")


def check_request(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    """Raise ``ValueError`` unless there is at least one prompt, none empty, and ``max_new_tokens >= 1``."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("need at least one prompt, each with at least one token")


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device):
    """Prompts right-aligned in one batch: ``input_ids, attention_mask, position_ids``, each ``[B, P]``."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, P]
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, P]
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, P], 0 at the first real token
    return input_ids.to(device), attention_mask.to(device), position_ids.to(device)


def _truncate(log_p: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """``log_p [B, V]`` with tokens outside the top-k / nucleus set to ``-inf``."""
    if top_k > 0 and top_k < log_p.shape[-1]:
        kth = log_p.topk(top_k, dim=-1).values[:, -1:]  # [B, 1]
        log_p = log_p.masked_fill(log_p < kth, float("-inf"))
    if top_p < 1:
        sorted_lp, order = log_p.sort(dim=-1, descending=True)  # [B, V]
        mass = sorted_lp.exp().cumsum(-1)  # [B, V]
        mass_before = torch.cat([torch.zeros_like(mass[:, :1]), mass[:, :-1]], dim=-1)  # [B, V]
        drop_sorted = mass_before >= top_p  # [B, V]: the smallest prefix holding top_p
        drop_sorted[:, 0] = False  # also when top_p is below float32's smallest number
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # [B, V] back in vocabulary order
        log_p = log_p.masked_fill(drop, float("-inf"))
    return log_p


class StopStrings:
    """Finds the completions that have just produced a stop string, decoding only their last tokens.

    A stop string that ends in a completion's newest token lies within its last ``b`` tokens, ``b``
    the string's length in UTF-8 bytes (each of those tokens holds at least one of its bytes); one
    token more keeps a leading space that some decoders drop from the first token of a text.
    """

    def __init__(self, strings: Sequence[str], decode: Callable[[Sequence[int]], str], batch: int) -> None:
        if not strings or any(not isinstance(s, str) or not s for s in strings):
            raise ValueError(f"stop strings must be non-empty strings, got {list(strings)!r}")
        self.strings = tuple(strings)
        self.decode = decode
        self.window = max(len(s.encode()) for s in self.strings) + 1
        self.ids: list[list[int]] = [[] for _ in range(batch)]  # the tokens of each completion so far

    def ended(self, tokens: Sequence[int], active: Sequence[bool]) -> list[int]:
        """Append each active row's new token; the rows whose completion now holds a stop string."""
        rows = []
        for row, (token, on) in enumerate(zip(tokens, active)):
            if on:
                self.ids[row].append(token)
                tail = self.decode(self.ids[row][-self.window :])
                if any(s in tail for s in self.strings):
                    rows.append(row)
        return rows


def _eager(fn):
    """``fn`` run under torch.compile's ``force_eager`` stance (``model.compile`` is for training: generation's
    shapes would recompile). The stance is set at each call, not at import: torch._dynamo takes about a second
    to import, which every config check would pay."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with torch.compiler.set_stance("force_eager"):
            return fn(*args, **kwargs)

    return run


@torch.no_grad()
@_eager
def sample_completions(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_ids: Sequence[int],
    pad_id: int,
    generator: torch.Generator,
    stop_strings: Sequence[str] = (),
    decode: Callable[[Sequence[int]], str] | None = None,
) -> list[Completion]:
    """Sample one completion per prompt, all prompts in one left-padded batch with a KV cache.

    A sequence stops after producing a token of ``stop_ids``, after the token with which the text
    ``decode`` gives for it contains one of ``stop_strings``, or after ``max_new_tokens`` tokens; a
    finished sequence is fed ``pad_id`` with attention mask 0, which no other sequence sees.
    ``top_k = 0`` and ``top_p = 1`` switch truncation off. Random draws use ``generator`` only
    (on any device), so a seeded generator reproduces the samples. Logits are taken in float32.
    The model runs in eval mode and gets its previous mode back.
    """
    check_request(prompts, max_new_tokens)
    check_sampling_options(temperature, top_p, top_k)
    if stop_strings and decode is None:
        raise ValueError("stop_strings need a decode function")
    from transformers import DynamicCache

    strings = StopStrings(stop_strings, decode, len(prompts)) if stop_strings else None
    device = next(model.parameters()).device
    stop = torch.tensor(list(stop_ids), dtype=torch.long, device=device)  # [S]
    input_ids, attention_mask, position_ids = _left_pad(prompts, pad_id, device)
    cache = DynamicCache(config=model.config)
    batch = len(prompts)
    active = torch.ones(batch, dtype=torch.bool, device=device)  # [B]
    tokens, logprobs = [], []  # per step: [B] each
    string_ends: dict[int, int] = {}  # row -> length of a completion ended by a stop string

    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            out = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
            )
            log_p = torch.log_softmax(out.logits[:, -1].float() / temperature, dim=-1)  # [B, V]
            probs = _truncate(log_p, top_p, top_k).exp()  # [B, V]
            drawn = torch.multinomial(probs.to(generator.device), 1, generator=generator)  # [B, 1]
            token = drawn.to(device)[:, 0].masked_fill(~active, pad_id)  # [B]
            tokens.append(token)
            logprobs.append(log_p.gather(-1, token[:, None])[:, 0])  # [B]
            was_active = active
            active = active & ~torch.isin(token, stop)
            if strings is not None:
                ended = strings.ended(token.tolist(), active.tolist())
                if ended:
                    string_ends.update((row, len(tokens)) for row in ended)
                    active[torch.tensor(ended, device=device)] = False
            if not active.any():
                break
            input_ids = token[:, None]  # [B, 1]
            attention_mask = torch.cat([attention_mask, was_active[:, None].long()], dim=-1)  # [B, P + t]
            position_ids = position_ids[:, -1:] + 1  # [B, 1]
    finally:
        model.train(was_training)

    return _completions(torch.stack(tokens, 1), torch.stack(logprobs, 1), set(stop_ids), string_ends)


def _completions(
    tokens: torch.Tensor, logprobs: torch.Tensor, stop_ids: set[int], string_ends: dict[int, int]
) -> list[Completion]:
    """Cut ``tokens [B, N]`` / ``logprobs [B, N]`` after each row's first stop token, or at the
    length ``string_ends`` gives for a row ended by a stop string."""
    result = []
    for row, (row_ids, row_lp) in enumerate(zip(tokens.tolist(), logprobs.tolist())):
        ends = [i + 1 for i, token in enumerate(row_ids) if token in stop_ids]
        if row in string_ends:
            ends = [string_ends[row]]
        length = ends[0] if ends else len(row_ids)
        result.append(Completion(ids=row_ids[:length], logprobs=row_lp[:length], stopped=bool(ends)))
    return result


class SamplingOptions:
    """What a sampler takes besides its policy, checked: ``temperature``, ``top_p``/``top_k`` truncation,
    ``stop_ids`` that end completions besides those each call names, and ``stop_strings`` that end them
    too, found in the text ``decode`` gives (a task's ``tokenizer.decode``)."""

    def __init__(
        self,
        *,
        temperature: float,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_strings: Sequence[str] = (),
        stop_ids: Sequence[int] = (),
        decode: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        check_sampling_options(temperature, top_p, top_k)
        if stop_strings and decode is None:
            raise ValueError("stop_strings need a decode function")
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.stop_strings = tuple(stop_strings)
        self.stop_ids = tuple(stop_ids)
        self.decode = decode


class HFSampler(SamplingOptions):
    """A `Sampler` over a Hugging Face causal LM: `sample_completions` with these options.

    ``model`` is the bare module (not a DDP wrapper); every call samples with its current weights, in
    place (``sync_seconds`` is None). ``options`` are `SamplingOptions`'.
    """

    sync_seconds = None

    def __init__(self, model: torch.nn.Module, **options: Any) -> None:
        super().__init__(**options)
        self.model = model

    @property
    def vocab_size(self) -> int:
        """The rows of the model's output embedding."""
        return self.model.get_output_embeddings().weight.shape[0]

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        stop_ids: Sequence[int],
        pad_id: int,
        generator: torch.Generator,
    ) -> list[Completion]:
        return sample_completions(
            self.model,
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop_ids=(*stop_ids, *self.stop_ids),
            pad_id=pad_id,
            generator=generator,
            stop_strings=self.stop_strings,
            decode=self.decode,
        )
