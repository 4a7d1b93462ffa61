# SPDX-License-Identifier: Apache-2.0
"""Build a small random-weight Llama model and tokenizer on this machine.

No model hub is needed: the tokenizer is a byte-level BPE trained with the
``tokenizers`` library on a built-in English corpus, the model is a
``transformers`` ``LlamaForCausalLM`` with random weights from a fixed seed.
Both are written with ``save_pretrained`` (weights as safetensors) so that
vLLM loads the directory like any downloaded model.

Variants:

* ``tiny``: hidden 128, 2 layers, 4 query heads / 2 KV heads of head_dim 32,
  MLP 256, 4096 positions. Loads in vLLM CPU with tensor_parallel_size=2.
* ``wide``: "wide but light": hidden 8192, 1 layer, 2 query / 2 KV heads of
  head_dim 64, MLP 64, 16384 positions. Prefill compute is small next to the
  size of the prompt embeds (fp32: 32 KiB per token, 256 MiB per 8192 tokens).

vLLM's CPU attention supports head sizes 32, 64, 80, ... only, hence head_dim
32 (tiny) and 64 (wide). Everything is float32.

Usage::

    python tools/make_tiny_model.py --out .models/tiny [--variant tiny|wide] [--seed 0]

Re-running with the same variant and seed on a complete directory exits at
once; the model is built in a temporary sibling directory and renamed into
place, so an interrupted run never leaves a half-written model behind.
"""

import argparse
import json
import os
import random
import shutil
import sys
import time

MARKER = "shm_embeds_model.json"  # written last; names variant and seed

VARIANTS = {
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        max_position_embeddings=4096,
    ),
    "wide": dict(
        hidden_size=8192,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=64,
        max_position_embeddings=16384,
    ),
}

BPE_VOCAB_SIZE = 1024  # target; the trainer stops early if the corpus is small
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

CORPUS_SENTENCES = """\
The morning train left the station a little after seven, carrying workers into the city.
She opened the window and listened to the rain falling on the garden below.
Every small town has a story that the older people like to tell at dinner.
The engineer checked the numbers twice before she wrote them in the report.
A quiet river runs through the valley, past farms, mills and old stone bridges.
He said the meeting would start at noon, but nobody arrived until half past one.
Children were playing in the street while their parents talked about the weather.
The library keeps thousands of books, maps and letters from the last three centuries.
Good software is written slowly, tested carefully and changed with great respect.
When the wind turned cold, the birds flew south over the hills and the sea.
They built a small house near the forest and planted apples, beans and potatoes.
The teacher asked the class to read the first chapter and answer five questions.
Our team measured how long each request took and drew the results on a chart.
The doctor told him to drink more water, sleep longer and walk every afternoon.
Music drifted from an open door, and people stopped to listen for a moment.
The market was full of fresh bread, bright flowers, honey, cheese and fish.
At night the city lights made the sky look orange instead of black.
Please send the documents before Friday so that we can review them next week.
The old captain remembered every storm he had seen during forty years at sea.
Scientists study the stars to learn how the universe began and how it may end.
A good question is often more useful than a quick answer.
The kitchen smelled of coffee, warm butter and fresh oranges.
Most people agree that history is easier to understand when it is told as a story.
The road climbed through the mountains, and the air became thin and clear.
If the machine stops working, turn it off, wait a minute and start it again.
He wrote a long letter to his brother, who lived in a country far away.
The price of tea, sugar and salt went up again this year.
We walked along the beach until the sun disappeared behind the island.
Her first company made shoes; her second one made tools for farmers.
The students asked why the sky is blue and why the grass is green.
Numbers like one, two, three, ten, hundred and thousand appear in every language.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday make a week.
January is cold, April is wet, July is hot and October is golden.
Red, orange, yellow, green, blue and violet are the colours of the rainbow.
The committee will decide whether the new bridge should be built of steel or wood.
Reading, writing and counting were the first things taught in the village school.
"""


def corpus_lines(seed):
    """Return the training corpus: the sentences above plus shuffled variants.

    The shuffled word sequences give the BPE trainer enough repeated pairs to
    learn whole-word tokens; ``seed`` fixes the shuffle.
    """
    sentences = [s for s in CORPUS_SENTENCES.splitlines() if s.strip()]
    words = " ".join(sentences).split()
    rng = random.Random(seed)
    lines = list(sentences) * 4
    for _ in range(2000):
        lines.append(" ".join(rng.choice(words) for _ in range(12)))
    return lines


def build_tokenizer(seed):
    """Train a byte-level BPE and wrap it for ``transformers``.

    Returns a ``PreTrainedTokenizerFast`` that prepends ``<s>`` when encoding
    with special tokens and carries a small chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(seed), trainer=trainer)
    bos_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(variant, vocab_size, bos_id, eos_id, seed):
    """Return a random-weight float32 ``LlamaForCausalLM`` for ``variant``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        tie_word_embeddings=False,
        dtype="float32",
        **VARIANTS[variant],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    return model.eval()


def is_complete(out, variant, seed):
    """True if ``out`` already holds a finished model of this variant and seed."""
    try:
        with open(os.path.join(out, MARKER)) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    needed = ["config.json", "tokenizer.json", "tokenizer_config.json"]
    has_weights = any(n.endswith(".safetensors") for n in os.listdir(out))
    return (
        meta.get("variant") == variant
        and meta.get("seed") == seed
        and has_weights
        and all(os.path.exists(os.path.join(out, n)) for n in needed)
    )


def main(argv=None):
    """CLI entry point; returns a process exit code."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--variant", choices=sorted(VARIANTS), default="tiny")
    p.add_argument("--seed", type=int, default=0, help="weights/corpus seed")
    args = p.parse_args(argv)
    out = os.path.abspath(args.out)

    if is_complete(out, args.variant, args.seed):
        print(f"{out}: {args.variant} model (seed {args.seed}) already complete")
        return 0
    if os.path.isdir(out) and os.listdir(out) and not os.path.exists(os.path.join(out, MARKER)):
        print(f"{out} exists and was not made by this tool; refusing to replace it",
              file=sys.stderr)
        return 2

    t0 = time.monotonic()
    tokenizer = build_tokenizer(args.seed)
    model = build_model(args.variant, len(tokenizer), tokenizer.bos_token_id,
                        tokenizer.eos_token_id, args.seed)

    tmp = f"{out}.tmp-{os.getpid()}"
    os.makedirs(tmp)
    try:
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp, safe_serialization=True)
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump({"variant": args.variant, "seed": args.seed}, f)
        if os.path.isdir(out):
            shutil.rmtree(out)  # ours (marker present) or empty
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    n_params = sum(t.numel() for t in model.parameters())
    print(f"{out}: built {args.variant} model, vocab {len(tokenizer)}, "
          f"{n_params / 1e6:.1f} M params, {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
