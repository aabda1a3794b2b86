"""Packed documents (``layers/documents.py``) in every family and every attention core: one process, float64.

Rows pack documents of different lengths as ``data.batching.microbatch`` does (position ids restarting at 0
per document, each document's last label -100, the padding a document of its own). For Llama, Qwen3-MoE,
DeepSeek-V3 (the main model) and LLaVA (images inside documents), with the eager, recomputed and flash
cores, the packed logits, the loss over the rows' valid-label count and every gradient equal

- transformers' own packed path: transformers 5 splits documents itself when it gets position ids and
  neither an attention mask nor a cache (``masking_utils.find_packed_sequence_indices``), with its eager
  attention on CPU (no flash-attn needed);
- transformers run document by document (each document alone, position ids 0..n-1).

DeepSeek-V3's MTP modules, which transformers lacks, are checked against our model run document by
document. Tolerance 1e-12 relative (max |a - b| / max |b| per tensor): both sides compute in float64
(``hf_reference.float64_transformers``) and differ only in summation order (the flash core's blocked
products, a batched weight gradient against a sum over documents), a few ulps per op at these depths.
The pipelined runs (every schedule, 2 ranks) are ``test_packed_documents_dist.py``.
"""

from __future__ import annotations

import pytest
import torch

from mt_dualpipe.data.batching import microbatch
from mt_dualpipe.layers import check_position_ids, core_attention, document_ids, lm_loss, step_normalizer
from mt_dualpipe.layers import flash_core as fc
from mt_dualpipe.layers.attention_core import CORES
from mt_dualpipe.models.deepseek_v3 import DeepSeekV3Config, DeepSeekV3Model, language_model_losses, step_normalizers
from mt_dualpipe.models.llama import LlamaConfig, LlamaForCausalLM, build_stages
from mt_dualpipe.models.llava import LlavaConfig
from mt_dualpipe.models.llava import build_stages as llava_stages
from tests.helpers import hf_reference
from tests.helpers.hf_reference import float64_transformers, randomize, relative_error, unfused_grads
from tests.helpers.packed import (
    EXTRA_MODULES,
    FAMILIES,
    VOCAB,
    grads_of,
    hf_models,
    logits_of,
    max_grad_error,
    set_core,
)
from tests.helpers.packed import documents as make_documents

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)
pytestmark = pytest.mark.kernels  # two float paths compared: .ci/run repeats it on other CPU kernels

LENGTHS = (5, 7, 4, 9, 6)  # documents 0..4
ROWS = ((0, 1, 2), (3, 4))  # row 0: 16 tokens, row 1: 15 and one padding position
IMAGES = (1, 3)  # LLaVA: these documents hold an image, after their first token
TOL = 1e-12


@pytest.fixture(autouse=True)
def _float64_everywhere(monkeypatch):
    """transformers' Qwen3-MoE and CLIP modules compute in float64 too under ``float64_transformers``."""
    monkeypatch.setattr(hf_reference, "MODULES", hf_reference.MODULES + EXTRA_MODULES)


def documents(image: int | None = None, tokens_per_image: int = 0):
    return make_documents(LENGTHS, image, tokens_per_image, IMAGES if image is not None else ())


def run(model, ids, labels, pos, pixels, normalizer, rename=None):
    """Logits, the loss (summed targets over ``normalizer``) and every gradient of one forward/backward;
    ``rename``: transformers' gradients under our names."""
    model.zero_grad(set_to_none=True)
    out = logits_of(model, ids, pos, pixels)
    loss = lm_loss(out, labels, normalizer=normalizer)
    loss.backward()
    return out.detach(), float(loss.detach()), (grads_of(model) if rename is None else unfused_grads(model, rename))


def per_document(model, docs, images, normalizer, rename=None):
    """Each document alone (position ids 0..n-1): its logits, the summed loss and the summed gradients."""
    model.zero_grad(set_to_none=True)
    outs, total = [], 0.0
    for d, doc in enumerate(docs):
        ids, labels = torch.tensor([doc.ids]), torch.tensor([doc.labels()])
        out = logits_of(model, ids, None, images.get(d))
        loss = lm_loss(out, labels, normalizer=normalizer)
        loss.backward()
        outs.append(out.detach())
        total += float(loss.detach())
    return outs, total, (grads_of(model) if rename is None else unfused_grads(model, rename))


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_rows_equal_transformers_packed_and_document_by_document(tmp_path, family):
    hf, ours, rename = hf_models(family, tmp_path)
    image = ours.config.image_token_id if family == "llava" else None
    docs = documents(image, ours.config.tokens_per_image if image else 0)
    mb = microbatch(docs, ROWS)
    normalizer = step_normalizer(mb.labels)
    g = torch.Generator().manual_seed(3)
    images, pixels = {}, None
    if image is not None:  # one image per document in IMAGES, flat in the rows' order (transformers' layout)
        v = ours.config.vision
        images = {d: torch.randn(1, v.num_channels, v.image_size, v.image_size, generator=g, dtype=torch.float64)
                  for d in IMAGES}
        pixels = torch.cat([images[d] for row in ROWS for d in row if d in images])
    with float64_transformers():
        packed = run(hf, mb.input_ids, mb.labels, mb.position_ids, pixels, normalizer, rename)
        alone = per_document(hf, docs, images, normalizer, rename)
    errors = {}
    for core in CORES:
        set_core(ours, core)
        logits, loss, grads = run(ours, mb.input_ids, mb.labels, mb.position_ids, pixels, normalizer)
        spans = [(r, sum(LENGTHS[e] for e in row[:k]), d) for r, row in enumerate(ROWS) for k, d in enumerate(row)]
        errors[core] = {
            "packed logits": relative_error(logits, packed[0]),
            "packed loss": abs(loss - packed[1]) / abs(packed[1]),
            "packed grads": max_grad_error(grads, packed[2]),
            "alone logits": max(relative_error(logits[r, s:s + LENGTHS[d]], alone[0][d][0]) for r, s, d in spans),
            "alone loss": abs(loss - alone[1]) / abs(alone[1]),
            "alone grads": max_grad_error(grads, alone[2]),
        }
    print(f"{family} packed documents, max relative error vs transformers (float64): {errors}")
    assert all(e < TOL for per_core in errors.values() for e in per_core.values()), errors
    # the comparison can fail: without position ids the documents see each other and RoPE runs on
    set_core(ours, "eager")
    crossing = run(ours, mb.input_ids, mb.labels, None, pixels, normalizer)
    assert relative_error(crossing[0], packed[0]) > 1e-3


@pytest.mark.parametrize("core", CORES)
def test_mtp_modules_keep_to_each_document(core):
    """Depth k of a packed row predicts only targets of the position's own document, attending inside it, and the
    step's counts (``step_normalizers`` with position ids) leave out the targets in another document: the main
    and MTP losses and every gradient equal each document's alone."""
    config = DeepSeekV3Config.preset("tiny", dim=32, n_layers=2, vocab_size=VOCAB, inter_dim=48, moe_inter_dim=16,
                                     max_seq_len=32, mtp_depth=2, balance_loss_weight=0.0)
    torch.manual_seed(0)
    model = DeepSeekV3Model(config).double()
    randomize(model, 2)
    set_core(model, core)
    docs = documents()
    mb = microbatch(docs, ROWS)
    counts = step_normalizers(mb.labels, 2, position_ids=mb.position_ids)
    alone_labels = [torch.tensor([doc.labels()]) for doc in docs]
    assert counts == step_normalizers(alone_labels, 2)
    assert counts[1] < step_normalizers(mb.labels, 2)[1]  # without position ids depth 1 counts crossing targets

    def losses(ids, labels, pos):
        h = model.hidden(ids, pos)
        return language_model_losses(h, labels, embed=model.model.embed_tokens, norm=model.model.norm,
                                     head=model.lm_head, mtp=model.mtp,
                                     config=config, normalizer=counts, position_ids=pos)

    packed = losses(mb.input_ids, mb.labels, mb.position_ids)
    packed.total.backward()
    want = {n: g.clone() for n, g in grads_of(model).items()}
    model.zero_grad(set_to_none=True)
    parts = [losses(torch.tensor([doc.ids]), y, None) for doc, y in zip(docs, alone_labels)]
    torch.stack([p.total for p in parts]).sum().backward()
    got = grads_of(model)  # an expert only padding reached has a zero gradient in the packed run, none alone
    assert bool(got["mtp.1.eh_proj.weight"].any())
    main = sum(float(p.main.detach()) for p in parts)
    mtp = [sum(float(p.mtp[k].detach()) for p in parts) for k in range(2)]
    want_mtp = [float(m.detach()) for m in packed.mtp]
    print(f"MTP ({core}) packed vs per document: main {abs(main - float(packed.main.detach())):.2e}, mtp "
          f"{[abs(a - b) for a, b in zip(mtp, want_mtp)]}, grads {max_grad_error(got, want):.2e}")
    assert main == pytest.approx(float(packed.main.detach()), rel=TOL, abs=0)
    assert mtp == pytest.approx(want_mtp, rel=TOL, abs=0)
    assert max_grad_error(got, want) < TOL


@pytest.mark.parametrize("core", CORES)
def test_every_core_keeps_attention_inside_documents_across_query_blocks(monkeypatch, core):
    """Documents that straddle the flash core's query blocks (blocks of 8 here): each document's output and the
    gradients of q, k and v equal those of the document alone in the eager core."""
    monkeypatch.setattr(fc, "QUERY_BLOCK", 8)
    lengths = ((3, 11, 6), (20,))
    pos = torch.tensor([[i for n in row for i in range(n)] for row in lengths])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 20, 2, d, generator=g, dtype=torch.float64).requires_grad_() for d in (6, 6, 4))
    grad = torch.randn(2, 20, 2 * 4, generator=g, dtype=torch.float64)
    out = core_attention(q, k, v, 0.4, core, document_ids(pos))
    got = torch.autograd.grad(out, (q, k, v), grad)
    want_out, want = torch.empty_like(out), [torch.empty_like(t) for t in (q, k, v)]
    for r, row in enumerate(lengths):
        start = 0
        for n in row:
            span = slice(start, start + n)
            parts = [t[r:r + 1, span].detach().requires_grad_() for t in (q, k, v)]
            y = core_attention(*parts, 0.4, "eager")
            want_out[r, span] = y[0]
            for w, gr in zip(want, torch.autograd.grad(y, parts, grad[r:r + 1, span])):
                w[r, span] = gr[0]
            start += n
    assert relative_error(out, want_out) < TOL
    assert max(relative_error(a, b) for a, b in zip(got, want)) < TOL


def test_documents_begin_where_position_ids_restart_as_in_transformers():
    from transformers.masking_utils import find_packed_sequence_indices

    pos = torch.tensor([[0, 1, 2, 0, 1, 5, 6, 7, 0, 1],  # restarts at 0 and a jump (1 -> 5) without a 0
                        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9],  # one document
                        [4, 5, 6, 0, 1, 2, 3, 9, 9, 0]])  # a repeated id begins one too
    ours, theirs = document_ids(pos), find_packed_sequence_indices(pos)
    assert torch.equal(ours[:, :, None] == ours[:, None, :], theirs[:, :, None] == theirs[:, None, :])
    assert ours[0].tolist() == [1, 1, 1, 2, 2, 3, 3, 3, 4, 4]


def test_a_jump_in_position_ids_begins_a_document_with_rope_at_its_ids(tmp_path):
    """Position ids 0..4 then 7..12: two documents, the second rotated from 7, as in transformers."""
    hf, ours, _ = hf_models("llama", tmp_path)
    ids = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(5))
    pos = torch.tensor([[0, 1, 2, 3, 4, 7, 8, 9, 10, 11, 12]])
    with float64_transformers(), torch.no_grad():
        want = hf(input_ids=ids, position_ids=pos, use_cache=False).logits
        second_alone = hf(input_ids=ids[:, 5:], position_ids=pos[:, 5:], use_cache=False).logits
    with torch.no_grad():
        got = ours(ids, position_ids=pos)
    assert relative_error(got, want) < TOL
    assert relative_error(got[:, 5:], second_alone) < TOL


def test_position_ids_counting_up_each_row_change_nothing():
    """One document a row (ids 0..S-1) is the unpacked run, bit for bit: RoPE by ids equals the tables."""
    config = LlamaConfig.preset("tiny", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).double()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids, position_ids=torch.arange(9).expand(2, 9)), model(ids))


def test_stages_hand_on_position_ids_and_end_with_the_models_loss():
    """Two stages run by hand: the first takes (ids, position ids), each returns (hidden, int32 position ids), the
    criterion takes (hidden, position ids, labels) and gives the full model's loss."""
    config = LlamaConfig.preset("tiny", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).double()
    first, last = (st.double() for st in build_stages(config, 2, source=model, defer_weight_grads=False))
    mb = microbatch(documents(), ROWS)
    h, pos = first(mb.input_ids, mb.position_ids)
    assert pos.dtype == torch.int32 and torch.equal(pos, mb.position_ids.int())
    assert pos.data_ptr() != mb.position_ids.data_ptr()
    out = last(h, pos)
    assert torch.equal(last.criterion(*out, mb.labels), model(mb.input_ids, mb.labels, position_ids=mb.position_ids))
    with pytest.raises(TypeError, match=r"the criterion got position ids \(the last stage returns them with the "
                                        r"hidden states for packed rows\) but no labels; pass labels= to step\(\)"):
        last.criterion(*out)


def test_llava_stages_tell_pixel_values_from_position_ids():
    config = LlavaConfig.preset("tiny")
    first, last = llava_stages(config, 2, dtype=torch.float64)
    docs = documents(config.image_token_id, config.tokens_per_image)
    mb = microbatch(docs, ROWS)
    v = config.vision
    pixels = torch.randn(2, v.num_channels, v.image_size, v.image_size, dtype=torch.float64)
    with torch.no_grad():
        h, pos = first(mb.input_ids, pixels, mb.position_ids)
        text = microbatch(documents(), ROWS)
        assert len(first(text.input_ids, text.position_ids)) == 2  # no images: (ids, position ids)
        assert torch.is_tensor(last(h))  # no position ids: hidden states alone
        with pytest.raises(ValueError, match=r"stage 1 of 2: .* takes \(hidden\[, position_ids\]\): only the first "
                                             r"stage takes pixel_values; after its first input it got a "
                                             r"torch.float64 tensor"):
            last(h, pixels)
        with pytest.raises(ValueError, match=r"takes \(input_ids\[, pixel_values\]\[, position_ids\]\); after its "
                                             r"first input it got a torch.float64 tensor, a torch.int32 tensor, a "
                                             r"torch.int32 tensor"):
            first(mb.input_ids, pixels, pos, pos)


def test_bad_position_ids_and_crossing_labels_are_refused_with_one_message():
    config = LlamaConfig.preset("tiny", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2)
    model = LlamaForCausalLM(config).double()
    mb = microbatch(documents(), ROWS)
    with pytest.raises(ValueError, match=r"^LlamaForCausalLM: position_ids have shape \(2, 15\) but the tokens "
                                         r"\(2, 16\); give one position id per token, \(batch, seq\)$"):
        model(mb.input_ids, position_ids=mb.position_ids[:, 1:])
    with pytest.raises(ValueError, match=r"^GQAttention takes position_ids as integers \(int64 or int32\), got a "
                                         r"torch.float64 tensor$"):
        check_position_ids(mb.position_ids.double(), (2, 16), "GQAttention")
    crossing = mb.labels.clone()
    crossing[0, LENGTHS[0] - 1] = 5  # document 0's last label: document 1's first token
    with pytest.raises(ValueError, match=r"^labels cross a document boundary: row 0, position 4 is the last token of "
                                         r"a document \(a new one begins after it\) but its label is 5; a packed "
                                         r"document's last label must be -100 \(mt_dualpipe.data.documents does "
                                         r"this\)$"):
        model(mb.input_ids, crossing, position_ids=mb.position_ids)
    with pytest.raises(ValueError, match=r"^step_normalizers got 2 label tensors but 1 position_ids tensors; give one "
                                         r"per micro-batch$"):
        step_normalizers([mb.labels, mb.labels], 1, position_ids=[mb.position_ids])
