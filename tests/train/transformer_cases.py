"""Rank workers of the transformers tests: LlamaForCausalLM, GPT2LMHeadModel (tied embeddings)
and a Llama with tied embeddings, built from small configs (random init, no download), trained
sharded against one process; greedy generate() between steps; save_pretrained of the gathered
full state dict, loaded back with from_pretrained."""
from __future__ import annotations

import os
from typing import Dict, List

import torch

from train_harness import run_cases, step

STEPS = 4
BATCH, SEQ, VOCAB = 4, 8, 61
LR = 0.05
MODELS = ["llama", "gpt2", "llama-tied"]


def make(kind: str):
    import transformers as tf

    torch.manual_seed(11)
    if kind.startswith("llama"):
        config = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                tie_word_embeddings=kind == "llama-tied", attn_implementation="sdpa")
        return tf.LlamaForCausalLM(config)
    config = tf.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=24, n_layer=2, n_head=4, resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")
    return tf.GPT2LMHeadModel(config)


def optimizer(params):
    """SGD with momentum, not AdamW: GPT-2's fused qkv bias holds the key bias, whose gradient is
    zero in exact arithmetic (softmax ignores a per-row constant); AdamW divides its rounding
    noise by its own size, which makes two summation orders differ by about lr per step there.
    AdamW's equivalence is covered by the tiny transformer's matrix (tests/python)."""
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def data():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(STEPS)]


def generate(model, prompt):
    model.eval()
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    model.train()
    return out


def reference(kind: str, compiled: bool = False) -> Dict:
    """compiled: the model under torch.compile, and no generate() (its every length would compile)."""
    torch._dynamo.reset()
    model = make(kind)
    run = torch.compile(model) if compiled else model
    opt = optimizer(model.parameters())
    losses, generated = [], []
    for ids in data():
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if not compiled:
            generated.append(generate(model, ids[:1, :3]))
    return {"losses": losses, "generated": generated, "tied": _tied(model),
            "params": {k: v.detach().clone() for k, v in model.named_parameters()}}


def _tied(model) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def sharded(kind: str, stage: int, rank: int, ws: int, out_dir: str, compiled: bool = False) -> Dict:
    """compiled: dcplan.shard(compile=True); losses and parameters only (as reference)."""
    import dcplan

    torch._dynamo.reset()
    model = make(kind)
    tied = _tied(model)
    dcplan.shard(model, stage=stage, reduce_bucket_bytes=4096, compile=compiled)
    opt = optimizer(model.parameters())
    per = BATCH // ws
    losses, generated = [], []
    for ids in data():
        mine = ids[rank * per:(rank + 1) * per]
        loss = model(input_ids=mine, labels=mine).loss
        losses.append(step(loss, opt, ws))
        if not compiled:
            generated.append(generate(model, ids[:1, :3]))  # every rank the same prompt: the same tokens
    if compiled:
        return {"losses": losses, "tied": tied, "params": dcplan.full_parameters(model)}
    full = dcplan.get_model_state_dict(model, options=dcplan.StateDictOptions(full_state_dict=True,
                                                                              cpu_offload=True))
    reloaded = None
    if rank == 0:
        import transformers as tf

        path = os.path.join(out_dir, f"{kind}-zero{stage}")
        model.save_pretrained(path, state_dict=full)
        back = tf.AutoModelForCausalLM.from_pretrained(path)
        reloaded = {k: v.detach().clone() for k, v in back.named_parameters()}
        reloaded_tied = _tied(back)
    return {"losses": losses, "generated": generated, "tied": tied, "params": dcplan.full_parameters(model),
            "reloaded": reloaded, "reloaded_tied": reloaded_tied if rank == 0 else None}


def case_name(kind: str, stage: int, compiled: bool = False) -> str:
    return f"{kind}-zero{stage}" + ("-compiled" if compiled else "")


def worker(rank: int, ws: int, store: str, out_dir: str, cases: List[tuple]) -> None:
    """cases: (kind, stage) or (kind, stage, compiled)."""
    run_cases(rank, ws, store, out_dir,
              [(case_name(*c), lambda c=c: sharded(c[0], c[1], rank, ws, out_dir, *c[2:]),
                lambda c=c: reference(c[0], *c[2:])) for c in cases])
