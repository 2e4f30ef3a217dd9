"""Offline batch inference: ``LLM(model).generate(prompts)`` (vLLM-shaped)."""
from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.multimodal.chat import split_images
from engine.multimodal.inputs import ImagePatches
from engine.multimodal.processor import ImageProcessor, expand_image_tokens
from engine.outputs import BeamSearchOutput, BeamSequence, CompletionOutput, RequestOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import BeamSearchParams, SamplingParams

Prompt = str | dict  # text, or {"prompt": text, "multi_modal_data": {"image": ...}}


class LLM:
    """Runs an ``LLMEngine`` to completion over a list of prompts.

    ``skip_tokenizer_init=True`` serves checkpoints without tokenizer files:
    prompts must then be token ids and outputs carry no text.
    """

    def __init__(self, model: str | None = None, skip_tokenizer_init: bool = False, **config) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **config))
        self.tokenizer = None
        if not skip_tokenizer_init:
            from transformers import AutoTokenizer  # heavy import, only when text is wanted

            self.tokenizer = AutoTokenizer.from_pretrained(self.engine.config.tokenizer)
        self._request_ids = itertools.count()
        self._image_processor: ImageProcessor | None = None  # read on the first image

    def generate(self, prompts: Prompt | list[Prompt] | None = None,
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 prompt_token_ids: list[list[int]] | None = None, use_tqdm: bool = True,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """``priority``: one per prompt, lower first (as vLLM's). A prompt may be vLLM's
        ``{"prompt": text, "multi_modal_data": {"image": image or [images]}}`` (PIL images; the text holds one
        image placeholder, e.g. Qwen2.5-VL's ``<|vision_start|><|image_pad|><|vision_end|>``, per image)."""
        token_lists, texts, images = self._prompts(prompts, prompt_token_ids)
        params = _broadcast(sampling_params, len(token_lists))
        priorities = priority if priority is not None else [0] * len(token_lists)
        if len(priorities) != len(token_lists):
            raise ValueError(f"{len(priorities)} priorities for {len(token_lists)} prompts")
        results = self._run_all(token_lists, params, priorities, use_tqdm, images)
        for result, text in zip(results, texts):
            result.prompt = text
            self._decode(result)
        return results

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One conversation (or a list of them) in OpenAI's message shape, rendered by the tokenizer's chat
        template with the generation prompt; image parts (a data URL ``image_url``, or ``image_pil``) go in."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (LLM was built with skip_tokenizer_init=True)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = []
        for conversation in conversations:
            rendered, images = split_images(conversation)
            text = self.tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True,
                                                      **(chat_template_kwargs or {}))
            prompts.append({"prompt": text, "multi_modal_data": {"image": images}} if images else text)
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def embed(self, prompts: str | list[str] | None = None, pooling_params: PoolingParams | None = None,
              prompt_token_ids: list[list[int]] | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """One vector per prompt (``RequestOutput.embedding``), pooled as the checkpoint says (``PoolerConfig``)
        unless ``pooling_params`` say otherwise."""
        token_lists, texts, _ = self._prompts(prompts, prompt_token_ids)
        params = [pooling_params or PoolingParams()] * len(token_lists)
        results = self._run_all(token_lists, params, [0] * len(token_lists), use_tqdm)
        for result, text in zip(results, texts):
            result.prompt = text
        return results

    def _run_all(self, token_lists: list[list[int]], params: list[SamplingParams | PoolingParams],
                 priorities: list[int], use_tqdm: bool, images: list[list[ImagePatches]] | None = None
                 ) -> list[RequestOutput]:
        """Each prompt's whole output, in order; a prompt the engine refuses refuses them all."""
        ids = [str(next(self._request_ids)) for _ in token_lists]
        try:
            for request_id, tokens, p, rank, own in zip(ids, token_lists, params, priorities,
                                                        images or [None] * len(ids)):
                self.engine.add_request(request_id, tokens, p, priority=rank, images=own)
        except ValueError:
            self.engine.abort_request(ids)  # all or nothing: drop the prompts already queued
            raise
        finished = self._run(set(ids), use_tqdm)
        return [finished[i] for i in ids]

    def beam_search(self, prompts: list[str | list[int]], params: BeamSearchParams,
                    use_tqdm: bool = True) -> list[BeamSearchOutput]:
        """Beam search per prompt (text or token ids): the beam_width best hypotheses, best first."""
        token_lists = [self._prompts(p, None)[0][0] if isinstance(p, str) else list(p)  # tokenize text
                       for p in prompts]
        if not token_lists:
            return []
        results = self.generate(sampling_params=params.to_sampling_params(), prompt_token_ids=token_lists,
                                use_tqdm=use_tqdm)
        return [BeamSearchOutput([BeamSequence(c.token_ids, c.text, c.cumulative_logprob) for c in r.outputs])
                for r in results]

    def _prompts(self, prompts: Prompt | list[Prompt] | None, prompt_token_ids: list[list[int]] | None
                 ) -> tuple[list[list[int]], list[str | None], list[list[ImagePatches]]]:
        """Each prompt's token ids (image placeholders expanded), text and preprocessed images."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts and prompt_token_ids")
        if prompt_token_ids is not None:
            return [list(t) for t in prompt_token_ids], [None] * len(prompt_token_ids), [[]] * len(prompt_token_ids)
        if self.tokenizer is None:
            raise ValueError("text prompts need a tokenizer (LLM was built with skip_tokenizer_init=True)")
        items = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        texts = [p["prompt"] if isinstance(p, dict) else p for p in items]
        images = [self._images(p) if isinstance(p, dict) else [] for p in items]
        token_lists = [self.tokenizer(t).input_ids for t in texts]
        spec = self.engine.images.spec
        if spec is not None:  # a vision-language model: one placeholder token per embedding row
            token_lists = [expand_image_tokens(t, own, spec, self.tokenizer) for t, own in zip(token_lists, images)]
        return token_lists, texts, images

    def _images(self, prompt: dict) -> list[ImagePatches]:
        """A ``{"prompt", "multi_modal_data"}`` prompt's images through the checkpoint's image processor."""
        data = prompt.get("multi_modal_data") or {}
        unknown = set(data) - {"image"}
        if unknown:
            raise ValueError(f"multi_modal_data: unsupported modalities {sorted(unknown)} (only 'image')")
        images = data.get("image") or []
        images = [images] if not isinstance(images, list) else images
        if images and self.engine.images.spec is None:
            raise ValueError(f"this model ({self.engine.config.model_config.architecture}) is text-only: it takes "
                             "no images")
        if self._image_processor is None and images:
            self._image_processor = ImageProcessor(self.engine.config.model_config.path)
        return self._image_processor(images) if images else []

    def _run(self, pending: set[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        """Steps until every request finished, merging the incremental outputs."""
        merged: dict[str, RequestOutput] = {}
        with tqdm(total=len(pending), desc="Generating", unit="req",
                  disable=not (use_tqdm and self.engine.config.show_progress)) as bar:
            while pending:
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError(f"engine stopped with {len(pending)} requests unfinished")
                for out in self.engine.step():
                    if out.error:  # as vLLM does: an offline batch raises rather than hand back a failure
                        self.engine.abort_request(pending)
                        raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                    _merge(merged, out)
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        bar.update(1)
        return merged

    def _decode(self, result: RequestOutput) -> None:
        result.outputs.sort(key=lambda c: c.index)
        if self.tokenizer is not None:
            for c in result.outputs:
                c.text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)


def _merge(merged: dict[str, RequestOutput], out: RequestOutput) -> None:
    whole = merged.get(out.request_id)
    if whole is None:  # not setdefault: that would build a RequestOutput per request per step
        whole = merged[out.request_id] = RequestOutput(out.request_id, out.prompt_token_ids, [])
    whole.finished, whole.metrics = out.finished, out.metrics
    whole.num_cached_tokens = out.num_cached_tokens
    if out.prompt_logprobs is not None:  # on one output only
        whole.prompt_logprobs = out.prompt_logprobs
    if out.embedding is not None:
        whole.embedding = out.embedding
    by_index = {c.index: c for c in whole.outputs}
    for delta in out.outputs:
        c = by_index.get(delta.index)
        if c is None:
            c = CompletionOutput(delta.index, [], logprobs=[] if delta.logprobs is not None else None)
            whole.outputs.append(c)
        c.token_ids += delta.token_ids
        if delta.logprobs is not None:
            c.logprobs += delta.logprobs
        c.cumulative_logprob, c.finish_reason = delta.cumulative_logprob, delta.finish_reason


def _broadcast(params: SamplingParams | Seq[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling_params for {count} prompts")
    return params
