"""`VLLMSampler`: the `rlcli.rollout.sampler.Sampler` protocol on a `rlcli.rollout.vllm_engine.VLLMEngine`.

Each completion is one vLLM request with its own seed, drawn from the caller's generator, so a
seeded generator and the same weights give the same completions again. Stop ids (eos is one of them,
the model's own eos is ignored) end a request in vLLM, the token kept; stop strings are found afterwards in the text the
task's ``decode`` gives, and the completion is cut after the token that completes one: the tokens
kept are drawn exactly as if the request had stopped there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlcli.model.lora import served_weights
from rlcli.rollout.sampler import Completion, SamplingOptions, StopStrings, check_request
from rlcli.rollout.vllm_engine import Adapter, VLLMEngine

__all__ = ["VLLMSampler"]

SEED_BOUND = 1 << 62  # per-request seeds are drawn below this


class VLLMSampler(SamplingOptions):
    """Samples with ``engine``. With ``policy`` (the colocated trainer's bare module) every `sample`
    first loads the policy's current parameters into the engine, so it never samples stale weights;
    without, the caller loads each new version (`VLLMEngine.load_weights`), or names a published LoRA
    ``adapter`` that the engine applies to its base model. Log-probs are vLLM's
    processed ones: at ``temperature``, over the distribution after ``top_p``/``top_k`` truncation
    (the `rlcli.rollout.sampler.Sampler` contract). ``options`` are `SamplingOptions`'."""

    def __init__(self, engine: VLLMEngine, *, policy: torch.nn.Module | None = None, adapter: Adapter | None = None,
                 **options: Any) -> None:
        super().__init__(**options)
        self.engine = engine
        self.policy = policy
        self.adapter = adapter
        self.sync_seconds: float | None = None  # of the last sample's load of the policy's weights

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def sample(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        stop_ids: Sequence[int],
        pad_id: int,
        generator: torch.Generator,
    ) -> list[Completion]:
        from vllm import SamplingParams

        check_request(prompts, max_new_tokens)
        if self.policy is not None:
            self.sync_seconds = self.engine.load_weights(served_weights(self.policy))
        stops = sorted({*stop_ids, *self.stop_ids})
        seeds = torch.randint(0, SEED_BOUND, (len(prompts),), generator=generator).tolist()
        params = [
            SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=seed,
                           max_tokens=max_new_tokens, logprobs=0, ignore_eos=True, stop_token_ids=stops,
                           detokenize=False)
            for seed in seeds
        ]
        completions = []
        for output in self.engine.generate(prompts, params, self.adapter):
            drawn = output.outputs[0]
            ids = list(drawn.token_ids)
            logprobs = [position[token].logprob for position, token in zip(drawn.logprobs, ids)]
            completion = Completion(ids=ids, logprobs=logprobs, stopped=bool(ids) and ids[-1] in stops)
            completions.append(self._cut_at_stop_string(completion))
        return completions

    def _cut_at_stop_string(self, completion: Completion) -> Completion:
        if not self.stop_strings:
            return completion
        finder = StopStrings(self.stop_strings, self.decode, batch=1)
        for length, token in enumerate(completion.ids, 1):
            if finder.ended([token], [True]):
                return Completion(completion.ids[:length], completion.logprobs[:length], stopped=True)
        return completion
