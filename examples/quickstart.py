"""kvlab in one page: compress a context, answer a question from it, print the bytes kept.

    python examples/quickstart.py      # SmolLM2-135M-Instruct, offline (installed by make setup)

A pass key hidden in ~700 tokens of text is compressed before the question is seen (as
kvpress's RULER benchmark does), then the question is asked: with the full cache, a PN-Mix
2-bit cache, and KVzip eviction composed with PN-Mix. Last, a PN-Mix cache in `generate`.
"""

import torch

import kvlab
from kvlab.data import default_text

loaded = kvlab.load_model("smollm2-135m")  # model + tokenizer, no download
model, tokenizer = loaded.model, loaded.tokenizer

verses = default_text().data.decode().splitlines()[:12]  # the package's public-domain text
filler = " ".join(verse.split(" ", 2)[2] for verse in verses) + " "  # without "Genesis 1:1"
question = "What is the pass key?"
chat = [{"role": "user", "content": filler + "The pass key is 71432. " + filler + question}]
text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
context, tail = text.split(question)
context_ids = tokenizer(context, return_tensors="pt", add_special_tokens=False).input_ids
question_ids = tokenizer(question + tail, return_tensors="pt", add_special_tokens=False).input_ids

full_bytes = None
for name in ["full", "pn-mix", "evict-no-relay:kvzip@0.5+pn-mix-lean"]:  # `kvlab methods`
    method = kvlab.parse_method(name)
    prepared = kvlab.prepare(method, loaded)  # a calibration where the method has one, cached
    compressed = kvlab.compress_context(model, context_ids, method, prepared=prepared)
    reply = kvlab.answer(model, compressed, question_ids, max_new_tokens=10)
    kv_bytes = compressed.storage.kv_bytes_16bit  # at 16 bits per float; codes as stored
    full_bytes = full_bytes or kv_bytes
    answer = tokenizer.decode(reply.tokens, skip_special_tokens=True).strip()
    print(f"{name:38s} {kv_bytes:>10,} bytes ({kv_bytes / full_bytes:.3f})  {answer!r}")

kvlab.enable_kvlab_attention(model)  # the attention that reads kvlab's caches in any forward
cache = kvlab.PNMixModelCache(model.config, kvlab.PNMixConfig(group_tokens=32))
ids = torch.cat([context_ids, question_ids], dim=1)
with torch.no_grad():
    out = model.generate(ids, cache=cache, max_new_tokens=10, do_sample=False)
print("generate:", tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip())
print(f"its cache: {cache.storage().kv_bytes:,} bytes for {cache.get_seq_length()} tokens")
