#!/usr/bin/env python3
"""Writes a tiny random-weight llama GGUF for running llama-server in tests.

The weights are random, so the text is nonsense, but the server does everything a real one
does with it: tokenizes the ChatML prompt, caches the prefix in its slots, streams tokens and
reports usage and timings. The vocabulary holds the bytes (so any text tokenizes), the ChatML
control tokens, and whole words, so token counts stay near those of a real model.

usage: tiny_gguf.py OUT.gguf [--layers N] [--words FILE]...
"""

import argparse
import re

import gguf
import numpy as np

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    "{{ '\n<tool_call>' + call['function']['name'] + ' ' + call['function']['arguments'] + '</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Words of English prose, code and shell output, the text agent traces are made of.
BUILTIN_WORDS = """
the of and to in is that for it as with was on be by this are or from at an not have
you your we our they their he she his her its can will would should could may must
if then else return fn def class import from use let mut pub struct enum impl trait self
true false none null error errors test tests file files line lines path src lib main
function method value values type types string int list dict map key keys data result
run running make build fix bug issue patch diff commit branch git cd ls cat grep sed
find echo python cargo npm pip install exit status output input read write open close
user assistant system tool tools call calls bash command arguments content message
please now next step first last all any some more less new old add remove update change
check look see show use using used need needs want work works done do does did get set
""".split()

SPECIAL = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def vocabulary(word_files):
    """Word pieces with every prefix of each: llama.cpp's SPM tokenizer builds a word by
    merging adjacent pieces, so a word is one token only if each step on the way is one."""
    words = list(BUILTIN_WORDS)
    for path in word_files:
        with open(path, encoding="utf-8", errors="replace") as f:
            words.extend(re.findall(r"[A-Za-z_][A-Za-z0-9_]{1,15}", f.read()))
    seen, out = set(), []
    for w in words:
        for piece in ("\u2581" + w, w):
            for end in range(1, len(piece) + 1):
                prefix = piece[:end]
                if prefix not in seen:
                    seen.add(prefix)
                    out.append(prefix)
        if len(out) >= 30000:
            break
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--words", action="append", default=[])
    ap.add_argument("--context", type=int, default=32768)
    args = ap.parse_args()

    tokens, scores, types = [], [], []
    for i, t in enumerate(SPECIAL):
        tokens.append(t)
        scores.append(0.0)
        types.append(gguf.TokenType.UNKNOWN if i == 0 else gguf.TokenType.CONTROL)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        scores.append(0.0)
        types.append(gguf.TokenType.BYTE)
    for w in vocabulary(args.words):
        tokens.append(w)
        scores.append(float(len(w)))
        types.append(gguf.TokenType.NORMAL)
    n_vocab = len(tokens)

    n_embd, n_head, n_head_kv, n_ff = 64, 4, 2, 128
    head_dim = n_embd // n_head
    rng = np.random.default_rng(20261203)

    def weights(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    w = gguf.GGUFWriter(args.out, "llama")
    w.add_name("agentrace tiny random llama")
    w.add_context_length(args.context)
    w.add_embedding_length(n_embd)
    w.add_block_count(args.layers)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(SPECIAL.index("<|im_end|>"))
    w.add_unk_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)

    w.add_tensor("token_embd.weight", weights(n_vocab, n_embd))
    for i in range(args.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "attn_q.weight", weights(n_embd, n_embd))
        w.add_tensor(p + "attn_k.weight", weights(n_head_kv * head_dim, n_embd))
        w.add_tensor(p + "attn_v.weight", weights(n_head_kv * head_dim, n_embd))
        w.add_tensor(p + "attn_output.weight", weights(n_embd, n_embd))
        w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(p + "ffn_gate.weight", weights(n_ff, n_embd))
        w.add_tensor(p + "ffn_up.weight", weights(n_ff, n_embd))
        w.add_tensor(p + "ffn_down.weight", weights(n_embd, n_ff))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("output.weight", weights(n_vocab, n_embd))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{args.out}: llama, {args.layers} layers, {n_vocab} tokens")


if __name__ == "__main__":
    main()
