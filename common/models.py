"""Models and tokenizers: any Hugging Face causal LM by name or local path, or the built-in tiny one.

``TINY_MODEL`` selects an offline default for machines with no weights and no network: a small
random-init Qwen2-style config and a character-level tokenizer built in code (with a ChatML chat
template), so every test and the default job run anywhere. Weights are seeded, so every process that
builds the tiny model with the same seed gets the same weights.
"""

from __future__ import annotations

import string
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # transformers is imported where a model or tokenizer is built: seconds a process
    from transformers import PreTrainedModel, PreTrainedTokenizerBase  # that only reads configs does not pay

TINY_MODEL = "tiny-random"
PAD, EOS, IM_START, IM_END, UNK = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|unk|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The built-in tiny config scaled to about 113M parameters (``tiny_overrides`` of a policy/generation
# config): the model of the GPU benchmarks, random init with the character vocabulary.
MODEL_113M = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    max_position_embeddings=4096,
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_tiny_tokenizer() -> PreTrainedTokenizerBase:
    """A character-level tokenizer over printable ASCII plus ChatML special tokens, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, EOS, IM_START, IM_END, UNK]
    chars = sorted(set(string.printable) - set("\r\x0b\x0c\t"))
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=None,
        unk_token=UNK,
        additional_special_tokens=[IM_START, IM_END],
    )
    fast.chat_template = CHATML_TEMPLATE
    fast.padding_side = "right"
    return fast


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of ``name_or_path`` (Hub name or local dir), or the built-in one for TINY_MODEL.

    A tokenizer without a pad token gets its EOS token as pad; one without a chat template gets ChatML.
    """
    if name_or_path == TINY_MODEL:
        return build_tiny_tokenizer()
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(
            f"cannot load tokenizer {name_or_path!r}: not a local directory with tokenizer files and not "
            f"reachable on the Hugging Face Hub ({exc.__class__.__name__}); use '{TINY_MODEL}' offline"
        ) from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if not getattr(tok, "chat_template", None):
        tok.chat_template = CHATML_TEMPLATE
    return tok


def tiny_config(vocab_size: int, **overrides: Any) -> Any:
    """The built-in tiny decoder config (about 0.1M parameters at the default sizes)."""
    from transformers import Qwen2Config

    kw = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    kw.update(overrides)
    return Qwen2Config(**kw)


def load_model(
    name_or_path: str,
    *,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    seed: int = 0,
    tokenizer: PreTrainedTokenizerBase | None = None,
    tiny_overrides: dict[str, Any] | None = None,
) -> PreTrainedModel:
    """A causal LM from ``name_or_path``, or the seeded random-init tiny model for TINY_MODEL."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if name_or_path == TINY_MODEL:
        tok = tokenizer or build_tiny_tokenizer()
        cfg = tiny_config(len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **(tiny_overrides or {}))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            # float32 init, then cast: an init in bf16 draws other values, so a bf16 generator would not
            # start on a float32 policy's weights (vLLM's first step had token_mult_prob_error 1.20).
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").to(DTYPES[dtype])
    else:
        try:
            AutoConfig.from_pretrained(name_or_path)
        except OSError as exc:
            raise FileNotFoundError(
                f"cannot load model {name_or_path!r}: not a local directory with a config.json and not "
                f"reachable on the Hugging Face Hub ({exc.__class__.__name__}); use '{TINY_MODEL}' offline"
            ) from None
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=DTYPES[dtype], attn_implementation="sdpa")
    return model.to(device)
