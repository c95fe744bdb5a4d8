"""``LLM``: vLLM's offline batch API on top of ``Engine``."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

from nbengine.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from nbengine.frontend.engine import Engine
from nbengine.frontend.handles import RequestHandle
from nbengine.lora.request import LoRARequest
from nbengine.outputs import RequestOutput
from nbengine.sampling_params import RequestOutputKind, SamplingParams
from nbengine.validation import is_int

__all__ = ["LLM"]

Prompt = str | Sequence[int] | dict[str, Any]  # dicts: {"prompt"|"prompt_token_ids": ...}


def _put_index(q: queue.Queue[int], i: int) -> Callable[[RequestHandle], None]:
    """A done callback that puts ``i`` on ``q``."""
    return lambda _h: q.put(i)


def _is_token_ids(x: object) -> bool:
    return (
        isinstance(x, Sequence)
        and not isinstance(x, (str, bytes))
        and len(x) > 0
        and all(is_int(t) for t in x)
    )


class LLM:
    """Offline generation: ``LLM(model).generate(prompts, params)`` -> outputs in input order.

    Keyword arguments are those of ``Engine``. One engine per ``LLM``; release it with
    ``shutdown()`` or ``with LLM(...) as llm:`` (it is also shut down at exit).
    """

    def __init__(self, model: str | Path | None = None, **kwargs: Any) -> None:
        self.engine = Engine(model, **kwargs)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (str or token ids) and return outputs in input order.

        ``lora_request``: one LoRA adapter for every prompt, or a list with one (or None)
        per prompt (docs/lora.md).

        ``sampling_params`` is one ``SamplingParams`` for all prompts or a list with one
        per prompt; None uses ``engine.get_default_sampling_params()`` (the model's
        generation_config.json). Outputs are FINAL_ONLY. A tqdm progress bar shows prompts done and
        output tokens/s (``use_tqdm=False`` turns it off). KeyboardInterrupt aborts the
        unfinished requests and re-raises.
        """
        if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
            prompt_list: list[Prompt] = [prompts]  # type: ignore[list-item]
        elif isinstance(prompts, Sequence):
            prompt_list = list(cast("Sequence[Prompt]", prompts))  # not token ids: prompts
        else:
            raise TypeError(
                f"prompts must be a str, a list of token ids, or a list of either; got "
                f"{type(prompts).__name__}."
            )
        if sampling_params is None:
            params_list = [self.engine.get_default_sampling_params()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"Got {len(params_list)} sampling params for {len(prompt_list)} prompts; "
                    "give one SamplingParams or one per prompt."
                )
        final_params: list[SamplingParams] = []
        for sp in params_list:
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params must be SamplingParams, got {type(sp).__name__}.")
            final_params.append(sp.replace(output_kind=RequestOutputKind.FINAL_ONLY))
        loras: list[LoRARequest | None]
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompt_list)
        elif isinstance(lora_request, Sequence) and not isinstance(lora_request, str):
            loras = list(lora_request)
        else:
            raise TypeError(
                f"lora_request must be a LoRARequest or a list of them, got "
                f"{type(lora_request).__name__}."
            )
        done_q: queue.Queue[int] = queue.Queue()
        handles: list[RequestHandle] = []
        try:
            # Validates every prompt first, so a bad one leaves no request behind.
            handles = self.engine.generate_many(prompt_list, final_params, loras)
            for i, h in enumerate(handles):
                h.add_done_callback(_put_index(done_q, i))
            return self._collect(handles, done_q, use_tqdm)
        except BaseException:
            unfinished = [h for h in handles if not h.done()]
            for h in unfinished:
                try:
                    h.cancel()
                except Exception:
                    pass
            raise

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        tool_call_parser: str | None = None,
    ) -> list[RequestOutput]:
        """The assistant's reply to one conversation or to each of a list of them, as vLLM's
        ``LLM.chat``: one output per conversation, in order, whose ``prompt`` is the
        rendered conversation. The template options, ``tools`` and ``tool_call_parser``
        (parsed calls on each output) are ``Engine.chat``'s."""
        from nbengine.frontend.chat import llm_chat

        return llm_chat(
            self,
            messages,
            sampling_params,
            use_tqdm,
            tool_call_parser,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )

    def _collect(
        self, handles: list[RequestHandle], done_q: queue.Queue[int], use_tqdm: bool
    ) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        bar = tqdm(
            total=len(handles), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True
        )
        start = time.monotonic()
        out_tokens = 0
        remaining = len(handles)
        try:
            while remaining:
                try:
                    i = done_q.get(timeout=0.1)
                except queue.Empty:
                    self.engine.check_health()
                    continue
                remaining -= 1
                final = handles[i].final_output
                if final is not None:
                    out_tokens += sum(len(c.token_ids) for c in final.outputs)
                elapsed = max(time.monotonic() - start, 1e-9)
                bar.set_postfix_str(f"output: {out_tokens / elapsed:.1f} toks/s", refresh=False)
                bar.update(1)
        finally:
            bar.close()
        return [h.result() for h in handles]

    def beam_search(self, prompts: Any, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: the best ``params.beam_width`` sequences of each
        prompt (text, token ids or a prompt dict), best first (nbengine/beam_search.py)."""
        return beam_search(self.engine, prompts, params)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache (``Engine.reset_prefix_cache``)."""
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine and free the model; idempotent."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
