"""Document masking (``data.document_mask``): in a window that packs several documents of the
token stream, a token's logits depend only on its own document, in kiln's GPT and in a Hugging
Face Llama, and the end-of-text token's target (the next document's first token) is no loss."""

from __future__ import annotations

import pytest
import torch

from kiln.data.batch import TextBatch
from kiln.data.loader import DocumentSequences, TokenSequences, document_positions
from kiln.labels import IGNORE_INDEX
from kiln.models.gpt.model import GPT, GPTConfig

EOT = 0


def test_positions_restart_after_each_end_of_text_whose_target_is_no_loss():
    stream = torch.tensor([5, 6, EOT, 7, 8, 9, EOT, EOT, 4, 3, 2]).numpy()
    x, y, positions = DocumentSequences(TokenSequences(stream, 10), EOT)[0]
    assert positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 0, 1]
    assert y.tolist() == [6, EOT, IGNORE_INDEX, 8, 9, EOT, IGNORE_INDEX, IGNORE_INDEX, 3, 2]
    batch = TextBatch.collate([(x, y, positions)] * 3)
    assert batch.count == 3 * 7 and [len(part) for part in batch.split_rows(2)] == [2, 1]
    assert document_positions(torch.zeros(4, dtype=torch.bool)).tolist() == [0, 1, 2, 3]


def rows(first_document: list[int], second_document: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One row packing two documents, and its positions."""
    row = torch.tensor([first_document + [EOT] + second_document])
    return row, document_positions(row[0] == EOT)[None]


def gpt() -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=64, n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64, max_seq_len=64, tie_embeddings=True
    )
    return GPT(cfg).eval()


def test_a_gpt_token_sees_only_its_own_document():
    model, second = gpt(), [9, 8, 7, 6, 5]
    with torch.no_grad():
        a, pa = rows([1, 2, 3, 4], second)
        b, pb = rows([11, 12, 13, 14, 15, 16, 17], second)  # other tokens, and more of them
        logits_a, logits_b = model(a, positions=pa), model(b, positions=pb)
        torch.testing.assert_close(logits_a[0, -5:], logits_b[0, -5:], rtol=0, atol=1e-5)
        # Alone in its own row, the second document (after its end-of-text token) reads the same.
        alone = torch.tensor([[EOT, *second]])
        torch.testing.assert_close(model(alone, positions=torch.tensor([[0, 0, 1, 2, 3, 4]]))[0, 1:], logits_a[0, -5:])
        # Without the mask, it reads the first document.
        assert (model(a)[0, -5:] - model(b)[0, -5:]).abs().max() > 1e-3


def test_a_batch_of_packed_documents_trains_on_every_target_but_the_ends_of_text():
    model = gpt()
    stream = torch.tensor([3, 4, 5, EOT, 6, 7, EOT, 8, 9, 10, 11, 12, EOT]).numpy()
    batch = TextBatch.collate([DocumentSequences(TokenSequences(stream, 12), EOT)[0]])
    from kiln.models.lm import lm_loss

    loss = lm_loss(model, batch)
    logits = model(batch.inputs, positions=batch.positions)
    want = torch.nn.functional.cross_entropy(logits[0], batch.targets[0], ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)


def test_a_hugging_face_llama_token_sees_only_its_own_document():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from kiln.models.hf import FAMILY, CausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = CausalLM(LlamaForCausalLM(config)).eval()
    second = [9, 8, 7, 6, 5]
    a, pa = rows([1, 2, 3, 4], second)
    b, pb = rows([11, 12, 13, 14, 15, 16, 17], second)
    with torch.no_grad():
        logits_a, logits_b = model(a, position_ids=pa), model(b, position_ids=pb)
        torch.testing.assert_close(logits_a[0, -5:], logits_b[0, -5:], rtol=0, atol=1e-5)
        assert (model(a)[0, -5:] - model(b)[0, -5:]).abs().max() > 1e-3
        # The family's loss of a TextBatch (the fused head) is the mean over the kept targets.
        stream = torch.tensor([3, 4, 5, EOT, 6, 7, EOT, 8, 9, 10, 11, 12, EOT]).numpy()
        batch = TextBatch.collate([DocumentSequences(TokenSequences(stream, 12), EOT)[0]])
        logits = model(batch.inputs, position_ids=batch.positions)
        want = torch.nn.functional.cross_entropy(logits[0], batch.targets[0], ignore_index=IGNORE_INDEX)
        torch.testing.assert_close(FAMILY.loss(model, batch), want, rtol=1e-5, atol=1e-6)


def test_records_are_kept_apart_by_packing_not_by_the_document_mask():
    from kiln.config import from_dict

    errors = from_dict({"data": {"document_mask": True, "format": "records"}}).errors()
    assert (
        "data.document_mask: masks the documents of a text corpus; fine-tuning records are kept apart by "
        "data.packing" in errors
    )
