"""A tiny model folder for trainer tests: a byte-level BPE tokenizer with a ChatML template and a
random Llama-family decoder sized to its vocabulary, saved in Hugging Face layout."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The same template with each assistant turn (its end-of-turn token included) in a {% generation %} block.
CHAT_TEMPLATE_GENERATION = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "the cat sat on the mat", "a dog ran in the park", "what is two plus three", "five", "hello there",
    "the answer is seven", "user assistant system", "red green blue yellow", "one two three four five six",
]


def build_tokenizer(folder: Path, specials: list[str] = SPECIALS, chat_template: str = CHAT_TEMPLATE,
                    eos_token: str = "<|im_end|>", pad_token: str | None = "<|pad|>",
                    added_tokens: tuple[str, ...] = ()) -> None:
    """A byte-level BPE trained on CORPUS whose first ids are `specials`, then `added_tokens` (plain added
    tokens), with the template and end and pad tokens given (the defaults: the tiny ChatML model's)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    if added_tokens:
        tok.add_tokens(list(added_tokens))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos_token, "chat_template": chat_template,
              "clean_up_tokenization_spaces": False}
    if pad_token is not None:
        config["pad_token"] = pad_token
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def build_model_dir(folder: Path, seed: int = 0, tied: bool = True, max_position_embeddings: int = 256,
                    hidden_size: int = 64, intermediate_size: int = 96, num_attention_heads: int = 4,
                    std: float = 0.02, tokenizer: Callable[[Path], None] | None = None, **config: object) -> Path:
    """Tokenizer + a random 2-layer decoder (HF-style init: normal(0, std), norms at 1); `config`:
    config.json fields over the Llama defaults (another architecture's, e.g. a mixture of experts);
    `tokenizer` writes another tokenizer into the folder than `build_tokenizer`'s."""
    import torch

    from pagedrl.model.checkpoint import save_checkpoint
    from pagedrl.model.config import ModelConfig
    from pagedrl.model.decoder import CausalLM
    from pagedrl.model.tokenizer import Tokenizer

    (tokenizer or build_tokenizer)(folder)
    tok = Tokenizer.from_folder(folder)
    raw = dict(architectures=["LlamaForCausalLM"], vocab_size=tok.vocab_size, hidden_size=hidden_size,
               intermediate_size=intermediate_size, num_hidden_layers=2, num_attention_heads=num_attention_heads,
               num_key_value_heads=2,
               max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-5, tie_word_embeddings=tied,
               bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    raw.update(config)
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig.from_dict(raw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)
    save_checkpoint(model, folder, generation_config={"eos_token_id": tok.eos_token_id})
    tok.save(folder)
    return folder


# config.json fields of tiny mixtures of experts (with `num_experts_per_tok`) for `build_model_dir`.
MOE = {"mixtral": dict(architectures=["MixtralForCausalLM"], num_local_experts=8),
       "qwen3-moe": dict(architectures=["Qwen3MoeForCausalLM"], num_experts=8, moe_intermediate_size=32,
                         mlp_only_layers=[1]),
       # gpt-oss: its router's bias and top-k-then-softmax rule, sinks, a 4-token window the rows cross.
       "gpt-oss": dict(architectures=["GptOssForCausalLM"], num_local_experts=4, intermediate_size=32, sliding_window=4,
                       layer_types=["sliding_attention", "full_attention"], head_dim=16)}


def arithmetic_rows(n: int = 16) -> list[dict]:
    """Small prompt/completion corpus: plain text and chat rows mixed (each row one kind)."""
    rows = []
    for i in range(n):
        a, b = i % 4, i // 4
        if i % 2:
            rows.append({"prompt": f"what is {a} plus {b}", "completion": f" the answer is {a + b}"})
        else:
            rows.append({"prompt": [{"role": "user", "content": f"what is {a} plus {b}"}],
                         "completion": [{"role": "assistant", "content": f"the answer is {a + b}"}]})
    return rows


def chat_rows(n: int = 12) -> list[dict]:
    """`messages` rows: one or two user/assistant exchanges, some after a system message."""
    rows = []
    for i in range(n):
        a, b = i % 4, i // 4
        messages = [{"role": "system", "content": "red green blue"}] if i % 3 == 0 else []
        messages += [{"role": "user", "content": f"what is {a} plus {b}"},
                     {"role": "assistant", "content": f"the answer is {a + b}"}]
        if i % 2:
            messages += [{"role": "user", "content": "and the cat"}, {"role": "assistant", "content": "sat on the mat"}]
        rows.append({"messages": messages})
    return rows


def sft_trainer(model_dir: Path, output_dir: Path, rows: list[dict] | None = None, **fields):
    """An SFT Trainer on the tiny model, built without run_sft so tests can reach into it."""
    import torch

    from pagedrl.model.loader import load_model
    from pagedrl.train.algorithms.sft import SFT
    from pagedrl.train.checkpointing import seed_everything
    from pagedrl.train.distributed import DistInfo
    from pagedrl.train.offline_config import SFTConfig
    from pagedrl.train.trainer import Trainer

    defaults = dict(model=str(model_dir), output_dir=str(output_dir), max_steps=6, per_device_train_batch_size=4,
                    learning_rate=3e-3, logging_steps=1, save_steps=1000, seed=0)
    config = SFTConfig(**{**defaults, **fields})
    seed_everything(config.seed)
    loaded = load_model(config.model, device="cpu", dtype=torch.float32)
    dist = DistInfo()
    algorithm = SFT(config, loaded.model, loaded.tokenizer, dist, rows if rows is not None else arithmetic_rows())
    return Trainer(config, algorithm, dist, progress=False)
