"""A tiny mlx-lm model directory built from a seed: a word-level tokenizer and a
randomly initialised llama. The demo and the tests train it on the CPU in seconds;
`mlx_lm.load`, `mlx_lm.generate` and `mlx_lm.fuse` read it like any other model."""

import json
from pathlib import Path

import mlx.core as mx

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>"]

# Roles become single special tokens so prompt and response split cleanly.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] + ' <|end|> ' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
)

TINY_CONFIG = dict(
    model_type="llama",
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)


def _write_tokenizer(path, words):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Punctuation splits from words too: TRL tokenises `prompt + response` as one
    # string, and "?" + "red ." must still read as the words "?", "red", ".".
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.add_special_tokens(SPECIAL_TOKENS)
    # Plain-text encodes start with BOS, as most real tokenizers do.
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    config = dict(
        tokenizer_class="PreTrainedTokenizerFast",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=TINY_CONFIG["max_position_embeddings"],
    )
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return len(vocab)


def build_tiny_model(path, words, seed=0, **overrides):
    """Writes config.json, model.safetensors, tokenizer.json and
    tokenizer_config.json under `path` and returns it as a Path.

    `words` is the vocabulary after the special tokens (whitespace-separated
    words of the data); `overrides` change fields of TINY_CONFIG. The same
    arguments always give the same files.
    """
    from mlx_lm.models import llama
    from mlx_lm.utils import save_config, save_model

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    unknown = set(overrides) - set(TINY_CONFIG)
    if unknown:
        raise ValueError(f"overrides: unknown config keys {sorted(unknown)}; expected some of {sorted(TINY_CONFIG)}")
    vocab_size = _write_tokenizer(path, words)
    config = dict(TINY_CONFIG, vocab_size=vocab_size, bos_token_id=1, eos_token_id=2, **overrides)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    save_model(path, model)
    save_config(config, path / "config.json")
    return path

