"""The conformance suite: every architecture users pick, served exactly by sampling.py.

For each architecture, a tiny random model built from its config class (fp32, CPU, a second
or so each) is checked through the project's own functions against transformers itself:
- greedy `sampling.generate` == HF `generate`, token for token, on left-padded prompts of
  different lengths;
- `sampling.completion_logprobs` == log_softmax(model(prompt + completion).logits), one
  completion per prompt and k > 1 (the shared-prefix path), with and without gradient
  checkpointing, and in bf16 within bf16 tolerance. The configs set post-head logit transforms
  large enough to matter (Gemma's softcap, Cohere's logit_scale, Granite's logits_scaling);
- a stop token listed only in `generation_config.eos_token_id` ends the completion, and the
  row is not flagged truncated;
- reward-model scores with chosen and rejected sharing their prompt's pass
  (`sampling.completion_scores`, what reward.py trains on) == the score read on prompt +
  completion in one sequence, and a reward model grown by `reward.expand_layers` scores exactly
  as before (architectures whose layers have o_proj and down_proj; the others are refused);
- the load-time check (`sampling.check_logits`) accepts the model, and refuses one whose
  forward transforms its logits in a way the project does not reproduce.
"""

import copy
import functools

import pytest
import torch
import transformers

import common
from rlhf import data
from rlhf import sampling
from worlds import world

PROMPTS = ["POST: alice bought the bike .\nTL;DR:",
           "POST: i think bob lost the red phone . we had a lot of fun . nobody knows why .\nTL;DR:",
           "POST: carol fixed the lamp at the park .\nTL;DR:"]
COMPLETIONS = [" alice bought bike .", " bob lost phone . nobody knows", " carol .", " carol fixed lamp . the"]

# architecture -> (config class, model class, config overrides): tiny, with transforms that bite
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 6}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "final_logit_softcapping": 2.0,
                                                     "attn_logit_softcapping": 5.0, "sliding_window": 6}),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "final_logit_softcapping": 2.0,
                                                              "sliding_window": 6}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 4.0}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 0.25}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {"rotary_pct": 0.5}),
    # learned absolute positions: shifting a left-padded row's positions changes its numbers
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", {"n_inner": 128, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
}


@functools.cache
def tokenizer():
    return world.build_tokenizer()


@functools.cache
def build(arch):
    """The tiny fp32 model of this architecture, built once per module (tests copy it to change it)."""
    config_name, model_name, overrides = ARCHITECTURES[arch]
    tok = tokenizer()
    config = getattr(transformers, config_name)(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, bos_token_id=None, **overrides)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # larger weights than the init's 0.02 std: logits far enough apart to tell paths apart
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
    return model


def prompts():
    return data.encode_prompts(tokenizer(), PROMPTS)  # (3, P) left-padded, lengths differ


def naive_logprobs(model, p_ids, p_mask, c_ids, c_mask):
    """log_softmax of the model's own logits (its forward, transforms included): (B, C)."""
    ids, mask = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=sampling.position_ids(mask)).logits
    logp = torch.log_softmax(logits[:, p_ids.shape[1] - 1:-1].float(), -1)
    return logp.gather(-1, c_ids[..., None]).squeeze(-1) * c_mask


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_generate_matches_hf(arch):
    model, tok = build(arch), tokenizer()
    ids, mask = prompts()
    c, cm, truncated = sampling.generate(model, tok, ids, mask, max_new_tokens=10, do_sample=False)
    hf = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=10,
                        pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    hf = torch.nn.functional.pad(hf, (0, max(0, c.shape[1] - hf.shape[1])), value=tok.pad_token_id)
    assert torch.equal(c, hf[:, :c.shape[1]].masked_fill(cm == 0, tok.pad_token_id))
    assert truncated.tolist() == [tok.eos_token_id not in row for row in hf.tolist()]


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logprobs_match_the_forward(arch, checkpointing, k):
    model, tok = build(arch), tokenizer()
    if checkpointing:
        model = copy.deepcopy(model)
        common.enable_checkpointing(model)
        model.train()  # checkpointing only acts in training mode (no dropout in these configs)
    p_ids, p_mask = prompts()
    c_ids, c_mask = data.encode_completions(tok, (COMPLETIONS * 2)[:3 * k])  # row i continues prompt i // k
    lp = sampling.completion_logprobs(model, p_ids, p_mask, c_ids, c_mask)
    ref = naive_logprobs(model, p_ids.repeat_interleave(k, 0), p_mask.repeat_interleave(k, 0), c_ids, c_mask)
    torch.testing.assert_close(lp, ref, atol=1e-4, rtol=0)
    assert lp.requires_grad


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logprobs_match_the_forward_in_bf16(arch):
    model, tok = copy.deepcopy(build(arch)).to(torch.bfloat16), tokenizer()
    p_ids, p_mask = prompts()
    c_ids, c_mask = data.encode_completions(tok, COMPLETIONS[:3] * 2)
    with torch.no_grad():
        lp = sampling.completion_logprobs(model, p_ids, p_mask, c_ids, c_mask)
        ref = naive_logprobs(model, p_ids.repeat_interleave(2, 0), p_mask.repeat_interleave(2, 0), c_ids, c_mask)
        exact = naive_logprobs(build(arch), p_ids.repeat_interleave(2, 0), p_mask.repeat_interleave(2, 0), c_ids, c_mask)
    # bf16 keeps 8 bits of mantissa: ours lands about as far from fp32 as the plain bf16 forward does
    # (a few hundredths of a nat; Granite's and Cohere's multipliers make it a tenth or two); a missing
    # logit transform is off by nats
    naive_error = float((ref - exact).abs().max())
    torch.testing.assert_close(lp, exact, atol=max(0.05, 1.5 * naive_error), rtol=0)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_reward_scores_share_the_prompt_and_survive_expansion(arch):
    import reward

    config_name, model_name, _ = ARCHITECTURES[arch]
    classifier = model_name.replace("ForCausalLM", "ForSequenceClassification").replace("LMHeadModel", "ForSequenceClassification")
    cls = getattr(transformers, classifier, None)
    if cls is None:
        pytest.skip(f"transformers has no {classifier}")
    config = copy.deepcopy(build(arch).config)
    config.num_labels = 1
    torch.manual_seed(0)
    model = cls(config).eval()
    model.load_state_dict(build(arch).state_dict(), strict=False)  # the trunk's weights; a fresh head
    p_ids, p_mask = prompts()
    c_ids, c_mask = data.encode_completions(tokenizer(), COMPLETIONS[:3] * 2)
    c_ids, c_mask = c_ids[[0, 3, 1, 4, 2, 5]], c_mask[[0, 3, 1, 4, 2, 5]]  # rows 2i, 2i+1 continue prompt i
    whole_ids = torch.cat([p_ids.repeat_interleave(2, 0), c_ids], 1)
    whole_mask = torch.cat([p_mask.repeat_interleave(2, 0), c_mask], 1)
    with torch.no_grad():
        shared = sampling.completion_scores(model, p_ids, p_mask, c_ids, c_mask)  # (6,)
        alone = sampling.sequence_scores(model, whole_ids, whole_mask)
        torch.testing.assert_close(shared, alone, atol=1e-4, rtol=0)
        layers = getattr(sampling.backbone(model), "layers", None) or sampling.backbone(model).h
        if not hasattr(layers[-1], "mlp") or not hasattr(layers[-1].mlp, "down_proj"):
            with pytest.raises(SystemExit, match="--expand_layers"):
                reward.expand_layers(model, 1)
            return
        reward.expand_layers(model, 1)
        assert len(layers) == model.config.num_hidden_layers == 3
        torch.testing.assert_close(sampling.completion_scores(model, p_ids, p_mask, c_ids, c_mask), shared, atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_generation_config_stop_token_ends_the_completion(arch):
    model, tok = copy.deepcopy(build(arch)), tokenizer()
    ids, mask = prompts()
    c, _, _ = sampling.generate(model, tok, ids, mask, max_new_tokens=6, do_sample=False)
    stop = next(t for t in c[0].tolist() if t != tok.eos_token_id)  # row 0's first token that is not EOS
    model.generation_config.eos_token_id = [tok.eos_token_id, stop]
    assert sampling.stop_token_ids(model, tok) == sorted({tok.eos_token_id, stop})
    c, cm, truncated = sampling.generate(model, tok, ids, mask, max_new_tokens=6, do_sample=False)
    n = int(cm[0].sum())
    assert c[0, n - 1] == stop and stop not in c[0, :n - 1].tolist() and not truncated[0]
    hf = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=6,
                        pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]  # HF stops at the same token
    assert c[0, :n].tolist() == hf[0, :n].tolist()
    assert sampling.decode_completions(tok, c, cm, truncated)[0] == tok.decode(c[0, :n - 1].tolist(), skip_special_tokens=True)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_load_check_accepts_it(arch):
    sampling.check_logits(build(arch))


def test_the_load_check_refuses_an_unknown_logit_transform():
    class Scaled(transformers.LlamaForCausalLM):  # an architecture whose forward rescales its logits
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 3
            return out

    model = Scaled(build("llama").config).eval()
    with pytest.raises(SystemExit, match="Scaled is not supported: its forward transforms"):
        sampling.check_logits(model)


def test_load_model_serves_an_architecture_without_sdpa(tmp_path):
    """Gemma-2 has no SDPA path in transformers: --attn_implementation auto lets transformers
    pick eager for it, and the load-time logits check passes with its softcap."""
    from types import SimpleNamespace

    build("gemma2").save_pretrained(tmp_path)
    model = common.load_model(str(tmp_path), SimpleNamespace(dtype="auto", attn_implementation="auto",
                                                             trust_remote_code=False))
    assert model.config._attn_implementation == "eager" and model.config.final_logit_softcapping == 2.0
