"""Build the tiny character-level tokenizer shipped in ``dsrl/assets/tiny_tokenizer``.

Run from anywhere (no network needed)::

    python dsrl/assets/build_tiny_tokenizer.py

The vocabulary is fixed and ordered, so rebuilding gives byte-identical token ids:

    0 <pad>   1 <s> (bos)   2 </s> (eos)   3 <unk>
    then space, newline, the digits 0-9, the letters a-z and the 32 ASCII punctuation characters.

Every character is one token (a WordLevel model over single characters); unknown characters
(upper case, non-ASCII) map to ``<unk>``. ``add_special_tokens=True`` prepends ``<s>``; the decoder
concatenates tokens, so ``decode(encode(s), skip_special_tokens=True) == s`` for any string made of
vocabulary characters. A minimal chat template (``<s>user: ...\\nassistant:``) is included so that
``dsrl.data.chat_template = true`` works with the tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import string

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
CHARACTERS = " \n" + string.digits + string.ascii_lowercase + string.punctuation
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_tokenizer")


def vocabulary() -> dict[str, int]:
    """Token -> id; special tokens first, then single characters in a fixed order."""
    tokens = list(SPECIAL_TOKENS) + list(CHARACTERS)
    assert len(set(tokens)) == len(tokens), "duplicate token in the tiny vocabulary"
    return {tok: i for i, tok in enumerate(tokens)}


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def build(out_dir: str = DEFAULT_OUT) -> str:
    """Write tokenizer.json / tokenizer_config.json / special_tokens_map.json into ``out_dir``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    pad, bos, eos, unk = SPECIAL_TOKENS
    vocab = vocabulary()
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    # One pre-token per character (newline included), so WordLevel sees single characters only.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab[bos])]
    )
    tok.add_special_tokens(list(SPECIAL_TOKENS))

    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    special = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk}
    # Written by hand (not save_pretrained) so the files load on transformers 4.x and 5.x alike.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "padding_side": "left",
        "truncation_side": "left",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), config)
    _write_json(os.path.join(out_dir, "special_tokens_map.json"), special)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="output directory")
    args = parser.parse_args()
    out = build(args.out)
    print(f"wrote {out} ({len(vocabulary())} tokens)")


if __name__ == "__main__":
    main()
