"""Train a Qwen2-style byte-level BPE tokenizer offline, for the embedded default model.

The output folder is a real HF tokenizer folder (tokenizer.json + tokenizer_config.json) that both
`pocketjax.tokenizer.Tokenizer.from_folder` and transformers' `AutoTokenizer.from_pretrained` load as-is,
so the embedded model is tested against the same reference code as real Qwen checkpoints.
"""
from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from ..serve.tokenizer import Tokenizer

# Qwen2's pre-tokenizer regex (tokenizer.json of every Qwen2/2.5/3 checkpoint): digits split one by one,
# letters grouped with at most one leading non-letter, newlines kept apart from other whitespace.
QWEN2_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# ChatML as Qwen2.5 writes it, minus the tools branch and the default system prompt (a tiny embedded model
# gains nothing from spending tokens on "You are Qwen...").
CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)


def build_backend() -> BackendTokenizer:
    """An untrained tokenizer with Qwen2's normalizer, pre-tokenizer, post-processor and decoder."""
    backend = BackendTokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                                   fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    backend.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return backend


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: str | os.PathLike,
                    *, model_max_length: int = 32768) -> Tokenizer:
    """Train byte-level BPE on `texts`, write an HF Qwen2 tokenizer folder to `out_dir`, and load it back.

    `vocab_size` counts the special tokens, which come last (as in Qwen: merges first, then added tokens), so
    every id is below `vocab_size`. A corpus too small to learn that many merges yields a smaller vocabulary.
    Deterministic: the same texts in the same order give a byte-identical tokenizer.json.
    """
    if vocab_size <= 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed the 256 byte tokens plus {len(SPECIAL_TOKENS)} specials")
    backend = build_backend()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        show_progress=False,
        # All 256 byte symbols up front: no input can ever be unencodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        continuing_subword_prefix="",  # "" rather than null, as in Qwen's tokenizer.json
        end_of_word_suffix="",
    )
    backend.train_from_iterator(texts, trainer=trainer)
    backend.add_special_tokens([_added_token(t) for t in SPECIAL_TOKENS])

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    backend.save(str(out / "tokenizer.json"))
    config = tokenizer_config(backend, model_max_length=model_max_length)
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                 encoding="utf-8")
    return Tokenizer.from_folder(out)


def tokenizer_config(backend: BackendTokenizer, *, model_max_length: int = 32768) -> dict:
    """tokenizer_config.json as transformers writes it for a Qwen2 checkpoint."""
    added = {
        str(backend.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                      "single_word": False, "special": True}
        for t in SPECIAL_TOKENS
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": PAD_TOKEN,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _added_token(content: str) -> AddedToken:
    return AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)


def stdlib_files() -> list[Path]:
    """The standard library's .py files, sorted, without test packages and site-packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
    return sorted(p for p in root.rglob("*.py")
                  if not skip.intersection(p.relative_to(root).parts[:-1]) and p.is_file())


def stdlib_corpus() -> list[str]:
    """The text of every stdlib .py file (see `stdlib_files`): offline training text that every machine has."""
    texts = []
    for path in stdlib_files():
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue  # a handful of legacy-encoded files; skipping keeps the corpus valid UTF-8
    return texts


def split_holdout(texts: Sequence[str], every: int = 20) -> tuple[list[str], list[str]]:
    """(train, held_out): every `every`-th document is held out; deterministic and independent of hashing."""
    if every < 2:
        raise ValueError("every must be >= 2")
    train = [t for i, t in enumerate(texts) if i % every != every - 1]
    held = [t for i, t in enumerate(texts) if i % every == every - 1]
    return train, held
