"""`vllm-moa regenerate` without vLLM: the prompt readers (one sample file per layout), the held-out
split, and a run with a stand-in generator (resume, refusals, the records `train` reads)."""

from __future__ import annotations

import gzip
import json
import random
import shutil
from pathlib import Path

import pytest

from vllm_moa.training.generator import Completion, Request
from vllm_moa.training.hold_out import canonical, split_prompts
from vllm_moa.training.prompts import read_prompt_file
from vllm_moa.training.regenerate import prompt_seed, read_prompt_files, regenerate
from vllm_moa.training.regenerate_config import RegenerateConfig

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def write_jsonl(path: Path, records: list[dict], blank_after: int | None = None) -> Path:
    lines = [json.dumps(r) + "\n" for r in records]
    if blank_after is not None:
        lines.insert(blank_after + 1, "\n")
    text = "".join(lines)
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def specbench(path: Path, n: int = 3) -> Path:
    """Spec-Bench's layout (also MT-Bench's and the MoA paper's 6-task set's)."""
    records = [
        {"question_id": 81 + i, "category": "writing", "turns": [f"Write poem {i}.", "Again."]}
        for i in range(n)
    ]
    return write_jsonl(path, records)


def sample_files(tmp_path: Path) -> dict[str, Path]:
    eval6 = tmp_path / "moa_eval6"
    eval6.mkdir()
    return {
        "specbench": specbench(tmp_path / "specbench_question.jsonl"),
        "alpaca": write_jsonl(  # the 6-task set's alpaca.jsonl has an empty category
            eval6 / "alpaca.jsonl",
            [{"question_id": 0, "category": "", "turns": ["Name a fruit."], "reference": ["x"]}],
        ),
        "humaneval": write_jsonl(
            tmp_path / "HumanEval.jsonl.gz",
            [{"task_id": "HumanEval/0", "prompt": "def f(x):\n", "entry_point": "f"}],
        ),
        "gsm8k": write_jsonl(
            tmp_path / "gsm8k_train.jsonl",
            [{"question": "What is 1 + 1?", "answer": "#### 2"}, {"question": "2 + 2?"}],
            blank_after=0,
        ),
        "prompt": write_jsonl(tmp_path / "plain.jsonl", [{"prompt": "Hello"}]),
        "messages": write_jsonl(
            tmp_path / "chat.json",
            [
                {
                    "messages": [
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Hi there"},
                        {"role": "assistant", "content": "Hello!"},
                    ]
                }
            ],
        ),
    }


def test_readers_of_each_layout(tmp_path):
    files = sample_files(tmp_path)
    got = {name: read_prompt_file(path) for name, path in files.items()}
    first = {name: f.prompts[0] for name, f in got.items()}
    assert {n: f.layout for n, f in got.items()} == {
        "specbench": "turns", "alpaca": "turns", "humaneval": "humaneval", "gsm8k": "question",
        "prompt": "prompt", "messages": "messages",
    }  # fmt: skip
    assert {n for n, f in got.items() if f.evaluation} == {"specbench", "alpaca", "humaneval"}
    assert first["specbench"].text == "Write poem 0."  # the first turn only
    assert (first["specbench"].id, first["specbench"].category) == (
        "specbench_question:0",
        "writing",
    )
    assert (first["alpaca"].id, first["alpaca"].category) == ("alpaca:0", "alpaca")  # "" -> source
    assert (first["humaneval"].id, first["humaneval"].text) == ("HumanEval:0", "def f(x):\n")
    assert first["messages"].text == "Hi there"  # the first user message
    # ids are the line, from 0, blank lines counted: stable whatever else changes
    assert [p.id for p in got["gsm8k"].prompts] == ["gsm8k_train:0", "gsm8k_train:2"]
    assert read_prompt_file(files["gsm8k"]) == got["gsm8k"]


@pytest.mark.parametrize(
    "lines,match",
    [
        ([{"prompt": "a"}, {"question": "b"}], "holds one layout"),
        ([{"text": "a"}], "has none of `turns`"),
        ([{"turns": []}], r"`turns\[0\]` must be a non-empty string"),
        ([{"id": "x:0", "source": "x", "category": "x", "prompt": "p"}], "held-out list"),
        (["not an object"], "must be a JSON object"),
    ],
)
def test_reader_refusals(tmp_path, lines, match):
    with pytest.raises(ValueError, match=match):
        read_prompt_file(write_jsonl(tmp_path / "bad.jsonl", lines))


def test_reader_refuses_other_files(tmp_path):
    (tmp_path / "p.txt").write_text("hello")
    with pytest.raises(ValueError, match="one a line"):
        read_prompt_file(tmp_path / "p.txt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_prompt_file(tmp_path / "missing.jsonl")
    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"broken\.jsonl:2 is not valid JSON"):
        read_prompt_file(bad)


def many_prompts(path: Path, n: int, start: int = 0) -> Path:
    texts = [
        f"Prompt {i:05d}: name a colour that rhymes with {i * 7919 % 10007}." for i in range(n)
    ]
    return write_jsonl(path, [{"category": "c", "turns": [t]} for t in texts[start:]])


def test_split_deterministic_near_the_fraction_and_disjoint(tmp_path):
    files = read_prompt_files([str(many_prompts(tmp_path / "bench.jsonl", 2000))])
    split = split_prompts(files, 0.5, None)
    held, train = {p.id for p in split.held_out}, {p.id for p in split.train}
    # Binomial(2000, 0.5): sd 1.1% of the prompts; the hash is fixed, so this never flakes
    assert 0.46 < len(held) / 2000 < 0.54
    assert not held & train and len(held | train) == 2000
    assert split_prompts(files, 0.5, None) == split
    # a function of each text alone: another order, or a file of a subset, decides the same
    lines = (tmp_path / "bench.jsonl").read_text().splitlines(keepends=True)
    random.Random(0).shuffle(lines)
    (tmp_path / "shuffled.jsonl").write_text("".join(lines))
    shuffled = split_prompts(read_prompt_files([str(tmp_path / "shuffled.jsonl")]), 0.5, None)
    assert {p.text for p in shuffled.held_out} == {p.text for p in split.held_out}
    part = read_prompt_files([str(many_prompts(tmp_path / "part.jsonl", 2000, start=1500))])
    assert {p.text for p in split_prompts(part, 0.5, None).held_out} == {
        p.text for p in split.held_out if int(p.text[7:12]) >= 1500
    }
    # raising the fraction only adds prompts
    smaller = {p.id for p in split_prompts(files, 0.3, None).held_out}
    assert smaller < held and 0.26 < len(smaller) / 2000 < 0.34
    assert split_prompts(files, 0.0, None).held_out == ()
    assert len(split_prompts(files, 1.0, None).held_out) == 2000


def test_split_one_decision_per_problem(tmp_path):
    """The same problem in two evaluation files (other whitespace and case, HumanEval behind the
    6-task set's instruction) is held out in both or in neither; training prompts are never held
    out, but one containing a held-out prompt is left out; duplicates go once; `limit`."""
    problems = [
        f"def task_{i}(values):\n    '''Return the sum of {i} values.'''\n" for i in range(40)
    ]
    records = [{"task_id": f"H/{i}", "prompt": p} for i, p in enumerate(problems)]
    he = write_jsonl(tmp_path / "HumanEval.jsonl", records)
    wrapped = write_jsonl(
        tmp_path / "humaneval.jsonl",
        [{"turns": ["Complete the code I provided.\n\n" + p.upper()]} for p in problems],
    )
    alone = split_prompts(read_prompt_files([str(he)]), 0.5, None)
    held_he = {canonical(p.text) for p in alone.held_out}
    assert 5 < len(held_he) < 35
    a_held = next(p for p in problems if canonical(p) in held_he)
    a_kept = next(p for p in problems if canonical(p) not in held_he)
    train = write_jsonl(
        tmp_path / "train.jsonl",
        [{"prompt": "Please solve: " + a_held}, {"prompt": a_kept}, {"prompt": "Other"},
         {"prompt": "Other "}, {"prompt": "Third"}],
    )  # fmt: skip
    split = split_prompts(read_prompt_files([str(he), str(wrapped), str(train)]), 0.5, None)
    held_by_source = {
        s: {canonical(p.text) for p in split.held_out if p.source == s}
        for s in ("HumanEval", "humaneval")
    }
    assert held_by_source["HumanEval"] == held_by_source["humaneval"] == held_he
    assert [p.id for p in split.overlapping] == ["train:0"]
    assert "train:0" not in {p.id for p in split.held_out}  # training files are never held out
    # the wrapped copies of kept problems, a_kept again, and "Other " are duplicates
    assert split.duplicates == (40 - len(held_he)) + 2
    assert [p.id for p in split.train if p.source == "train"] == ["train:2", "train:4"]
    limited = split_prompts(read_prompt_files([str(he), str(train)]), 0.5, 1)
    assert [p.source for p in limited.train] == ["HumanEval", "train"]


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="the benchmark prompts are not here")
def test_split_of_the_benchmark_files():
    """Spec-Bench holds the 6-task set's mt_bench, qa and summarization prompts, the 6-task set's
    humaneval.jsonl is HumanEval's behind an instruction: one decision each, so nothing held out
    overlaps training, and about half of every evaluation file is held out."""
    paths = ["gsm8k_train.jsonl", "specbench_question.jsonl", "HumanEval.jsonl.gz"]
    paths += [f"moa_eval6/{n}.jsonl" for n in ("alpaca", "humaneval", "mt_bench", "qa", "sum")]
    files = read_prompt_files([str(SHARED_DATA / p) for p in paths])
    split = split_prompts(files, 0.5, None)
    assert split.overlapping == ()
    for f in files:
        held = sum(p.source == f.source for p in split.held_out)
        assert (held == 0) if not f.evaluation else 0.35 < held / len(f.prompts) < 0.65, f.source
    assert sum(p.source == "gsm8k_train" for p in split.train) == 7473


class StandIn:
    """A generator answering without a model: the answer names the prompt's length and seed."""

    def __init__(self, max_model_len: int = 10_000) -> None:
        self.max_model_len = max_model_len
        self.requests: list[Request] = []

    def generate(self, requests: list[Request]) -> list[Completion]:
        self.requests += requests
        return [Completion(f"n={len(r.prompt_ids)} s={r.seed}", 4, "length") for r in requests]


def config(tmp_path: Path, target: str, prompts: list[Path], **kw) -> RegenerateConfig:
    values = {"max_tokens": 8, "temperature": 0.0, "batch_size": 2, **kw}
    out = str(tmp_path / "out" / "data.jsonl")
    return RegenerateConfig(target=target, prompts=tuple(map(str, prompts)), out=out, **values)


def read_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_resume_and_the_records_train_reads(tmp_path, tiny_target_dir):
    from transformers import AutoTokenizer

    from vllm_moa.training.data import load_examples

    bench = many_prompts(tmp_path / "bench.jsonl", 12)
    gsm = write_jsonl(tmp_path / "gsm8k_train.jsonl", [{"question": f"Q{i}?"} for i in range(3)])
    cfg = config(tmp_path, tiny_target_dir, [bench, gsm])
    first = StandIn()
    summary = regenerate(cfg, first)
    out, held_path = Path(cfg.out), cfg.held_out_path
    records = read_records(out)
    split = split_prompts(read_prompt_files(cfg.prompts), 0.5, None)
    assert [r["id"] for r in records] == [p.id for p in split.train]
    assert summary.generated == len(first.requests) == len(records) == 12 - summary.held_out + 3
    held = read_records(held_path)
    assert {h["id"] for h in held} == {p.id for p in split.held_out}
    assert not {h["id"] for h in held} & {r["id"] for r in records}
    assert held[0].keys() == {"id", "source", "category", "prompt"}
    assert records[0]["messages"][0] == {"role": "user", "content": split.train[0].text}
    assert [r.seed for r in first.requests] == [prompt_seed(0, r["id"]) for r in records]
    # kill mid-write: two records lost and half a line left; the resumed run redoes those two
    held_bytes = held_path.read_bytes()
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:-2]) + lines[-2][:17])
    second = StandIn()
    resumed = regenerate(cfg, second)
    assert (resumed.generated, resumed.already_done) == (2, len(records) - 2)
    assert [r.prompt_ids for r in second.requests] == [r.prompt_ids for r in first.requests[-2:]]
    assert read_records(out) == records and held_path.read_bytes() == held_bytes
    assert regenerate(cfg, StandIn()).generated == 0
    # train's reader: one example per record, the loss on the assistant's tokens
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    examples = load_examples([out], tokenizer, 512)
    assert len(examples) == len(records)
    for example, record in zip(examples, records, strict=True):
        trained = [t for t, m in zip(example.input_ids, example.loss_mask, strict=True) if m]
        assert tokenizer.decode(trained) == record["messages"][-1]["content"] + "</s>\n"


def test_resume_refuses_other_settings_or_a_changed_split(tmp_path, tiny_target_dir):
    bench = many_prompts(tmp_path / "bench.jsonl", 12)
    cfg = config(tmp_path, tiny_target_dir, [bench])
    regenerate(cfg, StandIn())
    other = config(tmp_path, tiny_target_dir, [bench], seed=1)
    with pytest.raises(ValueError, match=r"seed=0 .* this run has 1: give --seed as before"):
        regenerate(other, StandIn())
    more = config(tmp_path, tiny_target_dir, [bench], hold_out=0.9)
    with pytest.raises(ValueError, match="responses to prompts this run holds out"):
        regenerate(more, StandIn())
    out = Path(cfg.out)
    out.write_text(out.read_text() + "{broken\n" + out.read_text())
    with pytest.raises(ValueError, match=r"data.jsonl:\d+ is not valid JSON"):
        regenerate(cfg, StandIn())


def test_no_chat_template(tmp_path, tiny_target_dir):
    """A tokenizer without a chat template is refused before anything is written, naming
    --no-chat-template; with it the raw prompt goes out and prompt/response records come back."""
    from transformers import AutoTokenizer

    from vllm_moa.training.data import load_examples

    target = tmp_path / "plain_target"
    shutil.copytree(tiny_target_dir, target)
    (target / "chat_template.jinja").unlink(missing_ok=True)
    tok_config = json.loads((target / "tokenizer_config.json").read_text())
    tok_config.pop("chat_template", None)
    (target / "tokenizer_config.json").write_text(json.dumps(tok_config))
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "def f(x):"}, {"prompt": "y = 2"}])
    cfg = config(tmp_path, str(target), [prompts])
    with pytest.raises(ValueError, match=r"has no chat template.*pass --no-chat-template"):
        regenerate(cfg, StandIn())
    assert not Path(cfg.out).exists()
    raw = config(tmp_path, str(target), [prompts], chat_template=False)
    stand_in = StandIn()
    regenerate(raw, stand_in)
    tokenizer = AutoTokenizer.from_pretrained(target)
    assert stand_in.requests[0].prompt_ids == tokenizer("def f(x):")["input_ids"]
    records = read_records(Path(raw.out))
    assert records[0]["prompt"] == "def f(x):" and records[0]["response"].startswith("n=")
    assert len(load_examples([raw.out], tokenizer, 512)) == 2


def test_too_long_prompts_are_skipped(tmp_path, tiny_target_dir):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "short"}, {"prompt": "long " * 200}])
    summary = regenerate(config(tmp_path, tiny_target_dir, [prompts]), StandIn(max_model_len=64))
    assert (summary.generated, summary.too_long) == (1, 1)


def test_cli_flags_map_onto_the_config():
    from vllm_moa.cli.main import build_parser
    from vllm_moa.cli.regenerate import config_from_args

    args = build_parser().parse_args(
        ["regenerate", "--target", "T", "--prompts", "a.jsonl", "b.jsonl.gz", "--out", "o.jsonl",
         "--temperature", "0", "--no-chat-template", "--kv-cache-gib", "4", "--enforce-eager"]
    )  # fmt: skip
    assert config_from_args(args) == RegenerateConfig(
        target="T", prompts=("a.jsonl", "b.jsonl.gz"), out="o.jsonl", temperature=0.0,
        chat_template=False, kv_cache_gib=4, enforce_eager=True,
    )  # fmt: skip
    assert args.func.__module__ == "vllm_moa.cli.regenerate"


@pytest.mark.parametrize(
    "change,match",
    [
        ({"out": "o.json"}, "out must be a .jsonl file"),
        ({"hold_out": 1.5}, r"hold_out must be a fraction in \[0, 1\], got 1.5"),
        ({"system": "S", "chat_template": False}, "--system needs the chat template"),
        ({"temperature": -1.0}, "temperature must be >= 0"),
        ({"dtype": "fp8"}, "dtype must be one of"),
    ],
)
def test_config_refusals(change, match):
    values = {"target": "T", "prompts": ("a.jsonl",), "out": "o.jsonl", **change}
    with pytest.raises(ValueError, match=match):
        RegenerateConfig(**values)
