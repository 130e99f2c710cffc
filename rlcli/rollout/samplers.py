"""The one sampler factory: every command builds its `Sampler` here, by ``rollout.engine``.

``train`` (``data=generate``), ``eval.every`` and ``eval`` sample a live policy; a sampler process
(``rlcli sample``) samples the checkpoints the trainer publishes, one after another:

    sampler = build_sampler(policy, cfg.rollout, task.tokenizer)  # the policy's current weights, every call

    samplers = Samplers(cfg.rollout, task.tokenizer)
    sampler = samplers.of_checkpoint(path)  # each announced version
    samplers.close()

``rollout.engine`` names an entry of `ENGINES` (``hf``: rlcli's KV-cache sampler, ``vllm``: a vLLM
engine in this process). `Samplers` maps ``rollout.*`` to the options every sampler takes and checks
each sampler it builds against the task's vocabulary, whatever its engine.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from rlcli.errors import UserError
from rlcli.model.lora import published_adapter
from rlcli.modules.registry import Registry
from rlcli.rollout.sampler import HFSampler, Sampler
from rlcli.rollout.vllm_engine import Adapter, VLLMEngine, checkpoint_weights
from rlcli.rollout.vllm_sampler import VLLMSampler

__all__ = ["ENGINES", "SamplingEngine", "Samplers", "build_sampler", "sampling_options"]

log = logging.getLogger("rlcli")


class SamplingEngine(Protocol):
    """What one ``rollout.engine`` builds samplers with; ``options`` are `SamplingOptions`' keywords."""

    def of_policy(self, policy: torch.nn.Module, options: dict[str, Any]) -> Sampler:
        """A sampler of ``policy`` (a bare Hugging Face causal LM) that samples its current weights at every call."""

    def of_checkpoint(self, path: str | Path, options: dict[str, Any]) -> Sampler:
        """A sampler of the weights in the Hugging Face checkpoint directory ``path``."""

    def close(self) -> None:
        """Free what the engine holds."""


ENGINES: Registry[type[SamplingEngine]] = Registry("rollout.engine")  # each built with (rollout, trust_remote_code)


@ENGINES.register("hf")
class HFEngine:
    """rlcli's built-in `HFSampler`, in this process: the policy itself, or a float32 model per checkpoint."""

    def __init__(self, rollout: Any, trust_remote_code: bool) -> None:
        self.trust_remote_code = trust_remote_code

    def of_policy(self, policy: torch.nn.Module, options: dict[str, Any]) -> Sampler:
        return HFSampler(policy, **options)

    def of_checkpoint(self, path: str | Path, options: dict[str, Any]) -> Sampler:
        from transformers import AutoModelForCausalLM

        adapter = published_adapter(path)
        model = AutoModelForCausalLM.from_pretrained(path if adapter is None else adapter.base, dtype=torch.float32,
                                                     trust_remote_code=self.trust_remote_code)
        if adapter is not None:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, path).merge_and_unload()
        return HFSampler(model.eval(), **options)

    def close(self) -> None:
        pass


@ENGINES.register("vllm")
class VLLMEngines:
    """`VLLMSampler` on in-process vLLM engines with the ``rollout.vllm`` options.

    A policy's engine is built with its first sampler and serves every later sampler of that policy in
    this process (training's rollouts and ``eval.every`` share one: a second in-process engine would tear
    down the first one's process groups); each of its samplers loads the policy's weights before it
    samples. Checkpoints are loaded one after another into one engine of this object's, built with the
    first and freed by `close`; published adapters (``publish.lora=adapter``) are applied per request by
    that engine, built with LoRA for the base model they name, whose weights it loads once.
    """

    _of_policies: weakref.WeakKeyDictionary[torch.nn.Module, VLLMEngine] = weakref.WeakKeyDictionary()

    def __init__(self, rollout: Any, trust_remote_code: bool) -> None:
        self.options = rollout.vllm
        self.trust_remote_code = trust_remote_code
        self.engine: VLLMEngine | None = None  # the checkpoints'
        self.adapters = 0  # the published adapters loaded so far (each its own number in the engine)

    def of_policy(self, policy: torch.nn.Module, options: dict[str, Any]) -> Sampler:
        engine = self._of_policies.get(policy)
        if engine is None:
            engine = self._of_policies[policy] = VLLMEngine.for_policy(policy, self.options)
        return VLLMSampler(engine, policy=policy, **options)

    def of_checkpoint(self, path: str | Path, options: dict[str, Any]) -> Sampler:
        adapter = published_adapter(path)
        if self.engine is None:
            from transformers import AutoConfig

            source, lora = (path, {}) if adapter is None else (adapter.base, dict(
                enable_lora=True, max_lora_rank=lora_rank_bound(adapter.rank)))
            self.engine = VLLMEngine(AutoConfig.from_pretrained(source, trust_remote_code=self.trust_remote_code),
                                     {**self.options, **lora})
            if adapter is not None:
                self.engine.load_weights(checkpoint_weights(adapter.base))
        if adapter is not None:
            self.adapters += 1
            log.info("sampling with the LoRA adapter at %s on %s", path, adapter.base)
            return VLLMSampler(self.engine, adapter=Adapter(str(path), self.adapters), **options)
        seconds = self.engine.load_weights(checkpoint_weights(path))
        log.info("weights loaded into vLLM in %.2f s from %s", seconds, path)
        return VLLMSampler(self.engine, **options)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


def lora_rank_bound(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM takes (one of `vllm.config.lora.MaxLoRARanks`) that holds ``rank``."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    return min(bound for bound in get_args(MaxLoRARanks) if bound >= rank)


def sampling_options(rollout: Any, tokenizer: Any) -> dict[str, Any]:
    """The `SamplingOptions` keywords of ``rollout`` (``temperature``, ``top_p``, ``top_k``, ``stop``) for a
    task's ``tokenizer``: the strings of ``rollout.stop`` are searched in the text ``tokenizer.decode``
    gives; its ids and the tokenizer's own ``stop_ids`` (if it has any) end completions like eos."""
    strings = [s for s in rollout.stop if isinstance(s, str)]  # none empty (`rlcli.conf.rules.rollout_stop`)
    ids = [s for s in rollout.stop if not isinstance(s, str)]
    return {"temperature": rollout.temperature, "top_p": rollout.top_p, "top_k": rollout.top_k,
            "stop_strings": strings, "stop_ids": (*ids, *getattr(tokenizer, "stop_ids", ())),
            "decode": tokenizer.decode}


def _check_vocabulary(sampler: Sampler, tokenizer: Any, stop_ids: Sequence[int], model: str) -> None:
    """Raise a `UserError` unless ``model`` (what the message calls the sampled model) has an id for every
    token of the task's ``tokenizer`` and for each of ``stop_ids`` (``rollout.stop``'s and the tokenizer's)."""
    size = sampler.vocab_size
    if tokenizer.vocab_size > size:
        raise UserError(f"task: its tokenizer has {tokenizer.vocab_size} token ids, more than the {size} of {model}")
    outside = [i for i in stop_ids if not 0 <= i < size]
    if outside:
        raise UserError(f"rollout.stop: ids {outside} are outside the model's vocabulary (0..{size - 1})")


class Samplers:
    """The samplers of one process: ``rollout.engine``'s, with ``rollout``'s `sampling_options` for a task's
    ``tokenizer`` (its ``decode``, ``vocab_size`` and optional ``stop_ids``), each checked against its
    vocabulary. ``trust_remote_code`` applies to checkpoints."""

    def __init__(self, rollout: Any, tokenizer: Any, *, trust_remote_code: bool = False) -> None:
        self.tokenizer = tokenizer
        self.options = sampling_options(rollout, tokenizer)
        self.engine = ENGINES[rollout.engine](rollout, trust_remote_code)

    def of_policy(self, policy: torch.nn.Module) -> Sampler:
        """A sampler of ``policy`` (the bare module, not a DDP wrapper): every call samples its current weights."""
        sampler = self.engine.of_policy(policy, self.options)
        _check_vocabulary(sampler, self.tokenizer, self.options["stop_ids"], "the model")
        return sampler

    def of_checkpoint(self, path: str | Path) -> Sampler:
        """A sampler of the Hugging Face checkpoint directory ``path``."""
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # loading each published version is routine: no bars
        sampler = self.engine.of_checkpoint(path, self.options)
        _check_vocabulary(sampler, self.tokenizer, self.options["stop_ids"], f"the model at {path}")
        return sampler

    def close(self) -> None:
        self.engine.close()


def build_sampler(policy: torch.nn.Module, rollout: Any, tokenizer: Any) -> Sampler:
    """``rollout.engine``'s sampler of ``policy``'s current weights, with ``rollout``'s options for ``tokenizer``
    (`Samplers.of_policy`)."""
    return Samplers(rollout, tokenizer).of_policy(policy)
