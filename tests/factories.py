"""What the tests build, all locally and without downloads: tiny random-init policies, a byte-level BPE
tokenizer with a chat template, a tiny Hugging Face checkpoint, rollout records and the files that hold them."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

# Models


def tiny_policy(vocab_size: int, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                max_position_embeddings: int = 64, attn_implementation: str = "sdpa", dtype: str = "float32",
                seed: int = 0) -> torch.nn.Module:
    """A tiny Llama as ``model=tiny`` builds it (intermediate size twice the hidden size), its weights drawn
    right after ``torch.manual_seed(seed)``: the global RNG is left seeded, as a test that seeds first expects."""
    from rlcli.conf.schema import TinyModelConfig
    from rlcli.model.policy import build_policy

    cfg = TinyModelConfig(kind="tiny", vocab_size=vocab_size, hidden_size=hidden_size,
                          intermediate_size=2 * hidden_size, num_layers=num_layers, num_heads=num_heads, init_std=None,
                          max_position_embeddings=max_position_embeddings, dtype=dtype, gradient_checkpointing=False,
                          attn_implementation=attn_implementation, suggested_lr=1e-3, compile=False, lora=None)
    torch.manual_seed(seed)
    return build_policy(cfg)


def initial_policy(cfg, vocab_size: int = 64) -> torch.nn.Module:
    """The policy `rlcli train` starts from under the config ``cfg``: ``cfg.model`` built right after every RNG
    is seeded with ``cfg.seed``; a tiny model without a vocabulary size gets ``vocab_size`` (the data's: the
    task's with ``data=generate``, else 64)."""
    import lightning as L

    from rlcli.model.policy import build_policy

    L.seed_everything(cfg.seed, verbose=False)
    return build_policy(cfg.model, default_vocab_size=vocab_size)


EOS = "<|im_end|>"  # ends an assistant turn, as in Qwen2.5-Instruct
PAD = "<|endoftext|>"
SPECIAL_TOKENS = (PAD, "<|im_start|>", EOS)
CHAT_TEMPLATE = (  # ChatML
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus() -> list[str]:
    sums = [f"{a}+{b}={a + b}" for a in range(10) for b in range(10)]
    words = ["The answer is 7.", "Question: what is 3+4? Answer: 7", "\\boxed{12}", "system", "user",
             "assistant", "Add the numbers.", "<think> </think>", "<answer> </answer>", "\n"]
    return (sums + words) * 4


def make_tokenizer(directory: str | Path) -> Path:
    """Train a byte-level BPE (every byte is a token, so any text encodes) on a small corpus of sums
    and words, with eos ``<|im_end|>``, pad ``<|endoftext|>`` and a ChatML template; save it in
    ``directory`` with ``save_pretrained``. Returns the directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(_corpus(), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=PAD,
                                        chat_template=CHAT_TEMPLATE)
    directory = Path(directory)
    tokenizer.save_pretrained(directory)
    return directory


def make_tiny_qwen2(directory: str | Path, vocab_size: int | None = None, *, hidden_size: int = 64,
                    num_layers: int = 2, seed: int = 0) -> Path:
    """A tiny ``Qwen2ForCausalLM`` with random weights (seeded, the global RNG untouched), saved in
    ``directory`` with the tokenizer of `make_tokenizer`. ``vocab_size`` defaults to the multiple of
    16 next above the tokenizer's size: like Qwen's, the model has rows no token uses. 4 query heads
    share 2 key/value heads; ``hidden_size`` must be a multiple of 8 (an even head size for RoPE)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as transformers_logging

    if hidden_size % 8:
        raise ValueError(f"hidden_size must be a multiple of 8 (4 heads of an even size), got {hidden_size}")
    transformers_logging.disable_progress_bar()
    directory = make_tokenizer(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    vocab_size = vocab_size or (len(tokenizer) // 16 + 1) * 16
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} is less than the tokenizer's {len(tokenizer)} tokens")
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(directory)
    return directory


def make_tiny_reward_model(directory: str | Path, *, num_labels: int = 1, architecture: str = "qwen2",
                           hidden_size: int = 32, seed: int = 0) -> Path:
    """A tiny sequence-classification model with random weights (seeded, the global RNG untouched) and
    ``num_labels`` logits, saved in ``directory`` with the tokenizer of `make_tokenizer` (pad id set): a decoder
    (``qwen2``: its head reads the last token that is not pad) or an encoder (``bert``: its head reads the first
    token, which attends to every other, so padding without an attention mask would change its score)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertConfig, Qwen2Config

    directory = make_tokenizer(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    sizes = {"vocab_size": len(tokenizer), "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size,
             "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256,
             "num_labels": num_labels, "pad_token_id": tokenizer.pad_token_id}
    configs = {"qwen2": lambda: Qwen2Config(**sizes, num_key_value_heads=2), "bert": lambda: BertConfig(**sizes)}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        AutoModelForSequenceClassification.from_config(configs[architecture]()).save_pretrained(directory)
    return directory


def make_suffix_reward_model(directory: str | Path, endings: str, *, hidden_size: int = 16) -> Path:
    """A ``Qwen2ForSequenceClassification`` (the tokenizer of `make_tokenizer`) whose score is +1 for a text that
    ends with one of the characters ``endings`` and -1 for any other: no layers, so the head reads the RMS-normed
    embedding of the last token, which is +/- the ones vector by whether that token's text ends so; the head
    averages it (a weight of ``1 / hidden_size`` each)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    directory = make_tokenizer(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=0, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    model = Qwen2ForSequenceClassification(config)
    signs = [1.0 if tokenizer.decode([i]).endswith(tuple(endings)) else -1.0 for i in range(len(tokenizer))]
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.tensor(signs)[:, None].expand(-1, hidden_size))
        model.score.weight.fill_(1.0 / hidden_size)
    model.save_pretrained(directory)
    return directory


# Records and their files


def rollout_record(group: int = 0, prompt_len: int = 3, completion_len: int = 4, vocab: int = 64, *,
                   drop: tuple[str, ...] = (), **fields) -> dict:
    """A valid record with a per-group reward, deterministic in its arguments; ``fields`` replace or add
    fields, the fields named in ``drop`` are left out."""
    record = {
        "prompt_ids": [(group * 7 + i) % vocab for i in range(prompt_len)],
        "completion_ids": [(group * 5 + 3 * i + 1) % vocab for i in range(completion_len)],
        "old_logprobs": [-4.0 - 0.01 * i for i in range(completion_len)],
        "reward": float((group + completion_len) % 3),
        "group_id": group % 4,
        **fields,
    }
    return {k: v for k, v in record.items() if k not in drop}


def write_jsonl(path: Path, records) -> Path:
    """``records`` one per line: dicts as JSON, strings as they are (a broken line)."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def write_parquet(path: Path, records: list[dict], row_group_size: int | None = None) -> Path:
    """``records`` as rows; a field missing from a row is null there."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = list(dict.fromkeys(name for r in records for name in r))
    columns = {name: [r.get(name) for r in records] for name in names}
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def make_arithmetic_dataset(path: str | Path, n: int, seed: int, *, chat: bool = False) -> Path:
    """``n`` records ``{"prompt": "3+4=", "answer": "7"}`` with single-digit sums (``a + b <= 9``),
    the prompt as chat messages (one user message) if ``chat``; JSON Lines, or Parquet for a
    ``.parquet`` path. Returns the path."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        a = rng.randint(0, 9)
        b = rng.randint(0, 9 - a)
        text = f"{a}+{b}="
        records.append({"prompt": [{"role": "user", "content": text}] if chat else text, "answer": str(a + b)})
    path = Path(path)
    return write_parquet(path, records) if path.suffix == ".parquet" else write_jsonl(path, records)
