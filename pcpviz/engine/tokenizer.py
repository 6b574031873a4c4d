"""Byte-level tokenizer of the shipped tiny model.

Token ids ``0..255`` are the raw bytes ``0x00..0xFF`` (id == byte value), followed by a few
special tokens (``<bos>`` = 256, ``<eos>`` = 257, ``<pad>`` = 258, then reserved ids up to
``VOCAB_SIZE - 1``). There are no merges, so any UTF-8 (indeed any byte string) round-trips.

Two equivalent implementations are provided:

* :func:`encode` / :func:`decode` — pure Python, no dependencies (what the engine and the
  training script use);
* :func:`write_tokenizer_files` — writes ``tokenizer.json`` (Hugging Face ``tokenizers``
  format: ByteLevel pre-tokenizer + a merge-free BPE over the 256 byte symbols + ByteLevel
  decoder), ``tokenizer_config.json`` and ``special_tokens_map.json`` so that
  ``transformers.AutoTokenizer.from_pretrained(model_dir)`` (and therefore vLLM) produces the
  same ids. The JSON is written by hand here, so producing it needs neither ``tokenizers``
  nor ``transformers``.
"""

from __future__ import annotations

import json
import os
from typing import Iterable

BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
PAD_TOKEN = "<pad>"
NUM_BYTES = 256
BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
VOCAB_SIZE = 264  # 256 bytes + 3 specials + 5 reserved (a multiple of 8)
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN] + [
    f"<reserved_{i}>" for i in range(VOCAB_SIZE - NUM_BYTES - 3)
]
MODEL_MAX_LENGTH = 32768

__all__ = [
    "BOS_ID", "EOS_ID", "PAD_ID", "VOCAB_SIZE", "SPECIAL_TOKENS",
    "byte_to_unicode", "encode", "decode", "build_tokenizer_json", "write_tokenizer_files",
]


def byte_to_unicode() -> dict[int, str]:
    """The reversible byte -> printable character table used by byte-level BPE tokenizers.

    Printable Latin-1 bytes map to themselves; the remaining 68 bytes (controls, space,
    DEL, NBSP, soft hyphen, ...) map, in increasing byte order, to code points 256, 257, ...
    This is the table the ``tokenizers`` ByteLevel pre-tokenizer/decoder applies, so the
    vocabulary below must be spelled with it.
    """
    keep = set(range(ord("!"), ord("~") + 1))
    keep |= set(range(0xA1, 0xAC + 1))
    keep |= set(range(0xAE, 0xFF + 1))
    table: dict[int, str] = {}
    extra = 0
    for b in range(NUM_BYTES):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(NUM_BYTES + extra)
            extra += 1
    return table


def encode(text: str | bytes, add_bos: bool = True, add_eos: bool = False) -> list[int]:
    """Text (UTF-8) or raw bytes -> token ids (same ids as the HF tokenizer with special tokens)."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    ids = list(data)
    if add_bos:
        ids.insert(0, BOS_ID)
    if add_eos:
        ids.append(EOS_ID)
    return ids


def decode_bytes(ids: Iterable[int], skip_special_tokens: bool = True) -> bytes:
    out = bytearray()
    for i in ids:
        i = int(i)
        if i < NUM_BYTES:
            out.append(i)
        elif not skip_special_tokens:
            out += SPECIAL_TOKENS[i - NUM_BYTES].encode("utf-8")
    return bytes(out)


def decode(ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    """Token ids -> text (invalid UTF-8 is replaced with U+FFFD, like the HF decoder)."""
    return decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")


def build_tokenizer_json() -> dict:
    """The ``tokenizer.json`` document (Hugging Face ``tokenizers`` serialization format)."""
    table = byte_to_unicode()
    vocab = {table[b]: b for b in range(NUM_BYTES)}
    added = []
    for k, tok in enumerate(SPECIAL_TOKENS):
        idx = NUM_BYTES + k
        vocab[tok] = idx
        added.append({
            "id": idx, "content": tok, "single_word": False, "lstrip": False,
            "rstrip": False, "normalized": False, "special": True,
        })
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
            "use_regex": True,
        },
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": BOS_TOKEN, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"SpecialToken": {"id": BOS_TOKEN, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": BOS_TOKEN, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {BOS_TOKEN: {"id": BOS_TOKEN, "ids": [BOS_ID], "tokens": [BOS_TOKEN]}},
        },
        "decoder": {
            "type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
            "use_regex": True,
        },
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None,
            "continuing_subword_prefix": None, "end_of_word_suffix": None,
            "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": vocab, "merges": [],
        },
    }


def write_tokenizer_files(out_dir: str) -> list[str]:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    docs = {
        "tokenizer.json": build_tokenizer_json(),
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "add_bos_token": True,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": MODEL_MAX_LENGTH,
            "padding_side": "left",
            "model_input_names": ["input_ids", "attention_mask"],
        },
        "special_tokens_map.json": {
            "bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN,
        },
    }
    written = []
    for name, doc in docs.items():
        path = os.path.join(out_dir, name)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, ensure_ascii=False)
            f.write("\n")
        written.append(path)
    return written
