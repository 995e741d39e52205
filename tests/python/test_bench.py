"""The GPU benchmark's bookkeeping that runs anywhere: how rounds of modes are merged."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("fsdp_vs_dcplan", ROOT / "bench/gpu/fsdp_vs_dcplan.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rounds_report_the_median_step_and_the_highest_peak():
    merge = _bench().merge_rounds
    rounds = [{"step_s": 0.080, "peak_bytes": 5, "losses": [1.0]},
              {"step_s": 0.055, "peak_bytes": 7, "losses": [2.0]},
              {"step_s": 0.060, "peak_bytes": 6, "losses": [3.0]}]
    r = merge(rounds)
    assert r["step_s"] == 0.060
    assert r["round_step_s"] == [0.080, 0.055, 0.060]
    assert r["peak_bytes"] == 7
    assert r["losses"] == [3.0]  # the rest from the last round
    assert merge(rounds[:1]) == rounds[0]  # one round: as measured
    assert merge([{}, {}]) == {}  # the bound's other ranks report nothing


def test_a_transformers_llama_is_called_as_the_example_model():
    """--model transformers: ids in, logits out; FSDP2 reaches the decoder blocks through .layers,
    which does not register them twice."""
    import pytest
    import torch

    tf = pytest.importorskip("transformers")
    config = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                            tie_word_embeddings=False, attn_implementation="sdpa")
    lm = tf.LlamaForCausalLM(config)
    model = _bench().LogitsOf(lm)
    ids = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(model(ids), lm(input_ids=ids).logits)
    assert model.layers is lm.model.layers and len(model.layers) == 2
    assert [n for n, _ in model.named_parameters()] == ["lm." + n for n, _ in lm.named_parameters()]
