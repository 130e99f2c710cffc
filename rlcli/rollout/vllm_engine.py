"""vLLM as the sampling engine: one `vllm.LLM` per process, whose weights rlcli loads itself.

The engine is built from the policy's config alone (``load_format="dummy"``) and gets its weights
through `VLLMEngine.load_weights`: the colocated trainer hands it the policy's parameters before
every sampling (no files), a sampler process the safetensors of each published version. The engine
core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the weights are copied once,
within memory. Its log-probs are always vLLM's ``processed_logprobs``: those of the temperature-scaled
distribution a token was drawn from, the trainer's ``lp_t`` (math.md#log-probabilities) when nothing truncates it.
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlcli.errors import UserError
from rlcli.model.lora import served_weights

__all__ = ["CPU_HEAD_SIZES", "OPTION_DOCS", "OWNED_OPTIONS", "VLLMEngine", "checkpoint_weights"]

log = logging.getLogger("rlcli")

# the vllm.LLM arguments rlcli sets itself, and why
OWNED_OPTIONS = {
    "model": "the policy's own architecture",
    "tokenizer": "rlcli passes token ids; the task's tokenizer decodes",
    "skip_tokenizer_init": "rlcli passes token ids",
    "load_format": "rlcli loads the weights itself",
    "logprobs_mode": "always processed_logprobs, the log-probs at the sampling temperature",
    "enable_lora": "on for an engine that samples published adapters (publish.lora=adapter)",
    "max_lora_rank": "the published adapters' rank",
}
# the vllm.LLM arguments rlcli's config sets (rollout.vllm.*), each with its description
OPTION_DOCS = {
    "dtype": "the engine's weights and activations; by default the model's dtype",
    "enforce_eager": "no CUDA graphs or compilation: a start of seconds; set false on a GPU for speed",
    "gpu_memory_utilization": "GPU: the share of memory the engine takes (the trainer needs the rest)",
    "kv_cache_memory_bytes": "the KV cache's bytes; null: 1 GiB on CPU (vLLM's own default would take most of "
                             "the RAM), from gpu_memory_utilization on a GPU",
    "max_model_len": "the longest sequence the engine takes; null: the model's max_position_embeddings",
}
MAX_TEMPERATURE = 2.0  # vLLM refuses to sample at a higher temperature (SamplingParams)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # what vLLM's CPU attention takes
CPU_KV_CACHE_BYTES = 1 << 30  # rollout.vllm.kv_cache_memory_bytes=null on CPU (vLLM's own default is most of the RAM)
INSTALL_HINT = ("on a CPU machine `make setup-vllm` (or pip install 'rlcli[vllm]' next to the CPU torch); "
                "on a GPU machine pip install vllm")


def _import_vllm():
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: weights load in memory
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its start-up chatter; rlcli says what matters
    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"])  # also what it logs while importing
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")  # deprecations inside vLLM
    try:
        import vllm
    except ImportError as err:
        raise UserError(f"rollout.engine=vllm: vLLM cannot be imported ({err}); {INSTALL_HINT}") from None
    return vllm


def _check_head_size(config: Any) -> None:
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if not torch.cuda.is_available() and head not in CPU_HEAD_SIZES:
        raise UserError(
            f"model: attention heads of {head} dimensions; vLLM's CPU attention takes {list(CPU_HEAD_SIZES)} only "
            "(with model=tiny choose model.num_heads so that model.hidden_size / model.num_heads is one of them)"
        )


def checkpoint_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor in the ``*.safetensors`` files of a Hugging Face checkpoint."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path}")
    for file in files:
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter in peft's format (a published version, ``publish.lora=adapter``) that vLLM applies per
    request; ``number`` is its id in the engine, one per adapter."""

    path: str
    number: int


class VLLMEngine:
    """An in-process vLLM engine with ``config``'s architecture (a transformers ``PretrainedConfig``
    naming its ``architectures``) and random weights until `load_weights`. ``options`` are keyword
    arguments of ``vllm.LLM`` (``rollout.vllm``), none of `OWNED_OPTIONS`."""

    def __init__(self, config: Any, options: Mapping[str, Any]) -> None:
        vllm = _import_vllm()
        _check_head_size(config)
        options = dict(options)
        if options.get("kv_cache_memory_bytes") is None and not torch.cuda.is_available():
            options["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        self.vocab_size = config.vocab_size
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="rlcli-vllm-") as folder:
            config.save_pretrained(folder)
            try:
                self.llm = vllm.LLM(model=folder, skip_tokenizer_init=True, load_format="dummy",
                                    logprobs_mode="processed_logprobs", **options)
            except TypeError as err:  # an unknown keyword in rollout.vllm
                raise UserError(f"rollout.vllm: {err}") from None
            except ValueError as err:  # vLLM's own checks of the model and the options
                raise UserError(f"rollout.engine=vllm: vLLM cannot build an engine for this model: {err}") from None
        log.info("vLLM engine ready in %.1f s", time.perf_counter() - started)

    @classmethod
    def for_policy(cls, policy: torch.nn.Module, options: Mapping[str, Any]) -> VLLMEngine:
        """An engine shaped like ``policy`` (a bare Hugging Face causal LM), holding its weights."""
        config = copy.deepcopy(policy.config)
        config.architectures = [type(policy).__name__]
        engine = cls(config, options)
        if engine.llm.model_config.using_transformers_backend():
            engine.close()  # its Transformers backend changes the model classes this process trains with
            raise UserError(f"rollout.engine=vllm: vLLM has no model of its own for {type(policy).__name__} and runs "
                            "it through its Transformers backend, which cannot share a process with the trainer; "
                            "sample in processes of their own (`rlcli loop rollout.engine=vllm`) or with "
                            "rollout.engine=hf")
        engine.load_weights(served_weights(policy))
        return engine

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Copy ``(name, tensor)`` pairs, named as in a Hugging Face checkpoint, into the engine; the seconds."""
        started = time.perf_counter()
        with torch.no_grad():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        return time.perf_counter() - started

    def close(self) -> None:
        """Free the engine and the process group vLLM set up in this process."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        del self.llm
        cleanup_dist_env_and_memory()

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[Any], adapter: Adapter | None = None
                 ) -> list[Any]:
        """vLLM's ``RequestOutput`` of each prompt (token ids) under its ``SamplingParams``, in order; with
        ``adapter``, by the base model with that LoRA adapter (an engine built with ``enable_lora``)."""
        from vllm.inputs import TokensPrompt

        limit = self.llm.model_config.max_model_len
        longest = max(map(len, prompts), default=0)
        if longest >= limit:  # vLLM would refuse the request with a traceback
            raise UserError(f"rollout.vllm.max_model_len: a prompt of {longest} tokens leaves no room for a completion "
                            f"in the engine's {limit} tokens (rollout.vllm.max_model_len, by default the model's "
                            "max_position_embeddings); raise it, or lower task.max_prompt_tokens")
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        lora = None
        if adapter is not None:
            from vllm.lora.request import LoRARequest

            lora = LoRARequest(adapter.path, adapter.number, adapter.path)
        return self.llm.generate(requests, list(params), use_tqdm=False, lora_request=lora)
