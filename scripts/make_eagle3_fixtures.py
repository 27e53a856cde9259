"""Golden fixtures for the EAGLE-3 drafter kind, made with the EAGLE-3 authors' own code.

Runs THEIR classes (SafeAILab/EAGLE, commit cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b, files checked
by git blob hash) in a virtual environment of its own, with the transformers their
requirements.txt names (>=4.53.1: 4.53.1): nothing of theirs is copied into this repository, and
the test (tests/test_eagle3_reference.py) reads only the files this script writes.

It builds a tiny random Llama target (8 layers, so that their hard-coded feature layers 2, L//2 = 4
and L-3 = 5 are distinct; E = 64, 4 heads, 2 KV heads, vocabulary 128, RoPE theta 10000 because
their training code ignores `rope_theta`) and a random EAGLE-3 drafter through THEIR training
class (`Model` of eagle/traineagle3/cnets.py, draft vocabulary = the whole vocabulary), all
weights rounded to bfloat16 values, then writes under OUT (tests/data/eagle3):

- `target/`: the tiny target (`LlamaForCausalLM.save_pretrained`, bfloat16);
- `release/`: the drafter as their trainer saves it (`save_16bit_model(...,
  exclude_frozen_parameters=True)`: every state-dict entry but the frozen parameters and the
  target's RoPE buffers (`release_state`), i.e. `midlayer.*`, `fc.weight`, `norm.weight`,
  `lm_head.weight` and the buffers `d2t` (zeros) and `t2d` (all True), the maps their
  `scandata` builds when every token of the vocabulary occurs),
  bfloat16, as `model.safetensors` (which their `EaModel.from_pretrained` reads when there is no
  `pytorch_model.bin`), and a config.json shaped like their eagle/traineagle3/config.json;
- `golden.safetensors` (float32 computations of their code on the bfloat16-valued weights):
  - `input_ids` [T]: random tokens, except token P, the target's greedy token after the P
    verified tokens (as their driver `initialize_tree` picks it);
  - `aux_states` [T, 3E]: the target states their training target model returns (the inputs of
    layers 2, 4, 5, concatenated);
  - `inference_logits` [D, V]: their inference drafter (`Model` of eagle/model/cnets.py) fed as
    their driver feeds it (the target's three states of the P verified tokens, the input ids
    shifted by one, positions 0..P-1), then D-1 draft steps forced along tokens P+1..P+D-1, each
    fed the previous step's layer output before the final norm at the next position, as their
    `topK_genrate` does along one path (called step by step here, so the path can be forced);
  - `greedy_tokens` [D], `greedy_logits` [D, V]: their `initialize_tree` + `topK_genrate`
    themselves with top_k 1 and depth D-1 (the lm_head outputs, hooked): the greedy chain;
  - `training_logits` [S, T, V], `training_losses` [S]: their training-time test (the training
    `Model.forward`, S = 7 steps, their default) on the T tokens, every step's drafter logits
    (hooked on its lm_head) and its loss, with `loss_mask` [T] (1 but at T-2 and T-1, so that
    every step's loss covers exactly the drafts of a token inside the sequence);
- `manifest.json`: the commit, blob hashes of their files, versions, shapes, T, P, D, S.

It also checks their code against itself: their inference target's three states for the P
verified tokens (with their KV cache) equal their training target's and transformers' own
`hidden_states[2, 4, 5]`; the step-by-step driver gives exactly their `topK_genrate`'s logits
along its greedy chain; every forced inference step j equals training step j at position P-1
(the same draft: feature of token P-1, token P, then the forced tokens); and each training
loss is their formula on the hooked logits.

Rerun (about ten seconds on 2 CPU cores, once the environment is installed):

    git clone https://github.com/SafeAILab/EAGLE.git eagle
    mkdir /tmp/eagle_src
    git -C eagle archive cb7e084 eagle requirements.txt | tar -x -C /tmp/eagle_src
    python3 -m venv /tmp/eagle3_env
    /tmp/eagle3_env/bin/pip install torch "transformers==4.53.1" datasets
    /tmp/eagle3_env/bin/python scripts/make_eagle3_fixtures.py --eagle-src /tmp/eagle_src \\
        --out tests/data/eagle3

(`datasets` only because their training module imports it.) The fixtures in the repository were
made with transformers 4.53.1, torch 2.13.0+cpu (their requirements.txt pins torch 2.6.0, which
the package registries reachable here do not have as a CPU build), Python 3.11. Their modules
import each other as `eagle.model.*` (the inference side) and as top-level modules from
eagle/traineagle3 (the training side, as their `python main.py` there does): the script puts
--eagle-src and --eagle-src/eagle/traineagle3 on sys.path.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

COMMIT = "cb7e0841fe0c206c6ed74a197ad5e2a1f13f5a2b"
# git blob hashes of the files used, at COMMIT (`git ls-tree COMMIT <path>`).
BLOBS = {
    "eagle/model/cnets.py": "a8e13ca1688d72ef6e6c94386be2b435d3ecf740",
    "eagle/model/ea_model.py": "7320923bf42b21a339e07dfa67d1c02b01c5cbab",
    "eagle/model/utils.py": "dfc64baec1c26f32b90382536e9e9835ee2d205d",
    "eagle/model/kv_cache.py": "47a6c9524f571e8fc47222e69dc48ac585756614",
    "eagle/model/modeling_llama_kv.py": "7b13b63d0bfd3726fc079c2e0efedfcebed39e55",
    "eagle/model/configs.py": "b355c2e7cbce1ad9e2ee146e3e3c349f52704e37",
    "eagle/traineagle3/cnets.py": "4c623002af9f4eb52a5f6dd801df4fb90f5f189e",
    "eagle/traineagle3/modeling_llama_kv.py": "2d9538bb3b777acd67af25c13b89051807f71f90",
    "eagle/traineagle3/configs.py": "b355c2e7cbce1ad9e2ee146e3e3c349f52704e37",
    "eagle/traineagle3/config.json": "93a1a197af98e51e76188e5a4bb0d61500f89874",
}
NUM_LAYERS = 8  # L: feature layers 2, L//2 = 4, L-3 = 5
HIDDEN = 64  # E
NUM_HEADS = 4
NUM_KV_HEADS = 2
VOCAB = 128  # the draft vocabulary too
TARGET_MLP = 128
DRAFTER_MLP = 96  # unlike the target's, so a config taking the target's would show
ROPE_THETA = 10000.0  # their training rotary's base whatever the config says
RMS_NORM_EPS = 1e-5
MAX_POSITIONS = 64  # the target's
SEQ_LEN = 16  # T
VERIFIED = 6  # P: tokens 0..P-1 verified (their states known), token P the target's greedy token
DRAFT_STEPS = 7  # D: inference draft steps (the first from the prefix pass, then D-1 forced)
TRAIN_STEPS = 7  # S: their training-time test's steps (`Model.length`, their default)
SEED = 1234


def git_blob_sha(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def check_source(src: Path) -> None:
    for rel, blob in BLOBS.items():
        found = git_blob_sha(src / rel)
        if found != blob:
            raise SystemExit(f"{src / rel} is blob {found}, not {blob} (commit {COMMIT[:7]})")


def target_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=TARGET_MLP,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=ROPE_THETA,
        rms_norm_eps=RMS_NORM_EPS,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )


def drafter_config_json() -> dict[str, Any]:
    """Their eagle/traineagle3/config.json with the tiny sizes (no rope_theta, as theirs: RoPE
    base 10000 in their training and inference code alike)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": DRAFTER_MLP,
        "max_position_embeddings": 2048,
        "model_type": "llama",
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "num_hidden_layers": 1,
        "pad_token_id": 0,
        "rms_norm_eps": RMS_NORM_EPS,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.53.1",
        "use_cache": True,
        "vocab_size": VOCAB,
        "draft_vocab_size": VOCAB,
    }


@torch.no_grad()
def randomise(named: list[tuple[str, nn.Parameter]], seed: int) -> None:
    """Every parameter random (norms around 1, matrices ~ 1/sqrt(fan-in), so activations and
    logits stay of order 1), then rounded to bfloat16 values."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(named, key=lambda item: item[0]):
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name:
            value = 1.0 + 0.1 * noise
        elif "embed_tokens" in name:
            value = noise
        else:
            value = noise / p.shape[1] ** 0.5
        p.copy_(value.to(torch.bfloat16).float())


def make_target(out: Path) -> Any:
    """The tiny random target, saved in bfloat16; returns it as transformers loads it (float32)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(SEED)
    model = LlamaForCausalLM(target_config()).eval()
    randomise(list(model.named_parameters()), SEED)
    model.to(torch.bfloat16).save_pretrained(out)
    # Loaded again: `.to(bfloat16)` rounded the rotary's inv_freq buffer too.
    return LlamaForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()


def build_training(release: Path, target_dir: Path, embed: torch.Tensor) -> Any:
    """THEIR training `Model` (eagle/traineagle3/cnets.py) with random trainable weights.

    Their constructor loads the target in float16 (`torch_dtype=torch.float16`); it is loaded
    again here in float32 so that their whole forward runs in float32. `load_emb=False` and
    the embedding copied from the target: their `load_emb` reads it from a sharded checkpoint's
    index, which the tiny target has not. d2t / t2d: what their `scandata` builds when every
    token of the vocabulary occurs (d2t[i] = used[i] - i = 0, t2d all True)."""
    from cnets import Model as TrainModel
    from configs import EConfig as TrainEConfig
    from modeling_llama_kv import LlamaForCausalLM as TrainLlama

    config = TrainEConfig.from_pretrained(str(release))
    # Their main.py hands a dict whose key is "gradient_checkpoint", and cnets reads the
    # attribute `gradient_checkpointing` (an AttributeError as released); a namespace here.
    training_config = SimpleNamespace(gradient_checkpointing=False)
    model = TrainModel(config, None, training_config, load_emb=False, path=str(target_dir))
    model.target_model = TrainLlama.from_pretrained(str(target_dir), torch_dtype=torch.float32)
    model.target_model.eval()
    for p in model.target_model.parameters():
        p.requires_grad = False
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
    model.register_buffer("d2t", torch.zeros(VOCAB, dtype=torch.long))
    model.register_buffer("t2d", torch.ones(VOCAB, dtype=torch.bool))
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    randomise(trainable, SEED + 1)
    return model.eval()


def release_state(model: Any) -> dict[str, torch.Tensor]:
    """What their `save_16bit_model(..., exclude_frozen_parameters=True)` keeps: the state
    dict less the frozen parameters (the embedding, the target), in bfloat16 but the maps.
    Less also the target's persistent RoPE buffers (`target_model.model.layers.N.self_attn.
    rotary_emb.inv_freq`), which their trainer saves too on a target without RoPE scaling
    (their Llama-3.1 rotary's buffer is not persistent, so their Llama-3.1 releases have none)."""
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    state = {
        k: v
        for k, v in model.state_dict().items()
        if k not in frozen and not k.startswith("target_model.")
    }
    names = sorted(state)
    expected = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    if not expected <= set(names) or any(
        n not in expected and not n.startswith("midlayer.") for n in names
    ):
        raise SystemExit(f"unexpected release entries: {names}")
    return {
        k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
        for k, v in state.items()
    }


def build_inference(release: Path, state: dict[str, torch.Tensor], embed: torch.Tensor) -> Any:
    """THEIR inference `Model` (eagle/model/cnets.py) loaded as their `EaModel` loads it (d2t
    and t2d deleted when the vocabularies agree, `load_state_dict(strict=False)`, the embedding
    the target's), top_k 1 and depth D-1: a greedy chain of D drafts."""
    from eagle.model.cnets import Model
    from eagle.model.configs import EConfig

    config = EConfig.from_pretrained(str(release))
    model = Model(config, total_tokens=DRAFT_STEPS + 1, depth=DRAFT_STEPS - 1, top_k=1)
    del model.d2t, model.t2d  # ea_model.py: when vocab_size == draft_vocab_size
    loaded = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if loaded.missing_keys != ["embed_tokens.weight"] or sorted(loaded.unexpected_keys) != [
        "d2t",
        "t2d",
    ]:
        raise SystemExit(f"their inference class loads the release as {loaded}")
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed)
    model.float().eval()
    model.init_tree()
    return model


class LogitsHook:
    """Collects every output of a module (the drafter's lm_head)."""

    def __init__(self, module: nn.Module) -> None:
        self.calls: list[torch.Tensor] = []
        self.handle = module.register_forward_hook(
            lambda _m, _i, out: self.calls.append(out.detach().clone())
        )

    def remove(self) -> list[torch.Tensor]:
        self.handle.remove()
        return self.calls


@torch.no_grad()
def their_driver(drafter: Any, target_dir: Path, prompt: torch.Tensor) -> dict[str, torch.Tensor]:
    """Their prefill (`initialize_tree` of eagle/model/utils.py, through `EaModel.forward` and
    their KV-cached target) and `topK_genrate` with top_k 1: the target's greedy token after
    the prompt, the target's three states of the prompt, and the greedy chain's logits."""
    from eagle.model.ea_model import EaModel
    from eagle.model.kv_cache import initialize_past_key_values
    from eagle.model.modeling_llama_kv import LlamaForCausalLM as KVLlamaForCausalLM
    from eagle.model.utils import initialize_tree, reset_tree_mode

    base = KVLlamaForCausalLM.from_pretrained(str(target_dir), torch_dtype=torch.float32).eval()
    # EaModel without its constructor (which loads a tokenizer the tiny target has not): the
    # attributes initialize_tree and EaModel.forward read.
    ea_model = EaModel.__new__(EaModel)
    nn.Module.__init__(ea_model)
    ea_model.base_model = base
    ea_model.ea_layer = drafter
    ea_model.use_eagle3 = True
    past_key_values, _data, _length = initialize_past_key_values(base, max_length=MAX_POSITIONS)
    drafter.reset_kv()
    reset_tree_mode(ea_model)
    hook = LogitsHook(drafter.lm_head)
    draft_tokens, _retrieve, _mask, _positions, _orig, states, token = initialize_tree(
        prompt[None], ea_model, past_key_values, None
    )
    logits = torch.cat(hook.remove())  # [D, V]: the prefix pass, then each depth
    tokens = draft_tokens[0, 1:]  # after the root (the target's token)
    if logits.shape != (DRAFT_STEPS, VOCAB) or not torch.equal(tokens, logits.argmax(-1)):
        raise SystemExit("their topK_genrate with top_k 1 is not the greedy chain of its logits")
    return {"token": token[0, 0], "states": states[0], "logits": logits, "tokens": tokens}


@torch.no_grad()
def forced_chain(
    drafter: Any, states: torch.Tensor, ids: torch.Tensor, forced: torch.Tensor
) -> torch.Tensor:
    """Their inference drafter along one forced path, as `topK_genrate` drives it: the prefix
    pass on the target's states [P, 3E] with the input ids [P+1] shifted by one (positions
    0..P-1, fc applied), then one step per forced token, fed the previous output before the
    final norm, at position P + i, the chain's keys kept. -> logits [len(forced) + 1, V]."""
    p = states.shape[0]
    drafter.reset()
    out, past = drafter(states[None], input_ids=ids[None, 1:], use_cache=True)
    hidden = out[:, -1:]
    rows = [drafter.lm_head(drafter.norm(hidden[0]))]
    tree_mask = drafter.tree_mask_init
    for i, token in enumerate(forced.tolist()):
        drafter.tree_mask = tree_mask  # top_k 1: the node sees the prefix and its ancestors
        positions = p + i + drafter.position_ids
        out, past = drafter(
            hidden, input_ids=torch.tensor([[token]]), past_key_values=past,
            position_ids=positions, use_cache=True,
        )  # fmt: skip
        rows.append(drafter.lm_head(drafter.norm(out[0])))
        hidden = out[:, [0]]
        tree_mask = torch.cat((tree_mask, drafter.tree_mask_init), dim=3)
    drafter.reset()
    return torch.cat(rows)


@torch.no_grad()
def their_training(model: Any, ids: torch.Tensor, loss_mask: torch.Tensor) -> dict[str, Any]:
    """Their training-time test on one sequence: each step's logits [S, T, V] (hooked on the
    drafter's lm_head; the target's is another module), losses [S], the target's states and
    logits."""
    hook = LogitsHook(model.lm_head)
    plosses, _vlosses, _acces = model(
        ids[None], attention_mask=torch.ones_like(ids)[None], loss_mask=loss_mask[None]
    )
    logits = torch.cat(hook.remove())
    outs = model.target_model(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None])
    return {
        "logits": logits,
        "losses": torch.stack(plosses).float(),
        "states": torch.cat(outs.hidden_states, dim=-1)[0],
        "target_logits": outs.logits[0].float(),
    }


def their_loss(step: int, logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> float:
    """Their step loss (traineagle3/cnets.py, forward) from its ingredients: step j at t is
    trained on the target's logits at t + 1 + j where loss_mask[t + j], averaged over all T."""
    seq = target.shape[0]
    shifted = torch.zeros_like(target)
    shifted[: seq - 1 - step] = target[1 + step :]
    position_mask = torch.zeros(seq)
    position_mask[: seq - step] = mask[step:].float()
    plogp = shifted.softmax(-1) * logits.log_softmax(-1)
    return float(-(position_mask[:, None] * plogp).sum(-1).mean())


def check(what: str, diff: float, tol: float = 1e-5) -> None:
    if diff > tol:
        raise SystemExit(f"their code disagrees with itself: {what} differ by {diff:.2e}")
    print(f"{what}: {diff:.1e}")


def make(out: Path) -> dict[str, Any]:
    from safetensors.torch import save_file

    for name in ("target", "release"):  # README.md stays
        shutil.rmtree(out / name, ignore_errors=True)
    (out / "release").mkdir(parents=True)
    target = make_target(out / "target")
    embed = target.model.embed_tokens.weight.detach().clone()
    (out / "release" / "config.json").write_text(json.dumps(drafter_config_json(), indent=2) + "\n")
    training = build_training(out / "release", out / "target", embed)
    state = release_state(training)
    save_file(state, str(out / "release" / "model.safetensors"), metadata={"format": "pt"})
    inference = build_inference(out / "release", state, embed)

    gen = torch.Generator().manual_seed(SEED + 2)
    ids = torch.randint(0, VOCAB, (SEQ_LEN,), generator=gen)
    greedy = their_driver(inference, out / "target", ids[:VERIFIED])
    ids[VERIFIED] = greedy["token"]  # the target's token after the verified prefix
    prefix = ids[: VERIFIED + 1]
    along = forced_chain(inference, greedy["states"], prefix, greedy["tokens"][:-1])
    check(
        "their driver's greedy chain and the step-by-step driver along it",
        (along - greedy["logits"]).abs().max().item(),
        0.0,
    )
    forced = ids[VERIFIED + 1 : VERIFIED + DRAFT_STEPS]
    inference_logits = forced_chain(inference, greedy["states"], prefix, forced)

    # Step j's loss at t reads loss_mask[t + j] and the target's logits at t + 1 + j: with
    # zeros at T-2 and T-1 it covers t + 1 + j <= T-2, the drafts of tokens inside the
    # sequence (with a 1 at T-2 it would also distil the target's distribution after the last
    # token, which our training never does).
    loss_mask = torch.ones(SEQ_LEN, dtype=torch.long)
    loss_mask[-2:] = 0
    trained = their_training(training, ids, loss_mask)
    training_logits = trained["logits"]
    assert training_logits.shape == (TRAIN_STEPS, SEQ_LEN, VOCAB)
    hf = target(input_ids=ids[None], output_hidden_states=True).hidden_states
    layers = (2, NUM_LAYERS // 2, NUM_LAYERS - 3)
    check(
        "their training target's states and transformers' hidden_states[2, 4, 5]",
        (trained["states"] - torch.cat([hf[i][0] for i in layers], -1)).abs().max().item(),
    )
    check(
        "their inference target's (KV-cached) and training target's states",
        (greedy["states"] - trained["states"][:VERIFIED]).abs().max().item(),
    )
    steps = min(DRAFT_STEPS, TRAIN_STEPS)
    check(
        "their inference steps 0..D-1 and training steps 0..D-1 at position P-1",
        (inference_logits[:steps] - training_logits[:steps, VERIFIED - 1]).abs().max().item(),
    )
    recomputed = [
        their_loss(j, training_logits[j], trained["target_logits"], loss_mask.float())
        for j in range(TRAIN_STEPS)
    ]
    check(
        "their training losses and their formula on the hooked logits",
        (torch.tensor(recomputed) - trained["losses"]).abs().max().item(),
    )
    golden = {
        "input_ids": ids,
        "aux_states": trained["states"].contiguous(),
        "inference_logits": inference_logits.contiguous(),
        "greedy_tokens": greedy["tokens"].contiguous(),
        "greedy_logits": greedy["logits"].contiguous(),
        "training_logits": training_logits.contiguous(),
        "training_losses": trained["losses"].contiguous(),
        "loss_mask": loss_mask,
    }
    save_file(golden, str(out / "golden.safetensors"))
    return {
        "target": {
            "num_layers": NUM_LAYERS,
            "hidden_size": HIDDEN,
            "num_heads": NUM_HEADS,
            "num_kv_heads": NUM_KV_HEADS,
            "vocab_size": VOCAB,
            "intermediate_size": TARGET_MLP,
            "rope_theta": ROPE_THETA,
            "rms_norm_eps": RMS_NORM_EPS,
        },
        "feature_layers": list(layers),
        "drafter_intermediate_size": DRAFTER_MLP,
        "draft_vocab_size": VOCAB,
        "release_entries": sorted(state),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--eagle-src", type=Path, required=True, help=f"their source at {COMMIT[:7]}"
    )
    parser.add_argument("--out", type=Path, default=Path("tests/data/eagle3"))
    args = parser.parse_args()
    import transformers

    check_source(args.eagle_src)
    sys.path.insert(0, str(args.eagle_src / "eagle" / "traineagle3"))
    sys.path.insert(0, str(args.eagle_src))
    torch.use_deterministic_algorithms(True)
    facts = make(args.out)
    manifest = {
        "source": "https://github.com/SafeAILab/EAGLE",
        "commit": COMMIT,
        "blobs": BLOBS,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "seq_len": SEQ_LEN,
        "verified": VERIFIED,
        "draft_steps": DRAFT_STEPS,
        "train_steps": TRAIN_STEPS,
        "seed": SEED,
        "dtype_of_weights": "bfloat16 (values rounded to bfloat16 before the float32 forward)",
        **facts,
    }
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
