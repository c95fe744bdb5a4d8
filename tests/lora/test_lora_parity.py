"""LoRA adapters per request: greedy float32 parity with transformers + PEFT (docs/lora.md).

Each architecture's tiny random base gets two adapters with random non-zero ``lora_B``;
requests under either adapter and under the base run alone and mixed in one batch, and
each must produce exactly the tokens transformers + PEFT produce for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

from lora_setup import N_NEW, PROMPTS, hf_greedy, make_adapter, tiny

import nbengine as nb

GREEDY = nb.SamplingParams(max_tokens=N_NEW, temperature=0.0, ignore_eos=True)


class Case:
    def __init__(self, root: Path, arch: str) -> None:
        self.base = tiny(root / "base", arch)
        self.dir_a, self.peft_a = make_adapter(self.base, root / "a", arch, seed=1)
        self.dir_b, self.peft_b = make_adapter(self.base, root / "b", arch, seed=2, use_rslora=True)
        self.engine = nb.Engine(
            self.base,
            dtype="float32",
            enable_lora=True,
            max_loras=2,
            block_size=4,
            num_kv_blocks=256,
        )
        tok = self.engine.tokenizer
        self.ids = [list(tok.encode(p)) for p in PROMPTS]
        self.a = nb.LoRARequest("a", 1, str(self.dir_a))
        self.b = nb.LoRARequest("b", 2, str(self.dir_b))
        self._ref: dict[tuple[str, int], list[int]] = {}

    def ref(self, which: str, i: int) -> list[int]:
        """transformers + PEFT under adapter ``which`` ("a", "b", "base")."""
        if (which, i) not in self._ref:
            if which == "base":
                with self.peft_a.disable_adapter():
                    self._ref[which, i] = hf_greedy(self.peft_a, self.ids[i])
            else:
                model = self.peft_a if which == "a" else self.peft_b
                self._ref[which, i] = hf_greedy(model, self.ids[i])
        return self._ref[which, i]

    def lora(self, which: str) -> nb.LoRARequest | None:
        return {"a": self.a, "b": self.b, "base": None}[which]

    def run(self, which: str, i: int, **kw: Any) -> nb.RequestOutput:
        h = self.engine.generate(self.ids[i], GREEDY, lora_request=self.lora(which), **kw)
        return h.result(timeout=120)


@pytest.fixture(scope="module", params=["llama", "qwen2", "gpt2", "gemma2", "phi3"])
def case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Case]:
    c = Case(tmp_path_factory.mktemp(f"lora-{request.param}"), request.param)
    try:
        yield c
    finally:
        c.engine.shutdown()


def test_each_adapter_alone_matches_peft(case: Case) -> None:
    for which in ("a", "b"):
        out = case.run(which, 0)
        assert out.outputs[0].token_ids == case.ref(which, 0), which
    # the adapters matter: each differs from the base model
    assert case.ref("a", 0) != case.ref("base", 0) or case.ref("b", 0) != case.ref("base", 0)


def test_mixed_batch_of_adapters_and_base_matches_peft(case: Case) -> None:
    plan = [("a", 0), ("base", 1), ("b", 2), ("b", 0), ("a", 1), ("base", 2)]
    handles = case.engine.generate_many(
        [case.ids[i] for _, i in plan],
        [GREEDY] * len(plan),
        [case.lora(w) for w, _ in plan],
    )
    got = [h.result(timeout=120).outputs[0].token_ids for h in handles]
    assert got == [case.ref(w, i) for w, i in plan]


def test_llm_generate_takes_one_adapter_or_one_per_prompt(case: Case) -> None:
    llm = nb.LLM.__new__(nb.LLM)  # an LLM over the case's engine
    llm.engine, llm.tokenizer = case.engine, case.engine.tokenizer
    one = llm.generate(case.ids[:2], GREEDY, use_tqdm=False, lora_request=case.a)
    assert [o.outputs[0].token_ids for o in one] == [case.ref("a", 0), case.ref("a", 1)]
    each = llm.generate(case.ids[:2], GREEDY, use_tqdm=False, lora_request=[case.b, None])
    assert [o.outputs[0].token_ids for o in each] == [case.ref("b", 0), case.ref("base", 1)]


def test_prefix_cache_never_crosses_adapters(case: Case) -> None:
    """The same prompt under A, then B, then the base, then A again: each gets its own
    output; only the repeat under A hits the prefix cache."""
    i = 2  # the longest prompt: several full blocks of 4
    case.engine.reset_prefix_cache()
    first = case.run("a", i)
    assert first.outputs[0].token_ids == case.ref("a", i)
    for which in ("b", "base"):
        out = case.run(which, i)
        assert out.outputs[0].token_ids == case.ref(which, i), which
        assert out.num_cached_tokens == 0, which
    again = case.run("a", i)
    assert again.outputs[0].token_ids == case.ref("a", i)
    assert again.num_cached_tokens > 0


def test_adapter_from_a_peft_model_in_memory(case: Case) -> None:
    mem = nb.LoRARequest.from_peft(case.peft_b, "b-in-memory")
    try:
        out = case.engine.generate(case.ids[1], GREEDY, lora_request=mem).result(timeout=120)
        assert out.outputs[0].token_ids == case.ref("b", 1)
    finally:
        assert case.engine.remove_lora(mem.lora_int_id)


def test_chat_takes_a_lora_request(case: Case) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    h = case.engine.chat(
        [{"role": "user", "content": PROMPTS[0]}],
        GREEDY,
        chat_template=template,
        add_generation_prompt=False,
        lora_request=case.a,
    )
    assert h.lora_request is case.a
    expected = hf_greedy(case.peft_a, list(h.prompt_token_ids))
    assert h.result(timeout=120).outputs[0].token_ids == expected


def test_device_path_mixed_batch_matches_peft(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device path (torch ops, one staged copy per step; run on the CPU here)."""
    monkeypatch.setenv("NBENGINE_DEVICE_PATH", "1")
    plan = [("a", 0), ("base", 1), ("b", 2), ("a", 2)]
    with nb.Engine(
        case.base, dtype="float32", enable_lora=True, max_loras=2, num_kv_blocks=128
    ) as engine:
        handles = engine.generate_many(
            [case.ids[i] for _, i in plan], [GREEDY] * len(plan), [case.lora(w) for w, _ in plan]
        )
        got = [h.result(timeout=120).outputs[0].token_ids for h in handles]
    assert got == [case.ref(w, i) for w, i in plan]
