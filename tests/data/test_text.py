"""Real text: a BPE tokenizer.json through ``tokenizers``, corpus files streamed block by block, packed into
windows where every token is a label exactly once, a held-out split disjoint from training, and
training batches that are the same for the same index whatever was read before."""

from __future__ import annotations

import pytest
import torch

from mt_dualpipe.data.text import (
    ByteTokenizer,
    PackedText,
    corpus_files,
    load_tokenizer,
    pack,
    read_blocks,
    token_stream,
)
from tests.helpers.text import EOS, train_tokenizer, write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    files = write_corpus(root / "corpus", files=2, lines=120)
    tok = train_tokenizer(files, root / "tok" / "tokenizer.json")
    return root, files, tok


def test_tokenizer_json_loads_from_file_or_folder(corpus):
    _, _, tok_path = corpus
    for where in (tok_path, tok_path.parent):
        tok = load_tokenizer(where)
        assert tok.vocab_size == 300 and tok.name == str(tok_path)
        from tokenizers import Tokenizer

        ref = Tokenizer.from_file(str(tok_path))
        assert tok.eos_id == ref.token_to_id(EOS)
        text = "the owl sat on the mat number 7."
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False).ids
        assert len(tok.encode(text)) < len(text.encode())  # BPE merged something
    assert isinstance(load_tokenizer(None), ByteTokenizer)


def test_tokenizer_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no tokenizer at {tmp_path}: give a tokenizer.json file or a "
                                                "folder holding one"):
        load_tokenizer(tmp_path)
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=f"{bad} is not a tokenizer.json the tokenizers library can read"):
        load_tokenizer(bad)


def test_corpus_files_walks_folders_sorted_and_skips_hidden(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.txt").write_text("x")
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "h.txt").write_text("x")
    (tmp_path / ".dot.txt").write_text("x")
    extra = tmp_path / "b" / "2.txt"
    assert corpus_files(tmp_path) == [tmp_path / "a.txt", tmp_path / "b" / "2.txt"]
    assert corpus_files([str(extra), tmp_path / "b"]) == [extra, extra]
    with pytest.raises(FileNotFoundError, match="corpus path .*nope is neither a file nor a folder"):
        corpus_files(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="corpus folder .*empty holds no files"):
        corpus_files(tmp_path / "empty")


def test_files_are_read_in_bounded_blocks_of_whole_lines(corpus):
    _, files, _ = corpus
    text = files[0].read_text()
    blocks = list(read_blocks(files[0], block_chars=200))
    assert "".join(blocks) == text and len(blocks) > 10
    longest_line = max(len(line) for line in text.splitlines(keepends=True))
    assert all(b.endswith("\n") for b in blocks) and max(map(len, blocks)) < 200 + longest_line


def test_the_tokenizer_never_sees_more_than_a_block(corpus):
    """Streaming: with 200-character blocks the tokenizer is called on about 200 characters at a time."""
    _, files, tok_path = corpus
    tok = load_tokenizer(tok_path)
    seen = []

    class Spy:
        name, vocab_size, eos_id = tok.name, tok.vocab_size, tok.eos_id

        def encode(self, text):
            seen.append(len(text))
            return tok.encode(text)

    data = PackedText(files, 16, 4, tokenizer=Spy(), block_chars=200)
    data.train_batch(5)
    assert max(seen) < 300 and len(seen) > 20


def test_pack_makes_every_token_a_label_exactly_once():
    blocks = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10], [11]]
    windows = list(pack(blocks, 4))
    assert windows == [[1, 2, 3, 4], [4, 5, 6, 7], [7, 8, 9, 10]]
    labels = [t for w in windows for t in w[1:]]
    assert labels == list(range(2, 11))
    with pytest.raises(ValueError, match="a packed window needs at least 2 tokens"):
        list(pack(blocks, 1))


def test_files_are_separated_by_the_end_of_text_token(corpus):
    _, files, tok_path = corpus
    tok = load_tokenizer(tok_path)
    stream = [t for block in token_stream(tok, files) for t in block]
    assert stream.count(tok.eos_id) == 2
    first = [t for block in token_stream(tok, files[:1]) for t in block]
    assert stream[:len(first)] == first and first[-1] == tok.eos_id


def test_held_out_windows_never_appear_in_training_and_the_split_is_every_kth(corpus):
    _, files, tok_path = corpus
    tok = load_tokenizer(tok_path)
    all_windows = list(pack(token_stream(tok, files), 17))
    data = PackedText(files, 16, 4, tokenizer=tok, val_every=5, seed=3)
    assert data.num_val == len(all_windows) // 5 and data.num_train + data.num_val == len(all_windows)
    assert data.val == [w for i, w in enumerate(all_windows) if i % 5 == 4]
    epoch = data.num_train // 4
    train = {tuple(row) for i in range(epoch)
             for row in torch.cat([data.train_batch(i)[0], data.train_batch(i)[1][:, -1:]], 1).tolist()}
    assert len(train) == epoch * 4 and not train & {tuple(w) for w in data.val}
    assert train <= {tuple(w) for w in all_windows}


def test_train_batches_are_addressable_shifted_and_deterministic(corpus):
    _, files, tok_path = corpus
    tok = load_tokenizer(tok_path)
    data = PackedText(files, 16, 4, tokenizer=tok, seed=1, cache=4)
    x3, y3 = data.train_batch(3)
    assert x3.shape == y3.shape == (4, 16) and x3.dtype == torch.int64
    assert torch.equal(x3[:, 1:], y3[:, :-1])
    far = data.num_train  # past one epoch: a new epoch, reshuffled
    data.train_batch(far)
    again_x, again_y = data.train_batch(3)  # older than the 4-batch cache: the stream replays
    assert torch.equal(again_x, x3) and torch.equal(again_y, y3)
    fresh = PackedText(files, 16, 4, tokenizer=tok, seed=1)
    assert torch.equal(fresh.train_batch(3)[0], x3)
    other_seed = PackedText(files, 16, 4, tokenizer=tok, seed=2)
    assert not torch.equal(other_seed.train_batch(3)[0], x3)


def test_val_batches_cycle_the_held_out_windows(corpus):
    _, files, _ = corpus
    data = PackedText(files[:1], 32, 8, val_every=4, max_val=3)  # bytes: vocabulary 256
    assert len(data.val) == 3 and data.num_val > 3
    x, y = data.val_batch(0)
    assert x.shape == (8, 32)
    want = torch.tensor([data.val[k % 3] for k in range(8)])
    assert torch.equal(x, want[:, :-1]) and torch.equal(y, want[:, 1:])
    assert int(x.max()) < 256


def test_a_corpus_too_small_for_one_sequence_is_refused(tmp_path):
    (tmp_path / "tiny.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"gives no training sequence of 65 tokens with every 20th held out"):
        PackedText(tmp_path / "tiny.txt", 64, 2)
    with pytest.raises(ValueError, match="val_every must be >= 2"):
        PackedText(tmp_path / "tiny.txt", 1, 2, val_every=1)
