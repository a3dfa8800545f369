"""Data a researcher has on disk, made by the tests (no download): learnable sentences as
JSON lines, Parquet and a `datasets` dataset saved with `save_to_disk`, a WordPiece tokenizer
trained on them (a `tokenizers` JSON file, or a transformers tokenizer directory), and an image
folder with one directory per class."""

from __future__ import annotations

import json
import random
from pathlib import Path

SUBJECTS = ("the cat", "a dog", "my bird", "the fish", "our horse", "a mouse")
VERBS = ("sees", "likes", "chases", "finds", "hears", "wants")
OBJECTS = ("the ball", "a stick", "some food", "the sun", "a box", "the tree")
PLACES = ("at home", "in the park", "by the river", "on the hill", "under the bed")
SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def sentences(n: int, seed: int = 0) -> list[dict[str, object]]:
    """`n` records: `text` (a sentence), `label` (its subject's index: a 6-class task),
    `score` (a number the text determines), `summary` (its subject and verb, a seq2seq
    target)."""
    rng = random.Random(seed)
    out: list[dict[str, object]] = []
    for _ in range(n):
        s, v, o, p = (rng.randrange(len(x)) for x in (SUBJECTS, VERBS, OBJECTS, PLACES))
        text = f"{SUBJECTS[s]} {VERBS[v]} {OBJECTS[o]} {PLACES[p]} ."
        out.append({"text": text, "label": s, "score": float(v) / 5.0,
                    "summary": f"{SUBJECTS[s]} {VERBS[v]}"})
    return out


def write_jsonl(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet(path: Path, records: list[dict[str, object]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(records), str(path), row_group_size=64)
    return path


def save_dataset(path: Path, records: list[dict[str, object]]) -> Path:
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(str(path))
    return path


def train_tokenizer(records: list[dict[str, object]], path: Path, *, bert: bool = True) -> Path:
    """A WordPiece tokenizer over the records' words, saved as a tokenizers JSON file; with
    `bert`, its post-processor wraps each text as `[CLS] ... [SEP]`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=list(SPECIALS),
                                        show_progress=False)
    texts = [str(r["text"]) for r in records] + [str(r["summary"]) for r in records]
    tok.train_from_iterator(texts, trainer)
    if bert:
        cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    tok.save(str(path))
    return path


def transformers_tokenizer(tokenizer_json: Path, directory: Path) -> Path:
    """The same tokenizer as a transformers tokenizer directory (save_pretrained)."""
    from transformers import PreTrainedTokenizerFast

    t = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), pad_token="[PAD]",
                                unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                                mask_token="[MASK]", eos_token="[SEP]")
    t.save_pretrained(str(directory))
    return directory


def image_folder(root: Path, *, classes: int = 3, per_class: int = 12, size: int = 20,
                 seed: int = 0) -> Path:
    """PNG images, one directory per class: each class a colour and a stripe orientation,
    with noise, of varied sizes (the reader resizes and crops)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for k in range(classes):
        d = root / f"class_{k}"
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            h, w = size + int(rng.integers(0, 6)), size + int(rng.integers(0, 6))
            img = rng.integers(0, 60, size=(h, w, 3)).astype(np.int32)
            img[..., k % 3] += 150
            if k % 2:
                img[::4, :, :] += 40
            else:
                img[:, ::4, :] += 40
            Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(d / f"{i}.png")
    return root


TINY: dict[str, dict[str, object]] = {
    "bert": dict(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0),
    "llama": dict(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
    "t5": dict(vocab_size=200, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
               dropout_rate=0.0, decoder_start_token_id=0),
    "vit": dict(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
}
"""Tiny configs of the HF families the tests train (no dropout: exact comparisons)."""


def _toml(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return repr(v)


def hf_model_toml(architecture: str, family: str, **extra: object) -> str:
    """The `[model]` table of a job building `transformers.<architecture>` from a tiny config
    of `family` (`TINY`), plus `extra` config fields."""
    cfg = {"architecture": architecture, **TINY[family], **extra}
    lines = "\n".join(f"{k} = {_toml(v)}" for k, v in cfg.items())
    return f'[model]\nzoo = "hf"\n[model.config]\n{lines}\n'
