"""Golden fixtures for `vllm-moa convert-official`, made with the MoA authors' own code.

Runs THEIR classes (huawei-noah/HEBO, branch `mixture-of-attentions`, commit
eb554aa141b6aba82b1e9f4be19c1eec665253d3) under the transformers their setup.py pins (<4.46), in a
virtual environment of its own: nothing of theirs is copied into this repository, and the test
(tests/test_official_checkpoint.py) reads only the files this script writes.

For each geometry it builds their training-time drafter `MOASpecLlamaForCausalLM` (a tiny random
Llama target with RoPE theta 500000 plus the drafter) with random weights rounded to bfloat16,
then writes under OUT/<geometry>/ (`lsa64`, `lsa32`, and `lsa64_llama3`: lsa64's weights on a
target with Llama-3.1-style `rope_scaling`, original length 16, 24 tokens of which 18 verified):

- `target/`: the tiny target (`LlamaForCausalLM.save_pretrained`, bfloat16);
- `release_training/`: the drafter through THEIR `save_pretrained` (the layout their trainer
  writes: the target's config.json, the drafter's tensors only);
- `release_moa_spec/`: `release_training/` through THEIR `vllm/convert_checkpoint.py` (the
  `moa_spec` layout their vLLM fork reads, the published checkpoint's);
- `golden.safetensors`: token ids [T], logits_tli0 / logits_tli1 [T, V] (float32) from THEIR
  training forward in float32, with `response_mask` 0 on the first P tokens (verified: the
  drafter's memory holds their target K/V) and 1 on the rest (teacher-forced drafts, which see
  the memory of the P verified tokens only), TLI 0 and TLI 1 (their TLI feeds the true hidden
  state at verified positions, so the target's last layer sees the true prefix, as at inference);
- `manifest.json`: the commit, blob hashes of their files, versions, shapes, T, P and the RoPE
  scaling where there is one.

It also checks that their single-device inference class, prefilled with the P verified tokens,
drafts its first token with the training forward's logits (TLI 0), so the golden rows are
what their inference computes too; and, for the rope-scaled target, that their SA's rotary is
the target's scaled one and CA's and LSA's are plain, each of which moves the golden rows when
swapped (so the scaling shows in the logits, as their installed transformers computes them).

The weights are bfloat16 values, so the float32 forward and the bfloat16 files hold the same
numbers (the fixtures stay small and the release's own dtype is exercised).

Rerun (about ten seconds on 2 CPU cores, once the environment is installed):

    git clone --branch mixture-of-attentions https://github.com/huawei-noah/HEBO.git hebo
    mkdir /tmp/hebo_src && git -C hebo archive eb554aa moa_spec setup.py requirements.txt \\
        vllm/convert_checkpoint.py | tar -x -C /tmp/hebo_src
    python3 -m venv /tmp/hebo_env
    /tmp/hebo_env/bin/pip install torch "transformers<4.46"       # their setup.py's pins
    /tmp/hebo_env/bin/pip install -r /tmp/hebo_src/requirements.txt  # optional: the full stack
    /tmp/hebo_env/bin/python scripts/make_official_fixtures.py --hebo-src /tmp/hebo_src \\
        --out tests/data/official

The fixtures in the repository were made with transformers 4.45.2 and torch 2.13.0+cpu (their
setup.py leaves torch unpinned), Python 3.11, with the whole of their requirements.txt installed
(trl 0.8.2, deepspeed 0.15.4, ...). Their package has no `__init__.py` files, so `pip install -e`
of it installs no module: the script puts --hebo-src on sys.path, as their README's `python
moa_spec/train.py` does.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import platform
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

COMMIT = "eb554aa141b6aba82b1e9f4be19c1eec665253d3"
# git blob hashes of the files used, at COMMIT (`git ls-tree COMMIT <path>`).
BLOBS = {
    f"moa_spec/models/{path}": blob
    for path, blob in {
        "train/moa_spec.py": "d1f9f066a9223897caefe6ddfe704b2145f92054",
        "train/cross_attention.py": "fa80b5e3a71ecde86c8341b21fb6e171df6a56e0",
        "inference/single_device/moa_spec.py": "a888155deb0ceccd08eb8c47257d768d64a765e7",
        "inference/cross_attention.py": "bae6af30f5a59b502d2d89985fe3d5a3ad8c897d",
        "inference/tree_attention.py": "c4ffee4b9b1834cfb21d5b6989cde2049cb09335",
    }.items()
} | {"vllm/convert_checkpoint.py": "bbd4ea724feeb8acba287f53d0eb6e541c7a0556"}
ROPE_THETA = 500000.0
SEQ_LEN = 12  # T
VERIFIED = 5  # P: tokens 0..P-1 verified, P..T-1 teacher-forced drafts
SEED = 1234
MAX_POSITIONS = 64  # the target's max_position_embeddings


@dataclass(frozen=True)
class RopeScaled:
    """The target's RoPE scaling, with a sequence long enough to run past its original length."""

    rope_scaling: dict[str, Any]
    max_position_embeddings: int
    seq_len: int  # T
    verified: int  # P


@dataclass(frozen=True)
class Geometry:
    """A tiny target and drafter. LSA head size = 2 * E_kv / num_heads (their formula)."""

    name: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    lsa_kv_heads: int
    lsa_mlp: int
    token_kv_heads: int  # SA and CA (their vLLM config requires them equal)
    token_mlp: int
    num_layers: int = 3
    vocab_size: int = 64
    target_mlp: int = 64
    scaled: RopeScaled | None = None  # None: no RoPE scaling, T = SEQ_LEN, P = VERIFIED

    @property
    def lsa_head_size(self) -> int:
        head_dim = self.hidden_size // self.num_heads
        return 2 * self.num_kv_heads * head_dim // self.num_heads

    @property
    def seq_len(self) -> int:
        return self.scaled.seq_len if self.scaled else SEQ_LEN

    @property
    def verified(self) -> int:
        return self.scaled.verified if self.scaled else VERIFIED

    def shape(self) -> dict[str, Any]:
        """The manifest's `geometry` (unscaled: the same as before `scaled` existed)."""
        return {k: v for k, v in asdict(self).items() if k != "scaled"}

    def rope_facts(self) -> dict[str, Any]:
        """The manifest's entries on the target's RoPE scaling (none where unscaled)."""
        if self.scaled is None:
            return {}
        return {
            "max_position_embeddings": self.scaled.max_position_embeddings,
            "rope_scaling": self.scaled.rope_scaling,
        }


# Llama-3.1's rope_scaling with an original length of 16 (theirs: 8192): tokens 0..17 verified,
# drafts at positions 18..23. llama3 scaling changes the frequencies themselves (wavelengths
# above 16 slowed 8x, 4..16 blended), so it moves every rotation, more with the distance.
LLAMA3 = RopeScaled(
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    max_position_embeddings=128,
    seq_len=24,
    verified=18,
)


GEOMETRIES = (
    # MHA target (2 heads of 32, 2 KV heads): LSA width 128, 2 heads of 64, 1 KV head.
    Geometry("lsa64", 64, 2, 2, lsa_kv_heads=1, lsa_mlp=64, token_kv_heads=1, token_mlp=96),
    # GQA target (2 heads of 32, 1 KV head): LSA width 64, 2 heads of 32, 2 KV heads.
    Geometry("lsa32", 64, 2, 1, lsa_kv_heads=2, lsa_mlp=48, token_kv_heads=1, token_mlp=96),
    # lsa64 on a target with Llama-3.1-style RoPE scaling (their SA applies it, CA and LSA not).
    Geometry(
        "lsa64_llama3", 64, 2, 2, lsa_kv_heads=1, lsa_mlp=64, token_kv_heads=1, token_mlp=96,
        scaled=LLAMA3,
    ),
)  # fmt: skip


def git_blob_sha(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def check_source(src: Path) -> None:
    for rel, blob in BLOBS.items():
        found = git_blob_sha(src / rel)
        if found != blob:
            raise SystemExit(f"{src / rel} is blob {found}, not {blob} (commit {COMMIT[:7]})")


def load_convert_checkpoint(src: Path) -> Any:
    spec = importlib.util.spec_from_file_location(
        "convert_checkpoint", src / "vllm/convert_checkpoint.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.convert_checkpoint


def target_config(g: Geometry) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=g.vocab_size,
        hidden_size=g.hidden_size,
        intermediate_size=g.target_mlp,
        num_hidden_layers=g.num_layers,
        num_attention_heads=g.num_heads,
        num_key_value_heads=g.num_kv_heads,
        max_position_embeddings=g.scaled.max_position_embeddings if g.scaled else MAX_POSITIONS,
        rope_theta=ROPE_THETA,
        rope_scaling=dict(g.scaled.rope_scaling) if g.scaled else None,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )


def build_theirs(g: Geometry, tli: int) -> Any:
    from moa_spec.models.train.moa_spec import MOASpecLlamaForCausalLM

    return MOASpecLlamaForCausalLM(
        target_config(g),
        layer_self_attention_num_key_value_heads=g.lsa_kv_heads,
        layer_self_attention_intermediate_size=g.lsa_mlp,
        self_attention_num_key_value_heads=g.token_kv_heads,
        self_attention_intermediate_size=g.token_mlp,
        cross_attention_num_key_value_heads=g.token_kv_heads,
        cross_attention_intermediate_size=g.token_mlp,
        target_layer_inference=tli,
        variable_future_length=False,  # refresh points come from response_mask alone
        staircase_mask=False,
    ).eval()


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random (norms around 1, matrices ~ 1/sqrt(fan-in), so activations and
    logits stay of order 1), then rounded to bfloat16 values."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name:
            value = 1.0 + 0.1 * noise
        elif name.endswith("bias"):
            value = 0.1 * noise
        elif "embed_tokens" in name:
            value = noise
        else:
            value = noise / p.shape[1] ** 0.5
        p.copy_(value.to(torch.bfloat16).float())


@torch.no_grad()
def their_logits(model: Any, input_ids: torch.Tensor, verified: int) -> torch.Tensor:
    """Drafter logits [T, V] from their training forward (the first LM-head call is the
    drafter's; the second is the target's, for the KL loss)."""
    calls: list[torch.Tensor] = []
    handle = model.lm_head.register_forward_hook(lambda _m, _i, out: calls.append(out))
    attention_mask = torch.ones_like(input_ids)
    response_mask = torch.zeros_like(input_ids)
    response_mask[:, verified:] = 1
    base_model_output = [
        model.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            output_hidden_states=True,
            use_cache=True,
        )
    ]
    model(
        base_model_output=base_model_output,
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        epoch=0,
        max_epochs=1,
    )
    handle.remove()
    return calls[0][0].float()


@torch.no_grad()
def check_inference_class(
    g: Geometry, model: Any, input_ids: torch.Tensor, row: torch.Tensor
) -> None:
    """Their single-device inference class, prefilled with the P verified tokens then drafting
    once from token P, must give the training forward's row P (TLI 0). (With TLI 1 that class
    fails at this step under transformers 4.45.2: its target layers get the whole sequence's
    mask for one query and no KV cache.)"""
    from moa_spec.models.inference.single_device.moa_spec import MOASpecLlamaForCausalLM

    kv, mlp = g.token_kv_heads, g.token_mlp
    inference = MOASpecLlamaForCausalLM(
        target_config(g), g.lsa_kv_heads, g.lsa_mlp, kv, mlp, kv, mlp,
        target_layer_inference=0, tree_decoding=False, verification=False,
        depth=1, breadth=1, total_tokens=1,
    ).eval()  # fmt: skip
    inference.load_state_dict(model.state_dict(), strict=True)
    p = g.verified
    prompt = input_ids[:, :p]
    prefill = inference(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        position_ids=torch.arange(p)[None],
        cache_position=torch.arange(p),
        use_cache=True,
        return_dict=True,
    )
    draft = inference(
        input_ids=input_ids[:, : p + 1],
        last_hidden_state=prefill["hidden_states"],  # their CA keys/values of the memory
        past_key_values2=prefill["past_key_values2"],
        past_key_values=prefill["past_key_values"],
        cache_position=torch.tensor([p]),
        gen_step=0,
    )
    diff = (draft["logits"][0, -1].float() - row).abs().max().item()
    if diff > 1e-4:
        raise SystemExit(f"{g.name}: their inference and training classes differ by {diff}")
    print(f"{g.name}: their inference class's first draft = training forward row P ({diff:.1e})")


def rotary(g: Geometry, head_dim: int, scaled: bool) -> Any:
    """transformers' LlamaRotaryEmbedding for the target's base, with or without its scaling."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = target_config(g)
    config.head_dim = head_dim
    if not scaled:
        config.rope_scaling = None
    return LlamaRotaryEmbedding(config=config)


@torch.no_grad()
def check_scaling_applied(
    g: Geometry, model: Any, input_ids: torch.Tensor, rows: torch.Tensor
) -> None:
    """Under the installed transformers, their SA's rotary carries the target's scaling and CA's
    and LSA's do not (CA's constructor clears the config they share), and the scaling shows in
    the golden rows: their forward with SA's rotary plain, or with CA's or LSA's scaled, moves
    them (TLI 0, rows P..T-1)."""
    head_dim = g.hidden_size // g.num_heads
    blocks = {
        "self_attention": (head_dim, True),
        "cross_attention": (head_dim, False),
        "layer_self_attention": (g.lsa_head_size, False),
    }
    for block, (size, scaled) in blocks.items():
        emb = getattr(model, block).self_attn.rotary_emb
        expected = g.scaled.rope_scaling["rope_type"] if scaled else "default"
        same = torch.equal(emb.inv_freq, rotary(g, size, scaled).inv_freq)
        other = torch.equal(emb.inv_freq, rotary(g, size, not scaled).inv_freq)
        if emb.rope_type != expected or not same or other:
            raise SystemExit(f"{g.name}: their {block} rotary is {emb.rope_type}, not {expected}")
    p = g.verified
    for block, (size, scaled) in blocks.items():
        theirs = build_theirs(g, 0)
        theirs.load_state_dict(model.state_dict(), strict=True)
        getattr(theirs, block).self_attn.rotary_emb = rotary(g, size, not scaled)
        moved = (their_logits(theirs, input_ids, p)[p:] - rows[p:]).abs().max().item()
        if moved < 1e-2:
            raise SystemExit(f"{g.name}: {block}'s RoPE scaling moves no logit ({moved:.1e})")
        print(
            f"{g.name}: their {block} rotary {'scaled' if scaled else 'plain'}; "
            f"{'plain' if scaled else 'scaled'} instead moves rows P.. by {moved:.3f}"
        )


def save_target(model: Any, g: Geometry, out: Path) -> None:
    from transformers import LlamaForCausalLM

    target = LlamaForCausalLM(target_config(g))
    state = {k: v for k, v in model.state_dict().items() if k.startswith(("model.", "lm_head."))}
    target.load_state_dict(state, strict=True)
    target.to(torch.bfloat16).save_pretrained(out)


def make_geometry(g: Geometry, src: Path, out: Path) -> dict[str, Any]:
    from safetensors.torch import save_file

    convert_checkpoint = load_convert_checkpoint(src)
    torch.manual_seed(SEED)
    model = build_theirs(g, tli=0)
    randomise(model, SEED)
    gen = torch.Generator().manual_seed(SEED + 1)
    input_ids = torch.randint(0, g.vocab_size, (1, g.seq_len), generator=gen)
    golden = {"input_ids": input_ids[0]}
    for tli in (0, 1):
        theirs = build_theirs(g, tli)
        theirs.load_state_dict(model.state_dict(), strict=True)
        golden[f"logits_tli{tli}"] = their_logits(theirs, input_ids, g.verified).contiguous()
    check_inference_class(g, model, input_ids, golden["logits_tli0"][g.verified])
    if g.scaled:
        check_scaling_applied(g, model, input_ids, golden["logits_tli0"])
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    save_target(model, g, out / "target")
    model.to(torch.bfloat16).save_pretrained(out / "release_training")  # THEIR save_pretrained
    convert_checkpoint(str(out / "release_training"), str(out / "release_moa_spec"))
    save_file(golden, str(out / "golden.safetensors"))
    return {"geometry": g.shape(), "lsa_head_size": g.lsa_head_size}


def installed(names: tuple[str, ...]) -> dict[str, str | None]:
    """Versions of their setup.py's other pins, where installed (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--hebo-src", type=Path, required=True, help=f"their source at {COMMIT[:7]}"
    )
    parser.add_argument("--out", type=Path, default=Path("tests/data/official"))
    args = parser.parse_args()
    import transformers

    if (
        not transformers.__version__.startswith("4.")
        or int(transformers.__version__.split(".")[1]) >= 46
    ):
        raise SystemExit(f"their setup.py pins transformers<4.46; found {transformers.__version__}")
    check_source(args.hebo_src)
    sys.path.insert(0, str(args.hebo_src))
    torch.use_deterministic_algorithms(True)
    for g in GEOMETRIES:
        facts = make_geometry(g, args.hebo_src, args.out / g.name)
        manifest = {
            "source": "https://github.com/huawei-noah/HEBO/tree/mixture-of-attentions",
            "commit": COMMIT,
            "blobs": BLOBS,
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "their_other_pins": installed(("trl", "deepspeed", "accelerate", "hydra-core")),
            "rope_theta": ROPE_THETA,
            **g.rope_facts(),
            "seq_len": g.seq_len,
            "verified": g.verified,
            "seed": SEED,
            "dtype_of_weights": "bfloat16 (values rounded to bfloat16 before the float32 forward)",
            **facts,
        }
        (args.out / g.name / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        print(f"wrote {args.out / g.name}")


if __name__ == "__main__":
    main()
