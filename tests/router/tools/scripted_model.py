"""A checkpoint whose greedy output is a script: for the tool-call tests
through real pods (a random model never writes a tool call by itself).

Built from the tiny model, with two changes that keep it an ordinary
Llama checkpoint served by the unchanged engine:

* its tokenizer gains (non-special) added tokens: each chain's trigger (the
  chat template's generation prompt, e.g. `<|im_start|>assistant\\n`) and
  each piece of the scripted reply, every piece a token of its own;
* its weights make next-token prediction a fixed permutation of the
  vocabulary: every attention and MLP output projection is zero, so the
  residual stream stays the input embedding; the embeddings are random unit
  vectors E[t]; the final norm is 1; and lm_head row `next(t)` is E[t]
  (scaled), so greedy decoding after token t picks next(t) by a wide margin
  (E[t]·E[t] = 1 against random dot products of ~0.1). `next` walks each
  chain trigger -> piece 1 -> ... -> last piece -> an EOS token (one per chain).

So after a prompt that ends with a trigger, the model writes that chain's
pieces and stops, through the real tokenizer, pods, sampler and
detokenizer: the streamed text arrives token by token, as from any model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import tokenizers
import torch
from safetensors.torch import load_file, save_file


def make_scripted_model(base_dir: Path, out_dir: Path, chains: dict[str, list[str]], *,
                        chat_template: str, seed: int = 0) -> Path:
    """`chains`: trigger text -> the reply's pieces. Writes a checkpoint to `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = tokenizers.Tokenizer.from_file(str(base_dir / "tokenizer.json"))
    texts = [t for trigger, pieces in chains.items() for t in (trigger, *pieces)]
    if len(set(texts)) != len(texts):
        raise ValueError("every trigger and piece must be distinct (one token each)")
    tok.add_tokens([tokenizers.AddedToken(t, normalized=False, special=False) for t in texts])
    tok.save(str(out_dir / "tokenizer.json"))
    vocab_size = tok.get_vocab_size(with_added_tokens=True)

    config = json.loads((base_dir / "config.json").read_text())
    config["vocab_size"] = vocab_size
    eos_ids = config["eos_token_id"]
    eos_ids = eos_ids if isinstance(eos_ids, list) else [eos_ids]
    if len(chains) > len(eos_ids):
        # each chain ends on its own EOS, so `next` stays a permutation
        raise ValueError(f"at most {len(eos_ids)} chains (one per EOS token), got {len(chains)}")
    (out_dir / "config.json").write_text(json.dumps(config))
    for name in ("generation_config.json",):
        shutil.copy(base_dir / name, out_dir / name)
    tok_config = json.loads((base_dir / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config))

    successor: dict[int, int] = {}
    for (trigger, pieces), eos in zip(chains.items(), eos_ids, strict=False):
        ids = [tok.token_to_id(t) for t in (trigger, *pieces)] + [eos]
        successor.update(zip(ids[:-1], ids[1:], strict=True))
    # complete it to a permutation, so every lm_head row is some E[t]
    free_targets = iter(sorted(set(range(vocab_size)) - set(successor.values())))
    for token in range(vocab_size):
        if token not in successor:
            successor[token] = next(free_targets)

    weights = load_file(str(base_dir / "model.safetensors"))
    hidden = weights["model.embed_tokens.weight"].shape[1]
    generator = torch.Generator().manual_seed(seed)
    embed = torch.randn(vocab_size, hidden, generator=generator)
    embed /= embed.norm(dim=1, keepdim=True)
    lm_head = torch.empty_like(embed)
    lm_head[torch.tensor(list(successor.values()))] = 20.0 * embed[torch.tensor(list(successor))]
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = lm_head
    weights["model.norm.weight"] = torch.ones(hidden)
    for name, tensor in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(tensor)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out_dir / "model.safetensors"))
    return out_dir
