"""Build a tiny random-weight Llama and its tokenizer in a folder, for serving with vLLM.

    python build_model.py DIR [--seed 0] [--vocab 3000]

No download: a byte-level BPE trained on the standard library's own sources, random weights.
Gibberish answers suffice: requests carry ``ignore_eos`` and ``max_tokens``. Runs in the vLLM venv.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

# A plain role-tagged template: vLLM's chat endpoint needs one to turn messages into a prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
MAX_TRAIN_BYTES = 8_000_000


def training_text() -> Iterator[str]:
    """Yield the standard library's .py files, up to MAX_TRAIN_BYTES in all."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(stdlib.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        total += len(text)
        yield text
        if total >= MAX_TRAIN_BYTES:
            return


def build_tokenizer(out: Path, vocab: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))
    return int(tok.get_vocab_size())


#: Positions the model takes (its context, vLLM's largest ``--max-model-len``): room for the
#: benchmark's long prompts of 1.5-3k tokens and their answers.
CONTEXT = 4096


def build_model(out: Path, vocab: int, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=CONTEXT,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="folder to write the model and tokenizer into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab", type=int, default=3000, help="BPE vocabulary size")
    args = parser.parse_args(argv)
    out: Path = args.dir
    out.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(out, args.vocab)
    build_model(out, vocab, args.seed)
    (out / "llm_backoff_model.json").write_text(
        json.dumps({"vocab": vocab, "seed": args.seed, "hidden": 256, "layers": 4, "context": CONTEXT}) + "\n"
    )
    print(f"model in {out}: vocabulary {vocab}, hidden 256, 4 layers, random weights", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
