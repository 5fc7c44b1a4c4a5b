"""Gemma 2, Gemma 3, OLMo 3 and Mistral with sequences past their sliding window, against
`transformers` on tiny random models (`windowed_models.py`: window 8, sequences to ~3x it): logits
on a padded batch, greedy generation through the engine, sampled logprobs against a
teacher-forced forward, export, PEFT adapters both ways, the shared-prompt forward and the 8-bit
generators."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx
from windowed_models import WINDOW, make_windowed_hf

from jaxrl.config import ConfigError, ModelConfig
from jaxrl.models import load_pretrained, save_pretrained
from jaxrl.models.attention import attention, cached_attention
from jaxrl.models.hf import config_from_hf, save_adapter

TOL = 1e-4  # f32 logits, max abs difference
T = 3 * WINDOW


def _padded_batch():
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, 96, (3, T))
    mask = np.array([[1] * T, [1] * 17 + [0] * (T - 17), [1] * 5 + [0] * (T - 5)])
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    return tokens, mask, positions


def _torch_logits(model, batch):
    tokens, mask, positions = batch
    with torch.no_grad():
        return model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                     position_ids=torch.tensor(positions)).logits.numpy()


def _ours(model, batch):
    tokens, mask, positions = map(jnp.asarray, batch)
    return np.asarray(model(tokens, positions, mask))


def _close(ours, ref, batch):
    valid = batch[1].astype(bool)
    assert np.abs(ref[valid]).max() > 1.0  # not between near-zero logits
    np.testing.assert_allclose(ours[valid], ref[valid], atol=TOL, rtol=0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """arch -> (HF model, its saved directory), built once per module."""
    out = {}
    for arch in ("gemma2", "gemma3", "olmo3", "mistral"):
        path = tmp_path_factory.mktemp(arch)
        out[arch] = (make_windowed_hf(arch, path, seed=1), path)
    return out


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "olmo3", "mistral"])
def test_logits_match_transformers_past_the_window(arch, saved):
    hf, path = saved[arch]
    cfg, model = load_pretrained(path)
    assert cfg.architecture == arch and cfg.sliding_window == WINDOW
    assert cfg.max_position_embeddings == 256  # the window no longer caps the positions
    batch = _padded_batch()
    ref = _torch_logits(hf, batch)
    _close(_ours(model, batch), ref, batch)
    # the window matters: the same weights with a window longer than the batch (the same
    # layers, rope bases) differ past the window, not within it
    full = load_pretrained(path, sliding_window=1000)[1]
    diff = np.abs(_ours(full, batch)[0] - ref[0]).max(axis=-1)
    assert diff[:WINDOW].max() < TOL and diff[WINDOW:].max() > 0.01


def test_the_layer_pattern_and_rope_bases_read_from_every_config_form():
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8)
    # Gemma 3 as the Hub's 1B config.json has it: sliding_window_pattern and legacy rope keys
    g3 = config_from_hf(dict(base, architectures=["Gemma3ForCausalLM"], sliding_window_pattern=3,
                             rope_theta=1e6, rope_local_base_freq=1e4))
    assert g3.layer_types == ("sliding_attention", "sliding_attention", "full_attention") * 2
    assert (g3.rope_theta, g3.rope_local_theta) == (1e6, 1e4) and g3.qk_norm
    assert g3.tie_embeddings and g3.query_pre_attn_scalar == 16  # Gemma's defaults
    g2 = config_from_hf(dict(base, architectures=["Gemma2ForCausalLM"],
                             final_logit_softcapping=30.0, attn_logit_softcapping=50.0))
    assert g2.layer_types == ("sliding_attention", "full_attention") * 3
    assert (g2.attn_logit_softcap, g2.final_logit_softcap, g2.rope_local_theta) == (50, 30, None)
    mistral = config_from_hf(dict(base, architectures=["MistralForCausalLM"]))
    assert mistral.layer_types == () and [mistral.layer_window(i) for i in range(6)] == [8] * 6
    with pytest.raises(Exception, match="hidden_activation 'gelu' is not supported"):
        config_from_hf(dict(base, architectures=["Gemma2ForCausalLM"], hidden_activation="gelu"))
    with pytest.raises(Exception, match="use_bidirectional_attention=true is not supported"):
        config_from_hf(dict(base, architectures=["Gemma3ForCausalLM"],
                            use_bidirectional_attention=True))
    with pytest.raises(ConfigError, match=r"layer_types must be empty or one of"):
        ModelConfig(num_layers=2, sliding_window=4, layer_types=("sliding_attention",))
    with pytest.raises(ConfigError, match="sliding_window is None"):
        ModelConfig(num_layers=1, layer_types=("sliding_attention",))


def test_window_mask_is_transformers_boundary_in_every_attention_path():
    """A query at position p sees keys at p - window + 1 .. p (transformers'
    `sliding_window_overlay`: kv_idx > q_idx - window): checked against a float64 numpy
    reference in the self-attention, the cached (decode) path and with soft-capping."""
    rng = np.random.default_rng(0)
    b, t, h, k, d, w, cap = 2, 13, 4, 2, 8, 5, 2.0
    q, kk, v = (rng.normal(size=(b, t, n, d)) for n in (h, k, k))
    qp, kp = np.arange(t)[:, None], np.arange(t)[None, :]
    allowed = (kp <= qp) & (kp > qp - w)
    assert allowed[6].tolist() == [False] * 2 + [True] * 5 + [False] * 6  # keys 2..6
    scores = np.einsum("bthd,bshd->bhts", q, np.repeat(kk, h // k, axis=2)) / np.sqrt(d)
    scores = cap * np.tanh(scores / cap)
    scores = np.where(allowed, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True),
                     np.repeat(v, h // k, axis=2))
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    got = attention(f32(q), f32(kk), f32(v), window=w, softcap=cap)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    # the last 3 queries against a cache of all 13 entries
    pos = jnp.broadcast_to(jnp.arange(t - 3, t), (b, 3))
    for heads_major in (False, True):
        kc, vc = f32(kk), f32(v)
        if heads_major:
            kc, vc = kc.transpose(0, 2, 3, 1), vc.transpose(0, 2, 1, 3)
        got = cached_attention(f32(q[:, -3:]), kc, vc, pos, jnp.full((b,), t), window=w,
                               softcap=cap, heads_major=heads_major)
        np.testing.assert_allclose(np.asarray(got), want[:, -3:], atol=1e-5)


@nnx.jit
def _forward(model, seq_1T):
    return model(seq_1T)[0]


@pytest.mark.slow
@pytest.mark.parametrize("arch,layout", [("gemma2", "contiguous"), ("gemma3", "contiguous"),
                                         ("gemma3", "paged"), ("mistral", "contiguous")])
def test_generation_past_the_window_equals_transformers(arch, layout, saved):
    """Greedy tokens equal `transformers.generate` on ragged prompts, and sampled tokens'
    behaviour logprobs equal a teacher-forced forward, the decode running to 3x the window
    (a sliding layer keeping its window only, a ring of 8 in 32 positions; paged too)."""
    from jaxrl.generate import JaxEngine, SamplingParams, sample

    hf, path = saved[arch]
    _, model = load_pretrained(path)
    engine = JaxEngine(model, num_slots=4, max_len=32, chunk_steps=4, kv_layout=layout,
                       page_size=8)
    prompts, new = [[5, 17, 3], list(range(1, 12))], 2 * WINDOW
    got = sample(engine, prompts, SamplingParams(max_tokens=new, temperature=0.0))
    for prompt, c in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                              max_new_tokens=new, do_sample=False)
        assert c.tokens == out[0, len(prompt):].tolist(), f"prompt of length {len(prompt)}"
    drawn = sample(engine, prompts, SamplingParams(max_tokens=new, temperature=1.0, seed=3))
    for prompt, c in zip(prompts, drawn, strict=True):
        seq = np.zeros((1, 32), np.int32)
        seq[0, :len(prompt) + new] = prompt + c.tokens
        logp = jax.nn.log_softmax(_forward(model, jnp.asarray(seq)), axis=-1)
        pos = np.arange(len(prompt) - 1, len(prompt) - 1 + new)
        ref = np.asarray(logp)[pos, np.asarray(c.tokens)]
        np.testing.assert_allclose(c.logprobs, ref, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("arch,layout", [("gemma2", "contiguous"), ("gemma3", "paged")])
def test_generation_to_4x_the_window_keeps_only_the_window(arch, layout, saved):
    """The engine's decode state keeps a sliding layer's window only (a ring of 8 slots, 1 page
    of 8, where a full layer keeps 48 positions), and greedy generation of 4x the window through
    it equals `transformers.generate` token for token."""
    from jaxrl.generate import JaxEngine, SamplingParams, sample

    hf, path = saved[arch]
    cfg, model = load_pretrained(path)
    engine = JaxEngine(model, num_slots=2, max_len=48, chunk_steps=8, kv_layout=layout,
                       page_size=8)
    cache = engine.init_decode_state().cache
    sliding = [i for i in range(cfg.num_layers) if cfg.layer_window(i)]
    full = [i for i in range(cfg.num_layers) if i not in sliding]
    if layout == "paged":  # pages in a layer's pool: slots x pages a slot
        pages = [cache.k_pages[i].shape[0] for i in range(cfg.num_layers)]
        assert {pages[i] for i in sliding} == {2 * 1} and {pages[i] for i in full} == {2 * 6}
    else:  # heads-major keys [B, K, D, S]
        lengths = [cache.k[i].shape[-1] for i in range(cfg.num_layers)]
        assert {lengths[i] for i in sliding} == {WINDOW} and {lengths[i] for i in full} == {48}
    prompts, new = [[5, 17, 3], list(range(1, 12))], 4 * WINDOW
    got = sample(engine, prompts, SamplingParams(max_tokens=new, temperature=0.0))
    for prompt, c in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                              max_new_tokens=new, do_sample=False)
        assert c.tokens == out[0, len(prompt):].tolist(), f"prompt of length {len(prompt)}"


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "olmo3"])
def test_export_loads_back_in_transformers_with_equal_logits(arch, saved, tmp_path):
    _, path = saved[arch]
    cfg, model = load_pretrained(path)
    save_pretrained(model, cfg, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), attn_implementation="eager").float().eval()
    assert type(back).__name__ == json.loads((path / "config.json").read_text())[
        "architectures"][0]
    assert load_pretrained(tmp_path)[0] == cfg  # and back into the same config
    batch = _padded_batch()
    _close(_ours(model, batch), _torch_logits(back, batch), batch)


def _random_adapters(model, seed):
    state = nnx.state(model)
    flat = dict(state.flat_state())
    keys = iter(jax.random.split(jax.random.key(seed), len(flat)))
    for path, var in flat.items():
        if "lora" in str(path[-1]):
            var.set_value(0.3 * jax.random.normal(next(keys), var.get_value().shape))
    nnx.update(model, state)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_peft_adapters_both_ways(arch, saved, tmp_path):
    """A PEFT adapter loads with PEFT's logits, and one jaxrl writes loads in PEFT with ours."""
    hf, path = saved[arch]
    batch = _padded_batch()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                 init_lora_weights=False))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn_like(p))
    pm.save_pretrained(str(tmp_path / "theirs"))
    ref = _torch_logits(pm.eval(), batch)
    pm.unload()  # the base model back without adapters
    cfg, model = load_pretrained(path, adapter=tmp_path / "theirs")
    assert cfg.lora.rank == 4
    _close(_ours(model, batch), ref, batch)
    _random_adapters(model, seed=1)
    save_adapter(model, tmp_path / "ours")
    back = peft.PeftModel.from_pretrained(make_windowed_hf(arch, seed=1),
                                          str(tmp_path / "ours")).eval()
    _close(_ours(model, batch), _torch_logits(back, batch), batch)


@pytest.mark.parametrize("fmt", ["int8", "w8a8"])
def test_8bit_generator_of_gemma_is_the_model_of_its_dequantized_weights(fmt, saved):
    """The int8 copy's logits are those of the f32 model holding the dequantized weights (the
    GeGLU MLP and sandwich norms around 8-bit projections); w8a8 adds the activations' rounding."""
    import copy

    from jaxrl.models import quant

    _, path = saved["gemma2"]
    _, model = load_pretrained(path)
    q_model = quant.quantized_copy(model, fmt)
    deq = copy.deepcopy(model)
    for layer, q_layer in zip(deq.layers, q_model.layers, strict=True):
        for mod, q_mod in ((layer.attn, q_layer.attn), (layer.mlp, q_layer.mlp)):
            for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj"):
                if hasattr(mod, name):
                    w = quant.dequantize(getattr(q_mod, name)[...],
                                         getattr(q_mod, f"{name}_scale")[...])
                    getattr(mod, name).set_value(w)
    batch = _padded_batch()
    valid = batch[1].astype(bool)
    got, want = _ours(q_model, batch)[valid], _ours(deq, batch)[valid]
    # w8a8: per-token int8 activations, measured ~0.05 on these logits (soft-capped at 3)
    np.testing.assert_allclose(got, want, atol=TOL if fmt == "int8" else 0.2, rtol=0)
    assert np.abs(want - _ours(model, batch)[valid]).max() > TOL  # the weights were rounded


def test_shared_prompt_logprobs_equal_the_full_forward_past_the_window(saved):
    """The shared-prompt train forward (prompts 10 and 12 tokens, windows of 8) and the chunked,
    soft-capped log-prob pass equal the plain forward's log-probs."""
    from jaxrl.train.batch import make_batch
    from jaxrl.train.logprobs import full_logprobs_reference, shared_logprobs
    from jaxrl.train.prefix import plan_prefix_layout

    _, model = load_pretrained(saved["gemma2"][1])
    rng = np.random.default_rng(0)
    rows, segs, masks, gids = [], [], [], []
    for g, p in enumerate((10, 12)):
        prompt = rng.integers(0, 96, p)
        for length in (p + 5, T, p + 9):
            rows.append(np.concatenate([prompt, rng.integers(0, 96, T - p)]))
            segs.append((np.arange(T) < length).astype(np.int32))
            masks.append(((np.arange(T) >= p) & (np.arange(T) < length)).astype(np.float32))
            gids.append(g)
    batch = make_batch(np.stack(rows), np.stack(masks), np.zeros(6), np.asarray(gids),
                       segment_ids=np.stack(segs))
    planned = plan_prefix_layout(batch, 1, min_len=8)
    assert planned is not None and planned.computed_tokens < planned.batch_tokens
    want = np.asarray(full_logprobs_reference(model, planned.batch))
    lay = jax.tree.map(np.asarray, planned.layout)
    got, _ = jax.jit(lambda m, b, l: shared_logprobs(m, b, l.whole(), chunk=8))(
        model, planned.batch, lay)
    mask = np.asarray(planned.batch.loss_mask) > 0
    np.testing.assert_allclose(np.asarray(got)[mask], want[mask], rtol=1e-5, atol=1e-5)


def test_gemma3_1b_config_and_the_planner_rows_have_the_real_shapes():
    """configs/gemma3_1b_gsm8k.py builds Gemma 3 1B's 999,885,952 parameters (its model card's
    count; jax.eval_shape, no weights), and the planner's Gemma rows count what ModelConfig
    counts for the checkpoints' shapes."""
    from pathlib import Path

    from jaxrl.config import load_config
    from jaxrl.models.model import abstract_model
    from jaxrl.planner.specs import get_model

    cfg = load_config(Path(__file__).parents[2] / "configs" / "gemma3_1b_gsm8k.py")
    model = abstract_model(cfg.model)
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == 999_885_952 == cfg.model.num_params() == get_model("gemma3-1b").total_params
    assert [i for i in range(26) if cfg.model.layer_window(i) is None] == [5, 11, 17, 23]
    assert model.layers[0].attn.k_proj.get_value().shape == (1152, 1, 256)
    gemma2_2b = ModelConfig(architecture="gemma2", vocab_size=256000, hidden_size=2304,
                            intermediate_size=9216, num_layers=26, num_heads=8, num_kv_heads=4,
                            head_dim=256)
    assert gemma2_2b.num_params() == 2_614_341_888 == get_model("gemma2-2b").total_params


def test_pallas_paths_take_the_window_and_scale(monkeypatch):
    """Under impl="pallas" the window and the score scale reach the kernels (CPU: interpreted):
    the flash prefill, the decode and the paged decode equal the XLA path's masks, and a
    Gemma 3 (windows, its own scale, no soft-cap) gives transformers' logits through them."""
    import jaxrl_kernels
    from jaxrl.models.paged import paged_attention, static_page_table

    calls = []

    def spying(name, kernel):
        def spy(*args, **kw):
            calls.append((name, kw.get("window"), kw.get("sm_scale")))
            return kernel(*args, **kw)
        return spy

    for name in ("flash_attention", "decode_attention", "paged_decode_attention"):
        monkeypatch.setattr(jaxrl_kernels, name, spying(name, getattr(jaxrl_kernels, name)))

    rng = np.random.default_rng(1)
    b, t, h, k, d, w, scale = 2, 13, 4, 2, 8, 5, 0.2
    q, kk, v = (jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.float32) for n in (h, k, k))
    want = attention(q, kk, v, window=w, scale=scale)
    got = attention(q, kk, v, window=w, scale=scale, impl="pallas")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    lengths = jnp.array([t, 9])  # row 1: the query at position 8 sees 4..8
    pos = (lengths - 1)[:, None]
    want = cached_attention(q[:, -1:], kk, v, pos, lengths, window=w, scale=scale)
    got = cached_attention(q[:, -1:], kk, v, pos, lengths, window=w, scale=scale, impl="pallas")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    page = 16  # 32 positions a row, in 2 pages (the GPU body's smallest page)
    table = static_page_table(b, 2)
    pad = jnp.zeros((b, 2 * page - t, k, d))
    k_pages, v_pages = (jnp.concatenate([x, pad], 1).reshape(b * 2, page, k, d) for x in (kk, v))
    got = paged_attention(q[:, -1:], k_pages, v_pages, table, pos, lengths, window=w,
                          scale=scale, impl="pallas")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    assert calls == [(name, w, scale) for name in ("flash_attention", "decode_attention",
                                                   "paged_decode_attention")]


def test_gemma3_through_the_pallas_flash_kernel_matches_transformers(saved):
    hf, path = saved["gemma3"]
    _, model = load_pretrained(path, attention_impl="pallas")
    batch = _padded_batch()
    _close(_ours(model, batch), _torch_logits(hf, batch), batch)


@pytest.mark.parametrize("local_theta", [100.0, 10000.0])
def test_gemma3_linear_rope_scaling_on_the_global_layers_matches_transformers(
        tmp_path, monkeypatch, local_theta):
    """Gemma 3 4B/12B/27B's `rope_scaling={"rope_type": "linear", "factor": 8.0}`: the global
    layers' positions divided by 8, the sliding layers' rope unscaled (their own base, or the
    same base: then still unscaled). Logits past the window against transformers; the legacy
    config.json keys of the real checkpoints read as the nested ones; the export loads back in
    transformers with the scaling and the same logits. Before: refused (unsupported rope_type)."""
    from jaxrl.models import transformer
    from jaxrl.models.safetensors_io import CheckpointError

    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}}
    hf = make_windowed_hf("gemma3", tmp_path / "hf", seed=3, rope_parameters=rope)
    batch = _padded_batch()
    ref = _torch_logits(hf, batch)
    cfg, model = load_pretrained(tmp_path / "hf")
    assert (cfg.rope_scaling.rope_type, cfg.rope_scaling.factor) == ("linear", 8.0)
    _close(_ours(model, batch), ref, batch)

    def off_by(other_cfg):  # the same weights under another rope reading
        graphdef, _ = nnx.split(nnx.eval_shape(
            lambda: transformer.Transformer(other_cfg, rngs=nnx.Rngs(0))))
        other = nnx.merge(graphdef, nnx.state(model))
        return np.abs(_ours(other, batch) - ref)[batch[1].astype(bool)].max()

    assert off_by(dataclasses.replace(cfg, rope_scaling=None)) > 100 * TOL  # the scaling matters
    if local_theta == 10000.0:  # one base: scaling the sliding layers too would be wrong
        monkeypatch.setattr(transformer, "_SCALED_FULL_LAYERS_ONLY", ())
        assert off_by(cfg) > 100 * TOL
        monkeypatch.undo()
    # the legacy keys of google/gemma-3-4b-it's text config give the same model config
    legacy = json.loads((tmp_path / "hf" / "config.json").read_text())
    legacy.pop("rope_parameters")
    legacy.update(rope_theta=10000.0, rope_local_base_freq=local_theta,
                  rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert config_from_hf(legacy) == cfg
    with pytest.raises(CheckpointError, match="rope_type 'yarn'.*llama3, linear"):
        config_from_hf({**legacy, "rope_scaling": {"rope_type": "yarn", "factor": 8.0}})
    # export: transformers reads the scaling back and gives the same logits
    save_pretrained(model, cfg, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
    full = back.config.rope_parameters["full_attention"]
    assert (full["rope_type"], full["factor"]) == ("linear", 8.0)
    assert back.config.rope_parameters["sliding_attention"]["rope_type"] == "default"
    _close(_torch_logits(back, batch), ref, batch)


def test_gemma2_soft_cap_runs_in_the_pallas_kernels(saved, monkeypatch):
    """Gemma 2 (attention soft-cap 5, windows, its own scale) under impl="pallas": the flash
    prefill, the decode and the paged decode kernels are called with the cap (CPU: interpreted),
    the logits on a padded batch equal transformers', and greedy generation past the window
    through the kernels (contiguous and paged caches) equals `transformers.generate`, its
    logprobs a teacher-forced forward of the XLA model."""
    import jaxrl_kernels
    from jaxrl.generate import JaxEngine, SamplingParams, sample

    caps = {}

    def spying(name, kernel):
        def spy(*args, **kw):
            caps.setdefault(name, set()).add(kw.get("softcap"))
            return kernel(*args, **kw)
        return spy

    for name in ("flash_attention", "decode_attention", "paged_decode_attention"):
        monkeypatch.setattr(jaxrl_kernels, name, spying(name, getattr(jaxrl_kernels, name)))
    hf, path = saved["gemma2"]
    cfg, model = load_pretrained(path, attention_impl="pallas")
    xla = load_pretrained(path)[1]
    assert cfg.attn_logit_softcap == 5.0
    batch = _padded_batch()
    _close(_ours(model, batch), _torch_logits(hf, batch), batch)
    assert caps == {"flash_attention": {5.0}}
    prompts, new = [[5, 17, 3], list(range(1, 12))], WINDOW + 4
    want = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                              max_new_tokens=new, do_sample=False)
        want.append(out[0, len(prompt):].tolist())
    for layout in ("contiguous", "paged"):
        engine = JaxEngine(model, num_slots=2, max_len=32, chunk_steps=4, kv_layout=layout,
                           page_size=16)  # the GPU body's smallest page
        got = sample(engine, prompts, SamplingParams(max_tokens=new, temperature=0.0))
        assert [c.tokens for c in got] == want, layout
        for prompt, c in zip(prompts, got, strict=True):
            seq = jnp.asarray([prompt + c.tokens], jnp.int32)
            logp = np.asarray(jax.nn.log_softmax(_forward(xla, seq), axis=-1))
            pos = np.arange(len(prompt) - 1, len(prompt) - 1 + new)
            np.testing.assert_allclose(c.logprobs, logp[pos, c.tokens], atol=1e-4, rtol=0)
    assert caps == {name: {5.0} for name in ("flash_attention", "decode_attention",
                                              "paged_decode_attention")}
