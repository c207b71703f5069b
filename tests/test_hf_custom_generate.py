"""transformers' own generate() decodes with the heads of a decoder-only export: custom_generate/generate.py
(bpd_train/hf_generate) beside an `export.format=hf` folder gives exactly transformers' greedy output (do_sample=False,
a plain load of the same folder), with as many forward passes per row as bpd-train's own blockwise decoder makes
decoder calls (plus the prompt's): the heads propose what bpd-train's heads propose."""
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

PROMPTS = [[1, 5, 6, 7], [1, 9, 3], [1, 11, 12, 13, 14, 15]]
MAX_NEW = 20


def _export(tmp_path, kind: str, init: str, identity_p1: bool = True):
    from bpd_train.convert.hf_lm import to_hf_lm
    from bpd_train.hf_generate import write_custom_generate
    from bpd_train.model.lm import LMModel
    from bpd_train.model.lm_config import LMConfig

    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_positions=128,
                   block_size=4, heads=kind, eos_id=2, bos_id=1, identity_p1=identity_p1)
    model = LMModel(cfg).eval()
    with torch.no_grad():
        for p in model.head_parameters():
            # zero: every head proposes head 1's token (accepted where the output repeats); small: mostly that,
            # sometimes not; random: rarely right
            if init != "zero":
                p.normal_(0, {"small": 0.02, "random": 0.3}[init])
    out = to_hf_lm(model, tmp_path / f"{kind}-{init}")
    write_custom_generate(out)
    return model, out


def _padded(prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.mark.parametrize("kind,init", [("bpd", "zero"), ("bpd", "small"), ("bpd", "random"),
                                       ("medusa", "zero"), ("medusa", "random")])
def test_generate_with_heads_is_transformers_greedy(tmp_path, kind, init):
    from transformers import AutoModelForCausalLM

    from bpd_train.decoding import blockwise

    model, folder = _export(tmp_path, kind, init)
    ids, mask = _padded(PROMPTS)
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        want = plain.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW,
                              pad_token_id=0)
    hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    got = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0)
    assert torch.equal(got, want)
    # the same passes as bpd-train's blockwise decoder, row by row: the heads are computed as bpd-train computes them
    total = 0
    for p in PROMPTS:
        r = blockwise(model, [p], max_len=MAX_NEW)
        out = hf.generate(input_ids=torch.tensor([p]), max_new_tokens=MAX_NEW, pad_token_id=0)
        assert out[0, len(p):].tolist()[:len(r.tokens[0])] == r.tokens[0]
        assert hf.bpd_stats["passes"] == r.calls + 1, (hf.bpd_stats, r.calls)  # + the prompt's pass
        total += hf.bpd_stats["passes"]
    if init == "zero":
        assert total < len(PROMPTS) * MAX_NEW / 2  # heads accepted: fewer passes than tokens


def test_custom_generate_on_a_plain_load_and_heads_not_first_head(tmp_path):
    """generate(custom_generate=folder) on a model loaded without remote code; heads whose head 1 is not the LM's
    own (identity_p1=false) only propose: the output is still transformers' greedy."""
    from transformers import AutoModelForCausalLM

    _, folder = _export(tmp_path, "bpd", "small", identity_p1=False)
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids, mask = _padded(PROMPTS)
    with torch.no_grad():
        want = plain.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW,
                              pad_token_id=0)
    got = plain.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0,
                         custom_generate=str(folder), trust_remote_code=True)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="greedy output"):
        plain.generate(input_ids=ids, max_new_tokens=4, do_sample=True, custom_generate=str(folder),
                       trust_remote_code=True)
    with pytest.raises(ValueError, match="repetition_penalty"):  # would change greedy's choices: refused
        plain.generate(input_ids=ids, max_new_tokens=4, repetition_penalty=1.3, custom_generate=str(folder),
                       trust_remote_code=True)


def test_generate_file_needs_only_torch_safetensors_transformers():
    """The file runs where bpd-train is not installed: it imports nothing of bpd_train."""
    import ast

    from bpd_train.hf_generate import TEMPLATE

    tree = ast.parse(TEMPLATE.read_text(encoding="utf-8"))
    roots = {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
             for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
             for a in (n.names if isinstance(n, ast.Import) else [n])}
    assert roots <= {"__future__", "json", "os", "inspect", "typing", "torch", "safetensors", "transformers",
                     "huggingface_hub"}, roots


def test_written_where_the_export_is(tmp_path):
    from bpd_train.hf_generate import TEMPLATE, write_custom_generate

    dest = write_custom_generate(tmp_path / "x")
    assert dest == tmp_path / "x" / "custom_generate" / "generate.py"
    assert dest.read_bytes() == TEMPLATE.read_bytes()
    shutil.rmtree(tmp_path / "x")


def test_docs_block_runs(tmp_path):
    """docs/decoder-only.md's block on transformers' generate runs as written."""
    from conftest import REPO_ROOT

    from bpd_train.convert.hf_lm import to_hf_lm
    from bpd_train.model.lm import LMModel
    from bpd_train.model.lm_config import LMConfig

    text = (REPO_ROOT / "docs" / "decoder-only.md").read_text(encoding="utf-8")
    code = text.split("## transformers' own `generate()` with the heads", 1)[1].split("```python\n", 1)[1]
    code = code.split("```", 1)[0]
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_positions=128,
                   block_size=3, heads="medusa", eos_id=2, bos_id=1)
    folder = to_hf_lm(LMModel(cfg).eval(), tmp_path / "hf")
    ids, mask = _padded(PROMPTS)
    scope = {"folder": folder, "ids": ids, "mask": mask}
    exec(compile(code, "docs/decoder-only.md#transformers-own-generate-with-the-heads", "exec"), scope)
    assert scope["out"].shape[0] == len(PROMPTS) and scope["model"].bpd_stats["tokens"] > 0
