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
    c = tiny_config()
    torch.manual_seed(0)
    m = detour.ModernBERT(c).eval()
    idx, _ = batch(c, B=2, T=20)
    targets = torch.full_like(idx, detour.IGNORE)
    targets[0, 3], targets[1, 7] = 9, 11
    with torch.no_grad():
        dense, _ = m(idx)
        sparse, loss = m(idx, targets=targets)
    assert sparse.shape == (2, c.vocab_size)
    assert torch.allclose(sparse, torch.stack([dense[0, 3], dense[1, 7]]), atol=1e-5)
    want = torch.nn.functional.cross_entropy(torch.stack([dense[0, 3], dense[1, 7]]), torch.tensor([9, 11]))
    assert abs(loss.item() - want.item()) < 1e-5


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


def test_model_flops_per_token_by_hand():
    c = tiny_config()  # d=64, I=96, V=101, 4 layers: global, local, local, global; window 16
    per_layer = 2 * (3 * 64 * 64 + 64 * 64 + 2 * 64 * 96 + 96 * 64)  # 69_632
    head = 2 * (64 * 64 + 64 * 101)                                  # 21_120
    attn_global, attn_local = 4 * 64 * 40, 4 * 64 * 17               # T=40 keys; 17 = window + 1
    want = 3 * (4 * per_layer + 2 * attn_global + 2 * attn_local + head)
    assert want == 986_496
    assert detour.model_flops_per_token(c, 40) == want
    assert detour.model_flops_per_token(c, 40, causal=True) == want - 3 * (attn_global + attn_local)
    assert detour.model_flops_per_token(c, 8) == 3 * (4 * per_layer + 4 * (4 * 64 * 8) + head)  # T < window
    assert detour.model_flops_per_token(c, 40, head_fraction=0.3) == pytest.approx(want - 3 * 0.7 * head)
    assert detour.device_peak_flops("cpu") is None


def test_flex_block_mask_equals_dense_masks():
    """The flex backend's BlockMask comes from the same predicate; checked forward on CPU with
    eager flex_attention (training with flex needs CUDA: no flex backward on CPU)."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    import warnings
    B, H, T, D = 3, 2, 40, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    doc_ids, am = masked_rows(B, T, seed=1)
    for causal in (False, True):
        for window in (None, 4):
            want = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=detour.dense_mask(B, T, "cpu", causal, window, am, doc_ids))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # eager flex_attention is a slow reference path
                got = flex.flex_attention(q, k, v, block_mask=detour.flex_block_mask(B, T, "cpu", causal, window,
                                                                                     am, doc_ids))
            assert torch.allclose(got, want, atol=1e-5), (causal, window)


def test_flex_backend_falls_back_on_cpu():
    c = tiny_config()
    torch.manual_seed(0)
    m = detour.ModernBERT(c).eval()
    idx, am = batch(c)
    with torch.no_grad():
        want, _ = m(idx, attention_mask=am)
        m.model.attn_backend = "flex"
        with pytest.warns(UserWarning, match="using sdpa"):
            got, _ = m(idx, attention_mask=am)
    assert torch.equal(got, want)


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
    for return_logits in (True, False):
        m.zero_grad()
        logits, loss = m(idx, targets, causal=causal, return_logits=return_logits)
        loss.backward()
        results.append((logits, loss.item(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    (logits, want, grads), (none, got, chunked) = results
    assert logits.shape == ((targets != detour.IGNORE).sum(), c.vocab_size) and none is None
    assert abs(got - want) < 1e-5
    for n, g in grads.items():
        assert torch.allclose(chunked[n], g, atol=1e-6), n
    # several chunks (7 rows each, the last one short): loss and all three gradients
    h, t = torch.randn(50, c.hidden_size, requires_grad=True), torch.randint(0, c.vocab_size, (50,))
    w, b = m.decoder.weight.detach().clone().requires_grad_(), m.decoder.bias.detach().clone().requires_grad_()
    full = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w, b), t)
    want = torch.autograd.grad(full, (h, w, b))
    chunked = detour.LinearCrossEntropy.apply(h, w, b, t, 7)
    got = torch.autograd.grad(chunked, (h, w, b))
    assert torch.allclose(chunked, full, atol=1e-6)
    for g, e in zip(got, want):
        assert torch.allclose(g, e, atol=1e-6)
