"""The model against the real reference: transformers' ModernBertForMaskedLM, random tiny
configs built here (never downloaded), float32, both directions of conversion."""
import json
import os

import pytest
import torch

import detour

transformers = pytest.importorskip("transformers")

SPECIAL = dict(pad_token_id=0, unk_token_id=1, cls_token_id=2, sep_token_id=3, mask_token_id=4)


def tiny_config(**kw):
    base = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, local_attention=16, max_position_embeddings=256, **SPECIAL)
    base.update(kw)
    return detour.Config(**base)


def hf_model(c, impl):
    hc = transformers.ModernBertConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        local_attention=c.local_attention, global_attn_every_n_layers=c.global_attn_every_n_layers,
        global_rope_theta=c.global_rope_theta, local_rope_theta=c.local_rope_theta,
        max_position_embeddings=c.max_position_embeddings, pad_token_id=c.pad_token_id,
        cls_token_id=c.cls_token_id, sep_token_id=c.sep_token_id, bos_token_id=c.cls_token_id,
        eos_token_id=c.sep_token_id, attn_implementation=impl)
    torch.manual_seed(0)
    return transformers.ModernBertForMaskedLM(hc).eval()


def batch(c, B=3, T=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(5, c.vocab_size, (B, T), generator=g)
    am = torch.ones(B, T, dtype=torch.long)
    if B >= 3:
        am[1, T - 7:] = 0  # padding present
        am[2, T - 1:] = 0
    idx[am == 0] = c.pad_token_id
    return idx, am


def max_err(a, b, am):
    return (a - b)[am.bool()].abs().max().item()  # real tokens only: pad outputs are unspecified


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_hf_to_ours_logits_match(impl, tmp_path):
    c = tiny_config()
    ref = hf_model(c, impl)
    ref.save_pretrained(tmp_path)
    ours = detour.load_hf(str(tmp_path)).eval()
    idx, am = batch(c)
    with torch.no_grad():
        want = ref(input_ids=idx, attention_mask=am).logits
        got, _ = ours(idx, attention_mask=am)
    assert max_err(got, want, am) < 1e-4


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_ours_to_hf_logits_match(impl, tmp_path):
    c = tiny_config(num_hidden_layers=5, global_attn_every_n_layers=2, local_attention=8)
    torch.manual_seed(1)
    ours = detour.ModernBERT(c).eval()
    with torch.no_grad():  # non-trivial norms and bias so every parameter matters
        for n, p in ours.named_parameters():
            if "norm" in n or "bias" in n:
                p.add_(0.1 * torch.randn_like(p))
    detour.save_hf(ours, str(tmp_path))
    ref = transformers.AutoModelForMaskedLM.from_pretrained(str(tmp_path), attn_implementation=impl).eval()
    idx, am = batch(c, T=33, seed=1)
    with torch.no_grad():
        want = ref(input_ids=idx, attention_mask=am).logits
        got, _ = ours(idx, attention_mask=am)
    assert max_err(got, want, am) < 1e-4


def test_state_dict_names_equal_hf():
    c = tiny_config()
    ours = set(detour.ModernBERT(c).state_dict())
    theirs = set(hf_model(c, "sdpa").state_dict())
    assert ours == theirs


def test_load_newer_config_form(tmp_path):
    """config.json with layer_types / rope_parameters (transformers v5 save_pretrained)."""
    c = tiny_config(global_rope_theta=5000.0, local_rope_theta=777.0)
    ref = hf_model(c, "sdpa")
    ref.save_pretrained(tmp_path)
    d = json.load(open(tmp_path / "config.json"))
    assert "layer_types" in d and "rope_parameters" in d
    ours = detour.load_hf(str(tmp_path))
    assert ours.config.layer_types == d["layer_types"]
    assert ours.config.local_rope_theta == 777.0 and ours.config.global_rope_theta == 5000.0


def test_load_older_config_form(tmp_path):
    """The released answerdotai config.json form: global/local_rope_theta, every_n."""
    c = tiny_config(num_hidden_layers=4, global_attn_every_n_layers=2, global_rope_theta=4000.0)
    ours = detour.ModernBERT(c)
    detour.save_hf(ours, str(tmp_path))
    d = json.load(open(tmp_path / "config.json"))
    for k in ("layer_types", "rope_parameters"):
        d.pop(k)
    d.update(global_rope_theta=4000.0, local_rope_theta=10000.0, global_attn_every_n_layers=2)
    json.dump(d, open(tmp_path / "config.json", "w"))
    back = detour.load_hf(str(tmp_path))
    assert back.config.layer_types == ["full_attention", "sliding_attention"] * 2
    assert back.config.global_rope_theta == 4000.0
    idx, am = batch(c)
    with torch.no_grad():
        assert torch.equal(back.eval()(idx, attention_mask=am)[0], ours.eval()(idx, attention_mask=am)[0])


def test_causal_flag_hides_the_future():
    c = tiny_config()
    torch.manual_seed(0)
    m = detour.ModernBERT(c).eval()
    idx, _ = batch(c, B=1, T=48)
    with torch.no_grad():
        for t in (0, 10, 30, 46):
            changed = idx.clone()
            changed[0, t + 1:] = torch.randint(5, c.vocab_size, (47 - t,))
            a, _ = m(idx, causal=True)
            b, _ = m(changed, causal=True)
            assert torch.allclose(a[0, :t + 1], b[0, :t + 1], atol=1e-6), t  # past untouched
            a, _ = m(idx, causal=False)
            b, _ = m(changed, causal=False)
            assert not torch.allclose(a[0, :t + 1], b[0, :t + 1], atol=1e-4), t  # bidirectional sees it


def test_local_window_is_64_each_side_and_causal_64_before():
    """With one local layer only, a token's output depends on exactly the window."""
    c = tiny_config(num_hidden_layers=1, global_attn_every_n_layers=2, layer_types=["sliding_attention"],
                    local_attention=8)
    torch.manual_seed(0)
    m = detour.ModernBERT(c).eval()
    idx, _ = batch(c, B=1, T=30)
    t = 15
    for causal, seen in ((False, range(11, 20)), (True, range(11, 16))):
        for j in range(30):
            changed = idx.clone()
            changed[0, j] = 5 + (idx[0, j] - 5 + 1) % (c.vocab_size - 5)
            with torch.no_grad():
                diff = (m(idx, causal=causal)[0][0, t] - m(changed, causal=causal)[0][0, t]).abs().max()
            assert (diff > 1e-6) == (j in seen), (causal, j)


def test_documents_do_not_see_each_other():
    c = tiny_config()
    torch.manual_seed(0)
    m = detour.ModernBERT(c).eval()
    g = torch.Generator().manual_seed(3)
    doc1, doc2 = torch.randint(5, 101, (1, 20), generator=g), torch.randint(5, 101, (1, 15), generator=g)
    doc2b = torch.randint(5, 101, (1, 15), generator=g)
    sep = torch.tensor([[c.sep_token_id]])
    packed = torch.cat([doc1, sep, doc2], 1)
    packed_b = torch.cat([doc1, sep, doc2b], 1)
    ids = detour.document_ids(packed, c.sep_token_id)
    with torch.no_grad():
        for causal in (False, True):
            a = m(packed, causal=causal, doc_ids=ids)[0][0, :21]
            b = m(packed_b, causal=causal, doc_ids=ids)[0][0, :21]
            alone = m(torch.cat([doc1, sep], 1), causal=causal)[0][0]
            assert torch.allclose(a, b, atol=1e-5) and torch.allclose(a, alone, atol=1e-4)
            # without the document mask the first document does see the second
            a = m(packed, causal=False)[0][0, :21]
            b = m(packed_b, causal=False)[0][0, :21]
            assert not torch.allclose(a, b, atol=1e-4)


def test_sparse_head_matches_dense_logits():
    """The loss of the sparse head (only the supervised positions) and score's chunked loss and
    accuracy (one row per chunk here) equal cross-entropy on the dense logits at those positions."""
    c = tiny_config()
    torch.manual_seed(0)
    m = detour.ModernBERT(c).eval()
    idx, _ = batch(c, B=2, T=20)
    targets = torch.full_like(idx, detour.IGNORE)
    targets[0, 3], targets[1, 7] = 9, 11
    with torch.no_grad():
        dense, _ = m(idx)
        none, loss = m(idx, targets=targets)
        mean, acc = m.score(idx, targets, chunk=1)
    picked, t = torch.stack([dense[0, 3], dense[1, 7]]), torch.tensor([9, 11])
    want = torch.nn.functional.cross_entropy(picked, t)
    assert none is None and abs(loss.item() - want.item()) < 1e-5 and abs(mean.item() - want.item()) < 1e-5
    assert acc.item() == (picked.argmax(-1) == t).float().mean().item()


def masked_rows(B, T, seed):
    """doc_ids of packed documents and an attention_mask with padding at the end of row 1."""
    g = torch.Generator().manual_seed(seed)
    sep = torch.rand(B, T, generator=g) < 0.15
    doc_ids = torch.cumsum(sep.long(), 1) - sep.long()
    am = torch.ones(B, T, dtype=torch.long)
    am[1, T - T // 3:] = 0
    return doc_ids, am


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T,window", [(37, 8), (64, 8), (5, 8), (9, 4)])
def test_block_sliding_attention_equals_dense_masked(causal, T, window):
    """Blocks of `window` queries over 3 (causal: 2) blocks of keys == dense sliding-window
    attention: T not a multiple of the block, T below the window, documents and padding;
    outputs and gradients."""
    B, H, D = 3, 2, 8
    g = torch.Generator().manual_seed(T + window)
    q, k, v = (torch.randn(B, H, T, D, generator=g, requires_grad=True) for _ in range(3))
    dy = torch.randn(B, H, T, D, generator=g)
    for doc_ids, am in ((None, None), masked_rows(B, T, seed=T)):
        dense = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=detour.dense_mask(B, T, "cpu", causal, window, am, doc_ids))
        want = torch.autograd.grad(dense, (q, k, v), dy)
        mask = detour.block_sliding_mask(B, T, "cpu", causal, window, am, doc_ids)
        block = detour.block_sliding_attention(q, k, v, mask, window, causal)
        got = torch.autograd.grad(block, (q, k, v), dy)
        assert block.shape == dense.shape and torch.allclose(block, dense, atol=1e-5)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, atol=1e-5)


def test_model_flops_by_hand_and_allowed_pairs_by_may_attend():
    c = tiny_config()  # d=64, I=96, V=101, 4 layers: global, local, local, global; window 16 (8 each side)
    per_token = 4 * 2 * (3 * 64 * 64 + 64 * 64 + 2 * 64 * 96 + 96 * 64)  # 4 layers x 69_632
    head = 2 * (64 * 64 + 64 * 101)                                       # 21_120
    # one document of 40: global 40^2 pairs (causal 40 x 41 / 2); local: each query itself and
    # min(i, 8) before (0+1+...+8 + 31 x 8 = 284 in all), as many after: 40 + 2 x 284
    assert detour.attention_pairs([40]) == 1600 and detour.attention_pairs([40], causal=True) == 820
    assert detour.attention_pairs([40], 8) == 608 and detour.attention_pairs([40], 8, causal=True) == 324
    want = 3 * (40 * per_token + 4 * 64 * (2 * 1600 + 2 * 608) + 40 * head)
    assert detour.model_flops(c, [40]) == want
    assert detour.model_flops(c, [40], predicted=12) == pytest.approx(want - 3 * 28 * head)
    assert detour.model_flops(c, [40], causal=True) == 3 * (40 * per_token + 4 * 64 * (2 * 820 + 2 * 324) + 40 * head)
    # the count equals may_attend's allowed pairs on packed rows (documents cut by [SEP] and row ends)
    idx, _ = batch(c, B=2, T=50)
    idx[0, [5, 6, 30]], idx[1, 49] = c.sep_token_id, c.sep_token_id
    doc_ids = detour.document_ids(idx, c.sep_token_id)
    cu, _ = detour.document_spans(doc_ids)
    for causal in (False, True):
        for window in (None, 8):
            allowed = detour.dense_mask(2, 50, "cpu", causal, window, doc_ids=doc_ids).sum().item()
            assert detour.attention_pairs(cu.diff().tolist(), window, causal) == allowed, (causal, window)
    assert detour.device_peak_flops("cpu") is None


@pytest.mark.parametrize("causal", [False, True])
def test_chunked_loss_equals_logits_loss(causal):
    """Training mode computes the loss chunk by chunk without logits (LinearCrossEntropy):
    same loss and same gradients as cross-entropy on the materialized logits."""
    c = tiny_config()
    torch.manual_seed(0)
    m = detour.ModernBERT(c).train()
    idx, _ = batch(c, B=2, T=30)
    targets = torch.where(torch.rand(idx.shape) < 0.5, idx, detour.IGNORE)
    results = []
    for materialized in (True, False):
        m.zero_grad()
        if materialized:  # the reference: the logits of the supervised positions, then cross-entropy
            keep = targets.reshape(-1) != detour.IGNORE
            h = m.model(idx, causal=causal).reshape(-1, c.hidden_size)[keep]
            loss = torch.nn.functional.cross_entropy(m.decoder(m.head(h)), targets.reshape(-1)[keep])
        else:
            loss = m(idx, targets, causal=causal)[1]
        loss.backward()
        results.append((loss.item(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    (want, grads), (got, chunked) = results
    assert abs(got - want) < 1e-5
    for n, g in grads.items():
        assert torch.allclose(chunked[n], g, atol=1e-6), n
    # several chunks (7 rows each, the last one short): loss and all three gradients
    h, t = torch.randn(50, c.hidden_size, requires_grad=True), torch.randint(0, c.vocab_size, (50,))
    w, b = m.decoder.weight.detach().clone().requires_grad_(), m.decoder.bias.detach().clone().requires_grad_()
    full = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w, b), t)
    want = torch.autograd.grad(full, (h, w, b))
    chunked = detour.LinearCrossEntropy.apply(h, w, b, t, 50, 7)
    got = torch.autograd.grad(chunked, (h, w, b))
    assert torch.allclose(chunked, full, atol=1e-6)
    for g, e in zip(got, want):
        assert torch.allclose(g, e, atol=1e-6)
