"""Fine-tuning data: (prompt, response) records into documents with the prompt masked, documents packed into
rows whose position ids restart at each document and whose labels never cross one, micro-batches by a token
budget with under 5 % padding on a skewed (log-normal) length sample, every token kept exactly once, and the
step's valid-target count that makes the loss a token mean over the step, pipelined or not."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from mt_dualpipe.data.batching import (
    assign_microbatches,
    microbatch,
    pack_documents,
    padding_fraction,
    token_budget_batches,
)
from mt_dualpipe.data.documents import IGNORE_INDEX, Document, encode_records, prompt_response
from mt_dualpipe.data.finetune import FinetuneData
from mt_dualpipe.data.text import ByteTokenizer, load_tokenizer
from tests.helpers.text import EOS, train_tokenizer, write_corpus

END = 255  # the end token of the byte-level documents below


def skewed(n: int = 600, seed: int = 0, median: float = 60.0, sigma: float = 1.0, cap: int = 512) -> list[Document]:
    """``n`` documents with log-normal lengths (median ``median``, at most ``cap``), a prompt of a third of each."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        length = min(cap, max(2, round(rng.lognormvariate(math.log(median), sigma))))
        ids = [rng.randrange(250) for _ in range(length - 1)] + [END]
        prompt = length // 3
        docs.append(Document(tuple(ids), (False,) * prompt + (True,) * (length - prompt)))
    return docs


# ----- records: the prompt masked, the response and the end token trained --------------------------
def test_a_record_becomes_prompt_response_end_with_the_prompt_masked(tmp_path):
    from tokenizers import Tokenizer

    path = train_tokenizer(write_corpus(tmp_path / "c", 1, 40), tmp_path / "tok.json")
    tok = load_tokenizer(path)
    prompt, response = "the cat sat on", " the mat number 7."
    doc = prompt_response(prompt, response, tok)
    p, r = tok.encode(prompt), tok.encode(response)
    assert tok.eos_id is not None and tok.eos_id == Tokenizer.from_file(str(path)).token_to_id(EOS)
    assert doc.ids == tuple(p + r + [tok.eos_id])  # each side encoded alone, joined as ids
    assert doc.targets == (False,) * len(p) + (True,) * (len(r) + 1)
    # -100 exactly where the next token is a prompt token, and at the end (no next token in the document)
    assert doc.labels() == [IGNORE_INDEX] * (len(p) - 1) + r + [tok.eos_id, IGNORE_INDEX]
    assert doc.labels().count(IGNORE_INDEX) == len(p) and doc.num_targets == len(r) + 1


def test_records_as_pairs_mappings_or_ids_and_their_errors():
    docs = encode_records([("ab", "c"), {"prompt": [7, 8], "response": [9]}], ByteTokenizer(), end_id=END)
    assert [d.ids for d in docs] == [(97, 98, 99, END), (7, 8, 9, END)]
    assert docs[1].labels() == [IGNORE_INDEX, 9, END, IGNORE_INDEX]
    assert encode_records([([1], [2])])[0].ids == (1, 2)  # no tokenizer, no end_id: no end token
    with pytest.raises(ValueError, match="the prompt is a string but no tokenizer was given"):
        encode_records([("a", [1])])
    with pytest.raises(ValueError, match="record 1 lacks response; a record maps 'prompt' and 'response'"):
        encode_records([([1], [2]), {"prompt": [1]}])
    with pytest.raises(ValueError, match="record 0 is a str; a record is a \\(prompt, response\\) pair"):
        encode_records(["abc"])
    with pytest.raises(ValueError, match="the response must be a string or a list of non-negative token ids"):
        encode_records([([1], [-3])])


# ----- packing: positions restart, the end token separates, labels stay inside their document -------
def test_packed_rows_restart_positions_and_never_label_across_documents():
    docs = skewed(200, seed=1, median=20, cap=64)
    rows = pack_documents(docs, 64, seed=3)
    assert sorted(d for row in rows for d in row) == list(range(len(docs)))  # every document once
    assert all(sum(len(docs[d]) for d in row) <= 64 for row in rows)
    mb = microbatch(docs, rows)
    for r, row in enumerate(rows):
        ids, labels, pos = (t[r].tolist() for t in (mb.input_ids, mb.labels, mb.position_ids))
        start = 0
        for d in row:  # each document: its ids, positions 0.. , its own labels, then the end token
            n = len(docs[d])
            assert ids[start: start + n] == list(docs[d].ids) and ids[start + n - 1] == END
            assert pos[start: start + n] == list(range(n))
            assert labels[start: start + n] == docs[d].labels()
            start += n
        assert ids[start:] == [0] * (len(ids) - start) and labels[start:] == [IGNORE_INDEX] * (len(ids) - start)
        assert pos[start:] == list(range(len(ids) - start))  # padding: a run of its own
        for i in range(len(ids) - 1):  # a label is the next input of the same document, or -100
            assert labels[i] == IGNORE_INDEX or (labels[i] == ids[i + 1] and pos[i + 1] == pos[i] + 1)
    assert mb.valid_tokens == int((mb.labels != IGNORE_INDEX).sum()) == sum(d.num_targets for d in docs)


# ----- token budget: little padding on a skewed sample, every token exactly once ---------------------
@pytest.mark.parametrize("mode, seq_len", [("bucket", None), ("pack", 128), ("pack", None)])
def test_token_budget_micro_batches_pad_under_5_percent_and_keep_every_token_once(mode, seq_len):
    budget = 1024
    docs = skewed(600, seed=0, cap=seq_len or budget)
    mbs = token_budget_batches(docs, budget, mode=mode, seq_len=seq_len, seed=5)
    fraction = padding_fraction(mbs)
    assert fraction < 0.05, f"{mode}: {fraction:.2%} padding"
    assert all(mb.input_ids.numel() <= budget for mb in mbs)
    if seq_len is None:  # rows of one length per micro-batch (pack: one row; bucket: its documents' lengths)
        assert len({tuple(mb.input_ids.shape) for mb in mbs}) > 1
    placed = [d for mb in mbs for row in mb.documents for d in row]
    assert sorted(placed) == list(range(len(docs)))
    for mb in mbs:  # the real tokens of each row are its documents' ids, in order
        for r, row in enumerate(mb.documents):
            n = sum(len(docs[d]) for d in row)
            assert mb.input_ids[r, :n].tolist() == [i for d in row for i in docs[d].ids]
    assert sum(mb.tokens for mb in mbs) == sum(len(d) for d in docs)


def test_budget_errors_say_what_is_allowed():
    docs = skewed(50, seed=2, median=30, cap=200)
    longest = max(range(50), key=lambda i: len(docs[i]))
    with pytest.raises(ValueError, match=f"document {longest} has {len(docs[longest])} tokens, more than "
                                         "token_budget=16; shorten long documents \\(Document.truncated\\(16\\)\\)"):
        token_budget_batches(docs, 16, mode="bucket")
    with pytest.raises(ValueError, match="unknown mode 'sorted'; allowed: pack, bucket"):
        token_budget_batches(docs, 512, mode="sorted")
    with pytest.raises(ValueError, match="seq_len is the packed row length: only mode='pack' takes it"):
        token_budget_batches(docs, 512, mode="bucket", seq_len=64)
    with pytest.raises(ValueError, match="fewer than one step's num_chunks \\* replicas = 400"):
        FinetuneData(docs, 512, 200, replicas=2)
    assert docs[longest].truncated(16) == Document(docs[longest].ids[:16], docs[longest].targets[:16])


# ----- the loader: steps by index, replicas, the normaliser ------------------------------------------
def test_steps_are_the_same_for_the_same_index_and_replicas_share_the_step():
    docs = skewed(300, seed=4)
    data = FinetuneData(docs, 512, num_chunks=3, mode="bucket", replicas=2, seed=1)
    first = data.step(5, replica=1)
    data.step(0)
    data.step(data.steps_per_epoch + 2)  # another epoch in between
    again = data.step(5, replica=1)
    assert all(torch.equal(a, b) for a, b in zip(first.input_ids + first.labels, again.input_ids + again.labels))
    # one epoch: the replicas' micro-batches are disjoint and never repeat
    mbs = [mb for s in range(data.steps_per_epoch) for r in range(2) for mb in data.step(s, r).microbatches]
    assert len(mbs) == data.steps_per_epoch * 6 > len(data.groups) - 6
    seen = [d for mb in mbs for row in mb.documents for d in row]
    assert len(seen) == len(set(seen))
    step = [data.step(7, r) for r in range(2)]
    total = sum(mb.valid_tokens for s in step for mb in s.microbatches)
    assert step[0].valid_tokens == step[1].valid_tokens == total and step[0].normalizer == total / 2
    assert len(step[0]) == 3 and [len(x) for x in (step[0].labels, step[0].position_ids)] == [3, 3]


def test_the_normalizer_makes_the_replicas_micro_batch_losses_the_step_token_mean():
    """lm_loss(..., normalizer=step.normalizer) summed over a replica's micro-batches, then averaged over the
    replicas (what the gradient sync does), equals the token mean over every valid target of the step."""
    from mt_dualpipe.layers import lm_loss

    data = FinetuneData(skewed(200, seed=6, cap=64), 256, num_chunks=2, mode="pack", seq_len=64, replicas=2, seed=2)
    steps = [data.step(1, r) for r in range(2)]
    g = torch.Generator().manual_seed(0)
    logits = [[torch.randn(*mb.labels.shape, 256, generator=g, dtype=torch.float64) for mb in s.microbatches]
              for s in steps]
    averaged = sum(sum(lm_loss(lg, mb.labels, normalizer=s.normalizer) for lg, mb in zip(lgs, s.microbatches))
                   for lgs, s in zip(logits, steps)) / 2
    flat_logits = torch.cat([lg.reshape(-1, 256) for lgs in logits for lg in lgs])
    flat_labels = torch.cat([mb.labels.reshape(-1) for s in steps for mb in s.microbatches])
    mean = F.cross_entropy(flat_logits, flat_labels, ignore_index=IGNORE_INDEX)
    assert (flat_labels != IGNORE_INDEX).sum() == steps[0].valid_tokens
    torch.testing.assert_close(averaged, mean, rtol=1e-13, atol=0)


def test_assignment_depends_only_on_the_seed():
    docs = skewed(120, seed=8, cap=300)
    assert assign_microbatches(docs, 300, seed=3) == assign_microbatches(docs, 300, seed=3)
    assert assign_microbatches(docs, 300, seed=3) != assign_microbatches(docs, 300, seed=4)


# ----- a loader's steps through a pipeline: ragged micro-batches, the normaliser --------------------------
def _llama():
    from mt_dualpipe.models.llama import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.preset("tiny", vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2)
    torch.manual_seed(0)
    return config, LlamaForCausalLM(config).double()


def _loader() -> FinetuneData:
    return FinetuneData(skewed(60, seed=9, median=12, cap=48), 96, num_chunks=4, mode="bucket", seed=1)


def _pipelined(rank: int, world: int) -> dict:
    from mt_dualpipe import Pipeline
    from mt_dualpipe.models.llama import criterion_for, stages_for_rank
    from mt_dualpipe.schedules.registry import build_schedule

    config, model = _llama()
    mods = [m.double() for m in stages_for_rank(config, build_schedule("1f1b", 2, 4), rank, source=model)]
    step = _loader().step(2)
    pipe = Pipeline(mods, "1f1b", timeout=60)
    pipe.step(*([step.input_ids] if rank == 0 else []), num_chunks=4,
              criterion=criterion_for(mods, normalizer=step.normalizer), labels=(step.labels,) if rank == 1 else ())
    return {n: p.grad.clone() for m in mods for n, p in m.named_parameters()}


@pytest.mark.kernels  # two float paths compared: .ci/run repeats it on other CPU kernels
def test_a_loader_step_through_a_pipeline_equals_the_step_token_mean_on_one_process():
    from tests.helpers.dist import run_ranks

    step = _loader().step(2)
    assert len({tuple(x.shape) for x in step.input_ids}) > 1  # the step's micro-batches differ in shape
    _, model = _llama()
    sums = [model(x, y) * int((y != IGNORE_INDEX).sum()) for x, y in zip(step.input_ids, step.labels)]
    (torch.stack(sums).sum() / step.valid_tokens).backward()
    got = {}
    for grads in run_ranks(_pipelined, 2, timeout=120):
        got.update(grads)
    assert set(got) == {n for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-12, atol=1e-13, msg=n)
