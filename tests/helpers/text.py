"""A small corpus and a BPE tokenizer trained on it with the ``tokenizers`` library (nothing downloaded)."""

from __future__ import annotations

from pathlib import Path

EOS = "<|endoftext|>"


def write_corpus(folder: Path, files: int = 2, lines: int = 120) -> list[Path]:
    """``files`` text files of ``lines`` short, varied sentences each; returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    animals = ["cat", "dog", "bird", "fox", "owl", "bee"]
    verbs = ["sat on", "ran past", "looked at", "jumped over"]
    paths = []
    for f in range(files):
        rows = [f"the {animals[(i + f) % 6]} {verbs[i % 4]} the mat number {i} in file {f}.\n" for i in range(lines)]
        path = folder / f"part{f}.txt"
        path.write_text("".join(rows), encoding="utf-8")
        paths.append(path)
    return paths


def train_tokenizer(corpus: list[Path], out: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE ``tokenizer.json`` with an end-of-text token, trained on ``corpus``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(p) for p in corpus], trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return out
