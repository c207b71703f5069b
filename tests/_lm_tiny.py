"""A tiny word-level tokenizer.json (+ tokenizer_config.json with a chat template) for the decoder-only tests,
built with Hugging Face `tokenizers`."""

import json

WORDS = (
    "the quick brown fox jumps over lazy dog a stitch in time saves nine hello world how are you user "
    "assistant system good morning English French le renard : ."
).split()
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + m['content'] + ' <|im_end|>' }}"
    "{% if not loop.last %}{{ ' ' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ ' <|im_start|>assistant' }}{% endif %}"
)


def make_tokenizer(folder, bos: bool, chat_template: bool = True) -> int:
    """Llama-style (bos=True: the post-processor prepends <s>, EOS </s>) or Qwen-style (no BOS, EOS <|im_end|>).
    Returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tk.add_special_tokens(SPECIALS)
    if bos:
        tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tk.save(str(folder / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "</s>" if bos else "<|im_end|>",
        "unk_token": "<unk>",
    }
    if chat_template:
        cfg["chat_template"] = CHAT_TEMPLATE
    if bos:
        cfg["bos_token"] = "<s>"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return len(vocab)


def randomize(model, seed, eos):
    """transformers initialises with std 0.02 (every logit ~0): wider weights give peaked, diverse outputs,
    and a stronger EOS row gives outputs of different lengths."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.35)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:  # RMSNorm weights
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        model.get_output_embeddings().weight[eos] *= 1.6
    return model
